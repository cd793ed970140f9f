"""Infotext: the ``ToMe ...`` keys written under each image, and reading them back into controls.

Only settings that changed the image are written, and config fields only when they differ
from the library's defaults, so a typical line is ``ToMe ratio: 0.5``. Reading back therefore
treats a missing key as its default once any ToMe key is present, and turns ToMe off when none
is: pasting an image's parameters restores exactly the settings that made it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..config import ToMeConfig, coerce
from . import settings as S

_FIELDS = {f.name: f for f in dataclasses.fields(ToMeConfig)}
CONFIG_KEYS = {name: _FIELDS[name].metadata["infotext"] for name in S.CONFIG_KEYS}
HIRES_ONLY = "ToMe hires only"
HR_RATIO = "ToMe hr ratio"
SKIPPED = "ToMe skipped"
# arg name -> infotext key, for every positional argument except ``enabled``.
KEYS = {**CONFIG_KEYS, "hires_only": HIRES_ONLY, "hr_ratio": HR_RATIO}
ALL_KEYS = (*KEYS.values(), SKIPPED)
_DEFAULTS = ToMeConfig()


def build(settings: S.ScriptSettings, *, img2img: bool, hires: bool) -> dict[str, Any]:
    """The infotext entries of a generation, empty when ToMe changes nothing in any pass.

    ``hires``: a hires-fix pass will run (txt2img only).
    """
    first = settings.pass_config(hires=False, img2img=img2img)
    second = settings.pass_config(hires=True) if hires and not img2img else None
    if first is None and second is None:
        return {}
    cfg = settings.config
    if img2img:
        cfg = cfg.replace(ratio=settings.img2img_ratio or cfg.ratio)
    out: dict[str, Any] = {}
    for name, key in CONFIG_KEYS.items():
        value = getattr(cfg, name)
        if not _irrelevant(cfg, name) and (name == "ratio" or value != getattr(_DEFAULTS, name)):
            out[key] = value
    if second is not None:
        if settings.hires_only:
            out[HIRES_ONLY] = True
        if settings.hr_ratio and settings.hr_ratio != cfg.ratio and cfg.method == "merge":
            out[HR_RATIO] = settings.hr_ratio
    return out


def _irrelevant(cfg: ToMeConfig, name: str) -> bool:
    """Fields that cannot change the image under the chosen method."""
    if cfg.method == "downsample":
        return name in ("ratio", "sx", "sy", "use_rand", "merge_attn", "merge_crossattn",
                        "merge_mlp", "matching")
    return name == "downsample_factor"


def has_tome(params: Mapping[str, Any]) -> bool:
    return any(k in params for k in KEYS.values())


def reader(name: str, default: Any) -> Callable[[Mapping[str, Any]], Any]:
    """A paste-field function for the control of ``name`` (an entry of ``settings.ARGS``).

    Returns a value of the component's own type (the API applies ``type(component.value)(v)``,
    which would make the string "False" true), or None to leave the control alone.
    """
    if name == "enabled":
        return has_tome
    key = KEYS[name]

    def read(params: Mapping[str, Any]) -> Any:
        if not has_tome(params):
            return None
        raw = params.get(key)
        if raw is None:
            return _plain_default(name, default)
        try:
            if name == "hires_only":
                return S.to_bool(name, raw)
            if name == "hr_ratio":
                return S.to_ratio(name, raw)
            value = coerce(_FIELDS[name], raw)  # types only: the generation validates
        except ValueError:
            return None
        if name == "max_downsample":
            return "auto" if value is None else str(value)
        return value
    return read


def _plain_default(name: str, default: Any) -> Any:
    """The value a missing key stands for: the library default (what the writer omitted)."""
    if name in CONFIG_KEYS:
        value = getattr(_DEFAULTS, name)
        return "auto" if value is None and name == "max_downsample" else value
    return type(default)()  # hires_only False, hr_ratio 0.0
