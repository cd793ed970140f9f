"""``backend.args``: the process-wide ``dynamic_args`` (Kontext / ImageStitch reference latents
reach Flux and Qwen-Image through it, not through the conditioning)."""

from types import SimpleNamespace

dynamic_args = SimpleNamespace(ref_latents=[])
