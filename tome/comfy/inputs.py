"""The ToMe node's inputs, generated from ``ToMeConfig``'s field metadata (label, help,
range, choices), and the one way back from the node's values to a ``ToMeConfig``.

ComfyUI's classic node API: ``INPUT_TYPES`` answers ``{"required": {name: (TYPE, options)},
"optional": {...}}``; a combo is ``(list_of_choices, options)``. ComfyUI refuses a graph whose
numbers are outside ``min``/``max`` (HTTP 400 from ``/prompt``); what a range cannot say (the
ratio's limit depends on the stride) is ``ToMeConfig``'s error when the node runs.

In front: the preset and the inputs most users touch (``FRONT``); every other input carries
``"advanced": True``, the option ComfyUI's own nodes use (its frontends fold such inputs away;
one that does not know it shows them as before). The order of the inputs never changes: a saved
graph keeps its widget values by position.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import AUTO, FIELDS, MAX_STRIDE, PRESETS, ToMeConfig, choices, preset, ratio_limit

CUSTOM = "custom"
# The node's default preset: balanced on a UNet, quality on a DiT (merge has no DiT form, so
# one preset cannot be both); which one is resolved when the node runs and said on the console.
RECOMMENDED = "recommended"
PER_KIND = {"unet": "balanced", "dit": "quality"}
PRESET_CHOICES = (RECOMMENDED, CUSTOM, *PRESETS)
# The node's defaults: the library's, except the policy (auto: never slower than without).
DEFAULT = ToMeConfig(policy="auto")
# In the node's order, which never changes (a saved graph keeps its widget values by position);
# the later settings are optional inputs.
MAIN = ("method", "ratio", "downsample_factor", "max_downsample", "sx", "sy", "use_rand",
        "seed", "start", "end", "policy")
# Config fields added later join the advanced inputs in their declaration order (merge_attn
# is no input: the node always merges self-attention).
_ADVANCED = ("merge_crossattn", "merge_mlp", "matching", "share", "rope", "blocks")
ADVANCED = _ADVANCED + tuple(name for name in FIELDS
                             if name not in (*MAIN, *_ADVANCED, "merge_attn"))
# The inputs shown without unfolding the advanced ones (with the model and the preset).
FRONT = ("method", "ratio", "downsample_factor", "policy")
# What a preset leaves to the node: the seed of the random destinations.
PRESET_KEEPS = ("seed",)
SEED_MAX = 0xFFFFFFFFFFFFFFFF  # as ComfyUI's samplers
PRESET_HELP = ("Named settings (" + "; ".join(
    f"{k}: " + ", ".join(f"{n} {v}" for n, v in values.items())
    for k, values in PRESETS.items()) + f"). {RECOMMENDED} (the default): "
    f"{PER_KIND['unet']} on a UNet, {PER_KIND['dit']} on a DiT. A preset replaces every input "
    "below except the seed; custom uses the inputs as set.")


def spec(name: str) -> tuple:
    """One input's ComfyUI spec from the field's metadata (advanced unless in ``FRONT``)."""
    kind, options = _spec(name)
    return kind, options if name in FRONT else {**options, "advanced": True}


def _spec(name: str) -> tuple:
    f, default = FIELDS[name], getattr(DEFAULT, name)
    meta = f.metadata
    tip = f"{meta['help']}"
    if "choices" in meta:
        values = [str(c) for c in choices(name)]
        shown = AUTO if default is None else str(default)
        return values, {"default": shown, "tooltip": tip}
    if isinstance(default, bool):
        return "BOOLEAN", {"default": default, "tooltip": tip}
    if isinstance(default, str):
        return "STRING", {"default": default, "tooltip": tip}
    if isinstance(default, int):
        top = SEED_MAX if name == "seed" else meta.get("maximum", SEED_MAX)
        options = {"default": default, "min": meta.get("minimum", 0), "max": top,
                   "step": meta.get("step", 1), "tooltip": tip}
        if name == "seed":
            # The frontend gives any input named "seed" a "control after generate" widget set
            # to randomize, which would change the destinations at every queued run: the same
            # settings must give the same image, so none (the frontend reads this option).
            options["control_after_generate"] = False
        return "INT", options
    top = meta.get("maximum", ratio_limit(MAX_STRIDE, MAX_STRIDE) if name == "ratio" else 1.0)
    top = math.floor(top * 1e4) / 1e4  # never above the real limit
    return "FLOAT", {"default": default, "min": meta.get("minimum", 0.0), "max": top,
                     "step": meta.get("step", 0.01), "round": False, "tooltip": tip}


def input_types() -> dict[str, dict[str, tuple]]:
    required: dict[str, tuple] = {
        "model": ("MODEL", {"tooltip": "The model to merge tokens in (never changed itself: "
                                       "the output is a patched clone)."}),
        "preset": (list(PRESET_CHOICES), {"default": RECOMMENDED, "tooltip": PRESET_HELP}),
    }
    required.update({name: spec(name) for name in MAIN})
    return {"required": required, "optional": {name: spec(name) for name in ADVANCED}}


def preset_name(values: dict[str, Any]) -> str:
    """The node's preset, as chosen (``recommended`` not yet resolved)."""
    return str(values.get("preset", CUSTOM)).strip().lower()


def config(values: dict[str, Any], kind: str = "unet") -> ToMeConfig:
    """The ``ToMeConfig`` of the node's values on a model of ``kind`` (``"unet"`` or ``"dit"``:
    what ``recommended`` resolves to), ``ValueError`` naming the setting otherwise. Unknown
    names raise: a graph from another version of the pack says so."""
    values = dict(values)
    key = preset_name(values)
    values.pop("preset", None)
    if key == RECOMMENDED:
        key = PER_KIND[kind]
    if key != CUSTOM:
        kept = {k: values[k] for k in PRESET_KEEPS if k in values}
        return ToMeConfig.from_dict(kept, base=preset(key))
    return ToMeConfig.from_dict(values, base=DEFAULT)
