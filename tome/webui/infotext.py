"""Infotext: the ``ToMe ...`` keys written under each image, and reading them back into controls.

Only settings that changed the image are written, and config fields only when they differ
from the *library's* defaults, so a typical line is ``ToMe ratio: 0.5, ToMe policy: auto``.
Reading back therefore treats a missing key as the library default once any ToMe key is
present, and turns ToMe off when none is: pasting an image's parameters restores exactly the
settings that made it. In particular an image made before the ``auto`` policy existed (no
``ToMe policy`` key) reads back as ``fixed``, which is how it was made, although new images
default to ``auto``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .. import methods
from ..config import DIT_FIELDS, FIELDS, ToMeConfig, coerce, preset
from . import script_args as S

CONFIG_KEYS = {name: FIELDS[name].metadata["infotext"] for name in S.CONFIG_KEYS}
PRESET = "ToMe preset"
HIRES_ONLY = "ToMe hires only"
HR_RATIO = "ToMe hr ratio"
# Notes, not settings: why a model or some blocks were left alone; what the auto policy chose
# and why; which levels it merged per pass (pasting reads that back as fixed settings, so the
# image reproduces on any machine, whatever that machine would measure).
PASS_LABELS = {"first": "first pass", "hires": "hires pass", "img2img": "img2img"}
SKIPPED = "ToMe skipped"
STEPS = "ToMe steps"  # which steps the start/end window merged, per pass
RESOLVED = "ToMe DiT"  # what a DiT pass's settings resolved to (schedule, reuse, bias)
AUTO = "ToMe auto"
MERGED = "ToMe merged"
# arg name -> infotext key, for every positional argument except ``enabled``.
KEYS = {**CONFIG_KEYS, "hires_only": HIRES_ONLY, "hr_ratio": HR_RATIO, "preset": PRESET}
# The keys that say how an image was merged (pasting them back turns ToMe on).
SETTINGS_KEYS = (*KEYS.values(), AUTO, MERGED)
ALL_KEYS = (*SETTINGS_KEYS, SKIPPED, STEPS, RESOLVED)
_LIBRARY = ToMeConfig()


def build(s: S.ScriptSettings, passes: Mapping[str, ToMeConfig | None],
          ignores: tuple[str, ...] = DIT_FIELDS) -> dict[str, Any]:
    """The infotext entries of a generation with settings ``s`` and per-pass configs
    ``passes`` on a model that ``ignores`` these config fields (its ``Layout.facts.ignores``:
    a UNet image lists no DiT field, and a DiT image always lists ``proportional``, which
    images from before it existed lack); empty when ToMe changes nothing in any pass."""
    if not any(cfg is not None for cfg in passes.values()):
        return {}
    cfg = passes.get("img2img") or s.config  # img2img's config carries its own ratio
    out: dict[str, Any] = {}
    if s.preset is not None:
        out[PRESET] = s.preset
    for name, value in relevant(cfg, ignores).items():
        if name in ("ratio", "proportional") or value != getattr(_LIBRARY, name):
            out[CONFIG_KEYS[name]] = value
    if passes.get("hires") is not None:
        if s.hires_only:
            out[HIRES_ONLY] = True
        if s.hr_ratio and s.hr_ratio != cfg.ratio and "ratio" in relevant(cfg, ignores):
            out[HR_RATIO] = s.hr_ratio
    return out


def relevant(cfg: ToMeConfig, ignores: tuple[str, ...] = DIT_FIELDS) -> dict[str, Any]:
    """The config fields that can change the image under the chosen method on a model that
    ``ignores`` these (a UNet reads no DiT field)."""
    skip = methods.get(cfg.method).ignores + tuple(ignores)
    return {name: getattr(cfg, name) for name in S.CONFIG_KEYS if name not in skip}


def ignored_by(params: Mapping[str, Any]) -> tuple[str, ...]:
    """The config fields the model an infotext was written for ignores: none where it lists
    a DiT field (a DiT image), else the DiT fields (a UNet image)."""
    return () if any(CONFIG_KEYS[n] in params for n in DIT_FIELDS) else DIT_FIELDS


def has_tome(params: Mapping[str, Any]) -> bool:
    return any(k in params for k in KEYS.values())


def merged_text(merged: Mapping[str, list[int]]) -> str:
    """``first pass none | hires pass ds1``: the levels the auto policy merged per pass."""
    return " | ".join(f"{PASS_LABELS[name]} " + (", ".join(f"ds{lv}" for lv in levels)
                                                  or "none") for name, levels in merged.items())


def _merged_levels(params: Mapping[str, Any]) -> list[list[int]] | None:
    """The levels the auto policy merged in each pass, from ``MERGED``; None without it."""
    if MERGED not in params or str(params.get(CONFIG_KEYS["policy"], "")).lower() != "auto":
        return None
    out = []
    for part in str(params[MERGED]).split("|"):
        part = part.strip()
        label = next((v for v in PASS_LABELS.values() if part.startswith(v)), "")
        out.append(sorted(int(w.strip()[2:]) for w in part[len(label):].split(",")
                          if w.strip().startswith("ds") and w.strip()[2:].isdigit()))
    return out


def as_made(params: Mapping[str, Any]) -> Mapping[str, Any]:
    """The settings that reproduce an image made with the ``auto`` policy: the levels it merged
    (``MERGED``) as ``fixed`` settings, whatever this machine would measure. ``max_downsample``
    is the deepest level merged; a first pass that merged nothing before a hires pass that did
    is ``hires only``. (Where nothing was merged at all, ToMe is turned off: ``enabled``.)"""
    levels = _merged_levels(params)
    merged = [lv for lvs in levels or () for lv in lvs]
    if not merged:
        return params
    out = {**params, CONFIG_KEYS["policy"]: "fixed", CONFIG_KEYS["max_downsample"]: max(merged)}
    if len(levels) > 1 and not levels[0]:
        out[HIRES_ONLY] = True
    return out


def _enabled(params: Mapping[str, Any]) -> bool:
    """Any ToMe key, and, for an auto image, a level it merged."""
    levels = _merged_levels(params)
    return has_tome(params) and (levels is None or any(levels))


def reader(name: str, default: Any) -> Callable[[Mapping[str, Any]], Any]:
    """A paste-field function for the control of ``name`` (an entry of ``script_args.ARGS``).

    Returns a value of the component's own type (the API applies ``type(component.value)(v)``,
    which would make the string "False" true), or None to leave the control alone.
    """
    if name == "enabled":
        return _enabled
    if name == "preset":
        return lambda params: _read_preset(as_made(params))
    key = KEYS[name]

    def read(params: Mapping[str, Any]) -> Any:
        params = as_made(params)
        if not has_tome(params):
            return None
        raw = params.get(key)
        if raw is None and name == "proportional" and name not in ignored_by(params):
            return False  # a DiT image always lists it: this one predates it (pooled plainly)
        if raw is None:
            return _plain_default(name, default)
        try:
            if name == "hires_only":
                return S.to_bool(name, raw)
            if name == "hr_ratio":
                return S.to_ratio(name, raw)
            value = coerce(FIELDS[name], raw)  # types only: the generation validates
        except ValueError:
            return None
        if name == "max_downsample":
            return "auto" if value is None else str(value)
        return value
    return read


def _read_preset(params: Mapping[str, Any]) -> str | None:
    """The preset's name, but only while it still stands for the settings the image lists;
    otherwise Custom, so the individual controls (restored from their keys) apply."""
    if not has_tome(params):
        return None
    try:
        key = S.preset_key(params.get(PRESET))
        if key is None:
            return S.CUSTOM
        pasted = ToMeConfig.from_dict({name: params[k] for name, k in CONFIG_KEYS.items()
                                       if k in params})
        ignores = ignored_by(params)
        return S.preset_label(key) if relevant(pasted, ignores) == relevant(preset(key), ignores) \
            else S.CUSTOM
    except ValueError:
        return S.CUSTOM


def _plain_default(name: str, default: Any) -> Any:
    """The value a missing key stands for: the library default (what the writer omitted)."""
    if name in CONFIG_KEYS:
        return S.control_values(_LIBRARY)[name]
    return type(default)()  # hires_only False, hr_ratio 0.0
