"""What the ComfyUI tests share: the node's values as a fresh node in the graph editor has
them, and the key lengths the stand-in Flux's attention calls hand the backend."""

from __future__ import annotations

from typing import Any

from tome.comfy import inputs


def defaults(**changes: Any) -> dict[str, Any]:
    """The node's default values with preset custom (the inputs as set) unless ``changes``
    name one."""
    spec = inputs.input_types()
    values = {name: opts.get("default") for part in spec.values()
              for name, (_, opts) in part.items() if name != "model"}
    return {**values, "preset": inputs.CUSTOM, **changes}


def flux_key_lengths(monkeypatch: Any) -> list[int]:
    """The key lengths each attention call of the ComfyUI stand-in's Flux hands the backend
    (behind the attention override), as a list that fills while sampling."""
    import comfy.ldm.flux.math
    from comfy.ldm.modules import attention as comfy_attention
    seen: list[int] = []

    @comfy_attention.wrap_attn
    def attention_pytorch(q, k, v, heads, mask=None, **kw):
        seen.append(k.shape[2 if kw.get("skip_reshape") else 1])
        return comfy_attention.attention_pytorch.__wrapped__(q, k, v, heads, mask, **kw)

    monkeypatch.setattr(comfy.ldm.flux.math, "optimized_attention", attention_pytorch)
    return seen
