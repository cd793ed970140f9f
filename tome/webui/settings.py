"""The script-level settings of one generation: a ``ToMeConfig`` plus the WebUI's own switches.

The WebUI hands a script its arguments either positionally (the values of the components that
``ui()`` returned, in ``ARGS`` order) or, through the API, as one dict of named settings in
``args[0]``. Both forms end up here, are coerced from loose types (gradio numbers, JSON, strings)
and validated with errors that name the setting and its allowed range.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from ..config import ToMeConfig, coerce

# The positional order of the script's arguments: the API contract. Append only, never reorder.
ARGS = ("enabled", "ratio", "sx", "sy", "max_downsample", "hires_only", "hr_ratio",
        "method", "downsample_factor", "start", "end",
        "use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "matching")

_CONFIG_FIELDS = {f.name: f for f in dataclasses.fields(ToMeConfig)}
# The seed comes from the image seed; every other config field is a script setting.
CONFIG_KEYS = tuple(name for name in _CONFIG_FIELDS if name != "seed")
# Settings that exist only in the WebUI layer.
SCRIPT_KEYS = ("enabled", "hires_only", "hr_ratio", "img2img_ratio")
KEYS = SCRIPT_KEYS + CONFIG_KEYS


@dataclass(frozen=True)
class ScriptSettings:
    """What the user asked for; ``plan`` turns it into one config per sampling pass."""

    enabled: bool = False
    config: ToMeConfig = field(default_factory=ToMeConfig)
    hires_only: bool = False    # txt2img: merge only in the hires-fix pass
    hr_ratio: float = 0.0       # ratio of the hires-fix pass; 0 = same as ``config.ratio``
    img2img_ratio: float = 0.0  # ratio for img2img requests; 0 = same as ``config.ratio``

    def __post_init__(self) -> None:
        for name in ("hr_ratio", "img2img_ratio"):
            check_ratio(name, getattr(self, name), self.config)

    def pass_config(self, *, hires: bool, img2img: bool = False) -> ToMeConfig | None:
        """The config of one sampling pass, or None when nothing is merged in that pass."""
        if not self.enabled:
            return None
        if img2img:  # img2img has no hires pass; its own ratio replaces the main one
            cfg = self.config.replace(ratio=self.img2img_ratio or self.config.ratio)
        elif hires:
            cfg = self.config.replace(ratio=self.hr_ratio or self.config.ratio)
        elif self.hires_only:
            return None
        else:
            cfg = self.config
        return cfg if cfg.active else None


def check_ratio(name: str, value: float, config: ToMeConfig) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.0 <= value <= config.max_ratio + 1e-9:
        raise ValueError(f"ToMe: invalid {name}={value!r}: must be in [0, {config.max_ratio:g}] "
                         f"for a {config.sx}x{config.sy} stride (0 = same as ratio)")


def to_bool(name: str, value: Any) -> bool:
    """Booleans from JSON, gradio or infotext strings ("True"/"False")."""
    value = coerce(SimpleNamespace(name=name, default=False, metadata={}), value)
    if not isinstance(value, bool):
        raise ValueError(f"ToMe: invalid {name}={value!r}: expected true or false")  # noqa: TRY004
    return value


def to_ratio(name: str, value: Any) -> float:
    meta = {"minimum": 0.0, "maximum": "1 - 1/(sx*sy)"}
    return coerce(SimpleNamespace(name=name, default=0.0, metadata=meta), value)


def from_dict(data: Mapping[str, Any], base: ScriptSettings | None = None) -> ScriptSettings:
    """Settings from named values; missing keys keep ``base`` (the defaults when None)."""
    base = base or ScriptSettings()
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        hint = " (the seed is the image seed)" if "seed" in unknown else ""
        raise ValueError(f"ToMe: unknown setting(s) {unknown}{hint}; known: {list(KEYS)}")
    enabled = to_bool("enabled", data.get("enabled", base.enabled))
    if not enabled:
        # A disabled extension must never fail a generation, whatever else was sent.
        return ScriptSettings()
    config = ToMeConfig.from_dict({k: v for k, v in data.items() if k in _CONFIG_FIELDS},
                                  base=base.config)
    return ScriptSettings(
        enabled=True, config=config,
        hires_only=to_bool("hires_only", data.get("hires_only", base.hires_only)),
        hr_ratio=to_ratio("hr_ratio", data.get("hr_ratio", base.hr_ratio)),
        img2img_ratio=to_ratio("img2img_ratio", data.get("img2img_ratio", base.img2img_ratio)))


def parse_args(args: Sequence[Any], overrides: Mapping[str, Any] | None = None) -> ScriptSettings:
    """Settings from the script's arguments: one dict in ``args[0]`` or values in ``ARGS`` order.

    With a dict the remaining positions (which the API fills with the UI's defaults) are
    ignored; with values, missing trailing ones keep their defaults and extra ones are ignored
    (a newer client talking to an older extension). ``overrides`` (an XYZ plot cell's values)
    replace named settings and turn ToMe on unless they say otherwise.
    """
    named = dict(args[0]) if args and isinstance(args[0], Mapping) else dict(zip(ARGS, args))
    if overrides:
        named = {**named, "enabled": True, **overrides}
    return from_dict(named)


def to_dict(settings: ScriptSettings) -> dict[str, Any]:
    """Named settings, the form ``from_dict`` reads (used by the API docs and the tests)."""
    d = {k: v for k, v in settings.config.to_dict().items() if k in CONFIG_KEYS}
    return {"enabled": settings.enabled, "hires_only": settings.hires_only,
            "hr_ratio": settings.hr_ratio, "img2img_ratio": settings.img2img_ratio, **d}
