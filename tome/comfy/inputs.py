"""The ToMe node's inputs, generated from ``ToMeConfig``'s field metadata (label, help,
range, choices), and the one way back from the node's values to a ``ToMeConfig``.

ComfyUI's classic node API: ``INPUT_TYPES`` answers ``{"required": {name: (TYPE, options)},
"optional": {...}}``; a combo is ``(list_of_choices, options)``. ComfyUI refuses a graph whose
numbers are outside ``min``/``max`` (HTTP 400 from ``/prompt``); what a range cannot say (the
ratio's limit depends on the stride) is ``ToMeConfig``'s error when the node runs.

In front: the preset and the inputs most users touch (``FRONT``); every other input carries
``"advanced": True``, the option ComfyUI's own nodes use (Nodes 2.0 folds such inputs away; the
classic canvas folds them through the pack's frontend extension, ``web/tome.js``). The order of
the inputs never changes: a saved graph keeps its widget values by position.

A widget means what it shows: under a preset, an input set away from its default applies over
the preset (``config``), and choosing a preset on the canvas fills the inputs with its values
(``web/tome.js``, from ``PRESETS``), so the canvas shows what runs.
"""

from __future__ import annotations

import math
from typing import Any

from ..config import AUTO, FIELDS, MAX_STRIDE, PRESETS, ToMeConfig, choices, preset, ratio_limit

CUSTOM = "custom"
# The node's default preset: balanced on a UNet, quality on a DiT (merge has no DiT form, so
# one preset cannot be both); which one is resolved when the node runs and said on the console.
# On a video DiT, quality's reuse with x2 cells over 2 frames (``PER_KIND_CHANGES``; 7 of 8
# keys removed, where quality's x8 leaves a tiny model's 8x8-token frames one key): on the
# tiny video DiT 34.7 dB at 20 steps against quality's 27.7 dB, 1.19x against 1.30x (CPU)
# (docs/quality.md#the-video-frontier).
RECOMMENDED = "recommended"
PER_KIND = {"unet": "balanced", "dit": "quality", "video": "quality"}
PER_KIND_CHANGES: dict[str, dict[str, Any]] = {"video": {"schedule": "all:2", "temporal": 2}}
KIND_WORDS = {"unet": "UNet", "dit": "DiT", "video": "video DiT"}
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
# What a preset never sets: the seed of the random destinations and the policy (whether a level
# is merged where it does not pay is the user's, whatever the settings).
PRESET_KEEPS = ("seed", "policy")
SEED_MAX = 0xFFFFFFFFFFFFFFFF  # as ComfyUI's samplers
PRESET_HELP = ("Named settings (" + "; ".join(
    f"{k}: " + ", ".join(f"{n} {v}" for n, v in values.items() if n not in PRESET_KEEPS)
    for k, values in PRESETS.items()) + f"). {RECOMMENDED} (the default): "
    f"{PER_KIND['unet']} on a UNet, {PER_KIND['dit']} on a DiT, {PER_KIND['video']} with "
    "schedule all:2 and temporal 2 (2x2 cells over 2 frames) on a video DiT. Under a preset, "
    "an input set away from its default applies over the preset (choosing a preset fills the "
    "inputs with its values); the seed and the policy are always the inputs'; custom uses the "
    "inputs as set.")


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


def recommended(kind: str) -> ToMeConfig:
    """What ``recommended`` is on a model of ``kind`` (``"unet"``, ``"dit"``, ``"video"``)."""
    return preset(PER_KIND[kind], **PER_KIND_CHANGES.get(kind, {}))


def config(values: dict[str, Any], kind: str = "unet") -> ToMeConfig:
    """The ``ToMeConfig`` of the node's values on a model of ``kind`` (``"unet"``, ``"dit"``
    or ``"video"``: what ``recommended`` resolves to), ``ValueError`` naming the setting
    otherwise. Unknown names raise: a graph from another version of the pack says so.

    Under a preset, what the canvas shows runs: every input whose value is not the node's
    default (``overrides``) applies over the preset, and the seed and policy are always the
    inputs'. A node left at its defaults (every example workflow, every node added and only
    given a preset) runs the preset as before."""
    values = dict(values)
    key = preset_name(values)
    values.pop("preset", None)
    if key == CUSTOM:
        return ToMeConfig.from_dict(values, base=DEFAULT)
    base = recommended(kind) if key == RECOMMENDED else preset(key)
    kept = {k: values[k] for k in PRESET_KEEPS if k in values}
    return ToMeConfig.from_dict({**overrides(values, base), **kept}, base=base)


def overrides(values: dict[str, Any], base: ToMeConfig | None = None) -> dict[str, Any]:
    """The node's inputs set away from their defaults (what a user changed on the canvas),
    without those the preset ``base`` already has and without ``PRESET_KEEPS``. A value is
    compared as ``ToMeConfig`` reads it (``"auto"`` and None, 2 and 2.0 are the same)."""
    check = ToMeConfig.from_dict({k: v for k, v in values.items() if k in FIELDS})
    return {k: v for k, v in values.items()
            if k in FIELDS and k not in PRESET_KEEPS
            and getattr(check, k) != getattr(DEFAULT, k)
            and (base is None or getattr(check, k) != getattr(base, k))}


def preset_line(values: dict[str, Any], kind: str = "unet") -> str | None:
    """The console line of a preset: what ``recommended`` is on this model, and which inputs
    set on the node apply over the preset; None for custom, or a named preset as it is."""
    key = preset_name(values)
    if key == CUSTOM:
        return None
    name = PER_KIND[kind] if key == RECOMMENDED else key
    base = recommended(kind) if key == RECOMMENDED else preset(name)
    changed = overrides({k: v for k, v in values.items() if k != "preset"}, base)
    over = ", ".join(f"{k} {v}" for k, v in changed.items())
    schedule = preset(name).schedule
    if kind != "unet" and "downsample_factor" in changed and "schedule" not in changed \
            and schedule:  # an empty schedule is the default, so it reads as the preset's
        over += (f" (on this DiT the preset's schedule {schedule} sets the factors; preset "
                 "custom with an empty schedule uses downsample_factor)")
    if key == RECOMMENDED:
        extra = ", ".join(f"{k} {v}" for k, v in PER_KIND_CHANGES.get(kind, {}).items())
        extra = f" with {extra}" if extra else ""
        head = f"ToMe: preset {RECOMMENDED} is {name}{extra} on this {KIND_WORDS[kind]}"
        return head + (f"; set on the node, over it: {over}" if over
                       else " (preset custom uses the node's inputs)")
    return f"ToMe: preset {name}; set on the node, over it: {over}" if over else None


def widget_value(name: str, value: Any) -> Any:
    """``value`` as the node's widget shows it (a combo's choices are strings, None is auto)."""
    if "choices" in FIELDS[name].metadata:
        return AUTO if value is None else str(value)
    return value


def frontend_table() -> dict[str, Any]:
    """What the frontend extension (``web/tome.js``, its ``TABLE`` line) needs: the widgets a
    preset fills in when it is chosen (every input but ``PRESET_KEEPS``: the node's defaults for
    ``recommended``, which resolves per model when the node runs; each named preset's values
    over them), and the inputs folded as advanced."""
    names = [n for n in (*MAIN, *ADVANCED) if n not in PRESET_KEEPS]
    fills = {RECOMMENDED: {n: widget_value(n, getattr(DEFAULT, n)) for n in names}}
    for key in PRESETS:
        config = preset(key)
        fills[key] = {n: widget_value(n, getattr(config, n)) for n in names}
    return {"fills": fills, "advanced": [n for n in (*MAIN, *ADVANCED) if n not in FRONT]}
