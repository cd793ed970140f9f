"""The script's arguments: one generation's settings, a ``ToMeConfig`` plus the WebUI's own
switches (the Settings-tab entries are in ``settings_tab.py``).

The WebUI hands a script its arguments either positionally (the values of the components that
``ui()`` returned, in ``ARGS`` order) or, through the API, as one dict of named settings in
``args[0]``. Both forms end up here, are coerced from loose types (gradio numbers, JSON, strings)
and validated with errors that name the setting and its allowed range.

A named preset (``tome.config.PRESETS``) stands for a whole ``ToMeConfig``. In the positional
form it wins over the individual controls (they only show its values); in the dict form and on
an XYZ axis, keys given next to it override its values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ..config import (
    FIELDS,
    PRESETS,
    ToMeConfig,
    check_ratio,
    coerce,
    from_preset,
    unknown_names,
)

# Set by the X/Y/Z plot's ToMe axes on a cell's copy of ``p``: {setting: value}.
XYZ_ATTR = "_tome_xyz"
# The positional order of the script's arguments: the API contract. Append only, never reorder.
# Config fields added later are appended in their declaration order (``LATER``).
_FIRST = ("enabled", "ratio", "sx", "sy", "max_downsample", "hires_only", "hr_ratio",
          "method", "downsample_factor", "start", "end",
          "use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "matching",
          "share", "policy", "preset", "rope", "blocks")
LATER = tuple(name for name in FIELDS if name not in _FIRST and name != "seed")
ARGS = _FIRST + LATER

# The seed comes from the image seed; every other config field is a script setting.
CONFIG_KEYS = tuple(name for name in FIELDS if name != "seed")
# Settings that exist only in the WebUI layer.
SCRIPT_KEYS = ("enabled", "preset", "hires_only", "hr_ratio", "img2img_ratio")
KEYS = SCRIPT_KEYS + CONFIG_KEYS

# What the WebUI uses where a request or a control says nothing: the library's defaults, except
# that the policy is ``auto`` (never slower than without ToMe). The infotext is written against
# the library's defaults instead, so an image made before the policy existed reads back "fixed".
DEFAULT = ToMeConfig(policy="auto")
CUSTOM = "Custom"
# The preset control's choices: "Custom" (the individual controls) and one per named preset.
PRESET_CHOICES = (CUSTOM, *(name.title() for name in PRESETS))


@dataclass(frozen=True)
class ScriptSettings:
    """What the user asked for; ``passes`` turns it into one config per sampling pass."""

    enabled: bool = False
    config: ToMeConfig = DEFAULT
    preset: str | None = None   # the named preset the config came from (a ``PRESETS`` key)
    hires_only: bool = False    # txt2img: merge only in the hires-fix pass
    hr_ratio: float = 0.0       # ratio of the hires-fix pass; 0 = same as ``config.ratio``
    img2img_ratio: float = 0.0  # ratio for img2img requests; 0 = same as ``config.ratio``

    def __post_init__(self) -> None:
        for name in ("hr_ratio", "img2img_ratio"):
            check_extra_ratio(name, getattr(self, name), self.config)

    def replace(self, **changes: Any) -> ScriptSettings:
        return dataclasses.replace(self, **changes)

    def passes(self, *, img2img: bool, hires: bool) -> dict[str, ToMeConfig | None]:
        """The config of every sampling pass the generation will run, None where nothing is
        merged: ``{"img2img": ...}`` or ``{"first": ..., "hires": ...}`` (hires only when a
        hires-fix pass follows)."""
        if not self.enabled:
            return {}

        def active(cfg: ToMeConfig) -> ToMeConfig | None:
            return cfg if cfg.active else None
        if img2img:  # img2img has no hires pass; its own ratio replaces the main one
            return {"img2img": active(self.config.replace(
                ratio=self.img2img_ratio or self.config.ratio))}
        out = {"first": None if self.hires_only else active(self.config)}
        if hires:
            out["hires"] = active(self.config.replace(ratio=self.hr_ratio or self.config.ratio))
        return out


class SettingsError(ValueError):
    """An invalid setting: a ``ValueError`` whose message names the setting and its range."""


def invalid(error: ValueError) -> ValueError:
    """``error`` as an error the WebUI's API answers with HTTP 422 and no traceback.

    Both hosts' API exception handlers answer an exception with its instance attribute
    ``status_code`` and print no traceback for fastapi's ``HTTPException`` (A1111), or leave it
    to fastapi's own handler (Forge). So where fastapi is importable (always inside the WebUI)
    the error is also an ``HTTPException`` with status 422; ``str()`` stays the plain message,
    which is what the UI shows. fastapi is imported here, lazily, so the package needs it only
    inside the WebUI.
    """
    if isinstance(error, SettingsError):
        return error
    message = str(error)
    e = _error_class()(message)
    e.status_code, e.detail, e.headers = 422, message, None
    return e


_error_classes: list[type] = []


def _error_class() -> type:
    if not _error_classes:
        try:
            from fastapi.exceptions import HTTPException
        except ImportError:
            _error_classes.append(SettingsError)
        else:
            _error_classes.append(type("ToMeSettingsError", (SettingsError, HTTPException), {
                "__init__": ValueError.__init__, "__str__": ValueError.__str__,
                "__repr__": ValueError.__repr__, "__module__": __name__,
                "__doc__": SettingsError.__doc__}))
    return _error_classes[0]


def check_extra_ratio(name: str, value: float, config: ToMeConfig) -> None:
    """A pass's own ratio (``hr_ratio``, ``img2img_ratio``): the config's stride rule; 0 means
    "same as ratio"."""
    check_ratio(name, value, config.sx, config.sy, "; 0 = same as ratio")


def to_bool(name: str, value: Any) -> bool:
    """Booleans from JSON, gradio or infotext strings ("True"/"False")."""
    value = coerce(SimpleNamespace(name=name, default=False, metadata={}), value)
    if not isinstance(value, bool):
        raise ValueError(f"ToMe: invalid {name}={value!r}: expected true or false")  # noqa: TRY004
    return value


def to_ratio(name: str, value: Any) -> float:
    """A number; checked against the stride with the rest (``check_extra_ratio``)."""
    return coerce(SimpleNamespace(name=name, default=0.0, metadata={}), value)


def preset_key(value: Any) -> str | None:
    """The ``PRESETS`` key a control or request value names; None for Custom (or nothing)."""
    if value is None:
        return None
    key = str(value).strip().lower()
    if key in ("", CUSTOM.lower()):
        return None
    if key not in PRESETS:
        raise ValueError(f"ToMe: invalid preset={value!r}: expected one of "
                         f"{', '.join(PRESET_CHOICES)}")
    return key


def preset_label(key: str | None) -> str:
    return CUSTOM if key is None else key.title()


def from_dict(data: Mapping[str, Any]) -> ScriptSettings:
    """Settings from named values; missing keys take the preset's values, else ``DEFAULT``'s."""
    problem = unknown_names(data, KEYS)
    if problem:
        hint = "; the seed is the image seed" if "seed" in data else ""
        raise ValueError(problem + hint)
    if not to_bool("enabled", data.get("enabled", False)):
        # A disabled extension must never fail a generation, whatever else was sent.
        return ScriptSettings()
    key = preset_key(data.get("preset"))
    fields = {k: v for k, v in data.items() if k in FIELDS}
    config = ToMeConfig.from_dict(fields, base=DEFAULT) if key is None \
        else from_preset(key, fields)  # a DiT preset's schedule takes blocks and the factor
    return ScriptSettings(
        enabled=True, config=config, preset=key,
        hires_only=to_bool("hires_only", data.get("hires_only", False)),
        hr_ratio=to_ratio("hr_ratio", data.get("hr_ratio", 0.0)),
        img2img_ratio=to_ratio("img2img_ratio", data.get("img2img_ratio", 0.0)))


def parse_args(args: Sequence[Any], overrides: Mapping[str, Any] | None = None) -> ScriptSettings:
    """Settings from the script's arguments: one dict in ``args[0]`` or values in ``ARGS`` order.

    With a dict the remaining positions (which the API fills with the UI's defaults) are
    ignored; with values, missing trailing ones keep their defaults and extra ones are ignored
    (a newer client talking to an older extension), and a named preset replaces the values of
    the individual config controls. ``overrides`` (an XYZ plot cell's values) replace named
    settings, a preset's values included, and turn ToMe on unless they say otherwise.
    """
    overrides = dict(overrides or {})
    if args and isinstance(args[0], Mapping):
        named = dict(args[0])
    else:
        named = dict(zip(ARGS, args))
        chosen = overrides.get("preset", named.get("preset"))
        if chosen is not None and str(chosen).strip().lower() not in ("", CUSTOM.lower()):
            named = {k: v for k, v in named.items() if k not in CONFIG_KEYS}
    if overrides:
        named = {**named, "enabled": True, **overrides}
    return from_dict(named)


def control_values(config: ToMeConfig) -> dict[str, Any]:
    """The config as the individual controls hold it (max downsample: "auto", "1", ...)."""
    values = {name: getattr(config, name) for name in CONFIG_KEYS}
    values["max_downsample"] = "auto" if config.max_downsample is None \
        else str(config.max_downsample)
    return values
