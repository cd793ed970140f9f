"""One way of running a UNet, for the benchmark and the quality figures alike.

A ``Setting`` is a method plus a ``ToMeConfig``; it is parsed from a spec string
``method[:value][:key=val,key=val]`` whose options are ``ToMeConfig`` fields (any field,
present or future, by name):

    baseline (or unmerged)        the unpatched model
    merge:0.5                     ours, ratio 0.5          merge:0.5:matching=local,share=block
    downsample:2                  ours, ToDo x2 (keys/values pooled; no unmerge)
    tomesd:0.5                    tomesd 0.1.3 (fields it knows: ratio, max_downsample, sx, sy,
                                  use_rand, merge_attn, merge_crossattn, merge_mlp)
    match-only  /  match-only:tomesd
                                  merging at ratio 0.01: what matching alone costs
    ceiling                       self-attention (attn1) removed at the levels ToMe would merge:
                                  the most any token reduction there could gain

``max_downsample`` left at auto picks the same levels for every method (1 on SD1/SD2, 2 on
SDXL, which has no attention at full resolution), tomesd included: its own default, 1, merges
nothing on SDXL. ``apply(model)`` / ``remove(model)`` patch and restore; every method restores
the model exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tome
from tome import layout as _layout
from tome import methods as _methods
from tome.config import ToMeConfig

#: The lab's own methods; the library's (``tome.methods``) come between them: ``methods()``.
LAB_METHODS = ("tomesd", "ceiling", "match-only")


def methods() -> tuple[str, ...]:
    """Every first word a spec may have: baseline, the library's methods, the lab's."""
    return ("baseline", *_methods.names(), *LAB_METHODS)


def _library(method: str) -> _methods.Method | None:
    return _methods.REGISTRY.get(method)


#: The auto policy's measurements, shared by every application of a setting in this process
#: (the benchmark re-applies each setting every round).
_MEASURER: list[Any] = []


def _measurer() -> Any:
    if not _MEASURER:
        from tome.measurements import Measurer
        _MEASURER.append(Measurer())
    return _MEASURER[0]


#: Method names of ``default_settings`` (``--methods``): each expands to settings.
METHOD_GROUPS = ("baseline", "ceiling", "tomesd", "merge", "merge-local", "downsample",
                 "auto", "match-only")
#: ``ToMeConfig`` fields tomesd 0.1.3's ``apply_patch`` takes.
TOMESD_FIELDS = ("ratio", "max_downsample", "sx", "sy", "use_rand", "merge_attn",
                 "merge_crossattn", "merge_mlp")
MATCH_ONLY_RATIO = 0.01
_CEILING_ATTR = "_tome_lab_ceiling"


@dataclass(frozen=True)
class Setting:
    """A method (see ``methods()``), its ``ToMeConfig`` and who runs it (``impl``: "tome" for
    this library, "tomesd" for tomesd 0.1.3). ``options`` are the fields the spec set
    explicitly, for labels; the config holds the full, validated settings."""

    method: str = "baseline"
    config: ToMeConfig | None = None
    impl: str = "tome"
    options: tuple[tuple[str, Any], ...] = ()

    # ------------------------------------------------------------------------- parsing

    @classmethod
    def parse(cls, spec: str) -> Setting:
        """``merge:0.5``, ``merge:0.5:matching=local``, ``downsample:4``, ``tomesd:0.5``,
        ``ceiling``, ``match-only``, ``match-only:tomesd``, ``baseline`` / ``unmerged``."""
        parts = [p.strip() for p in spec.strip().split(":")]
        method = parts[0].lower()
        if method == "unmerged":
            method = "baseline"
        if method not in methods():
            raise ValueError(f"unknown method in setting {spec!r}; choose from "
                             f"{', '.join(methods())}")
        value: str | None = None
        raw: dict[str, str] = {}
        for part in parts[1:]:
            if "=" in part:
                for kv in part.split(","):
                    if kv.strip():
                        k, _, v = kv.partition("=")
                        raw[k.strip()] = v.strip()
            elif part:
                if value is not None:
                    raise ValueError(f"setting {spec!r}: more than one value")
                value = part
        return cls.make(method, value, raw, spec)

    @classmethod
    def make(cls, method: str, value: Any = None, options: dict[str, Any] | None = None,
             spec: str | None = None) -> Setting:
        """Build from parts: ``make("merge", 0.5, {"matching": "local"})``."""
        options = dict(options or {})
        where = f"setting {spec!r}" if spec else f"{method} setting"
        if method == "baseline":
            if value is not None or options:
                raise ValueError(f"{where}: the baseline takes no value or options")
            return cls()
        if "method" in options:
            raise ValueError(f"{where}: the method is the spec's first word "
                             "(merge:RATIO or downsample:FACTOR), not an option")
        impl = "tome"
        base: dict[str, Any] = {}
        lib = _library(method)
        if lib is not None:
            base["method"] = method
            if value is not None:
                base[lib.value_field] = value
        elif method == "tomesd":
            if value is not None:
                base["ratio"] = value
            impl = "tomesd"
        elif method == "match-only":
            if value is not None and str(value).lower() not in ("tome", "ours", "tomesd"):
                raise ValueError(f"{where}: the value says whose matching: 'tomesd' or 'ours'")
            impl = "tomesd" if str(value).lower() == "tomesd" else "tome"
            base["ratio"] = MATCH_ONLY_RATIO
        elif method == "ceiling" and value is not None:
            raise ValueError(f"{where}: the ceiling takes no value (levels: max_downsample=N)")
        try:
            config = ToMeConfig.from_dict({**base, **options})
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if impl == "tomesd":
            unknown = sorted(set(options) - set(TOMESD_FIELDS))
            if unknown:
                raise ValueError(f"{where}: tomesd has no setting {unknown}; it takes "
                                 f"{', '.join(TOMESD_FIELDS)}")
        given = tuple((k, getattr(config, k)) for k in options)
        return cls(method, config, impl, given)

    @property
    def spec(self) -> str:
        """The spec string that parses back to this setting."""
        if self.method == "baseline":
            return "baseline"
        c, lib = self.config, _library(self.method)
        if lib is not None:
            value = _text(getattr(c, lib.value_field))
        else:
            value = {"tomesd": f"{c.ratio:g}", "ceiling": "",
                     "match-only": "tomesd" if self.impl == "tomesd" else ""}[self.method]
        opts = ",".join(f"{k}={_text(v)}" for k, v in self.options)
        return ":".join(p for p in (self.method, value, opts) if p)

    # ------------------------------------------------------------------------- labels

    @property
    def unmerged(self) -> bool:
        return self.method == "baseline"

    @property
    def value(self) -> float:
        """The method's number: ratio, downsample factor (0 for baseline and ceiling)."""
        if self.method in ("baseline", "ceiling"):
            return 0.0
        lib = _library(self.method)
        return float(getattr(self.config, lib.value_field if lib else "ratio"))

    @property
    def value_text(self) -> str:
        """The point's tag in plots: ``0.5``, ``x2``, ``tomesd`` (match-only), ''."""
        if self.method in ("baseline", "ceiling"):
            return ""
        if self.method == "match-only":
            return "tomesd" if self.impl == "tomesd" else "ours"
        lib = _library(self.method)
        return lib.value_text(self.config) if lib else f"{self.config.ratio:g}"

    def _extras(self) -> list[str]:
        """``key=value`` of the options that are neither the value nor the matching."""
        lib = _library(self.method)
        skip = {"matching", lib.value_field if lib else "ratio"}
        return [f"{k}={_text(v)}" for k, v in self.options if k not in skip]

    def _name(self) -> str:
        if self.method == "baseline":
            return "unmerged"
        name = self.method
        if self.method == "match-only" and self.impl == "tomesd":
            name += " tomesd"
        if self.config.matching != "global" and any(k == "matching" for k, _ in self.options):
            name += f" {self.config.matching}"
        return name

    @property
    def group(self) -> str:
        """One line per group in plots: the method, its matching, and the other options."""
        return " ".join([self._name()] + self._extras())

    @property
    def label(self) -> str:
        """``merge 0.5``, ``merge local 0.5``, ``downsample x2``, ``merge 0.75 end=0.5``,
        ``tomesd 0.5``, ``match-only``, ``match-only tomesd``, ``ceiling``, ``unmerged``."""
        value = "" if self.method == "match-only" else self.value_text
        return " ".join(w for w in [self._name(), value, *self._extras()] if w)

    @property
    def reduction(self) -> float:
        """Fraction of self-attention tokens (keys/values for downsample) removed: plot x."""
        if self.method == "baseline":
            return 0.0
        if self.method == "ceiling":
            return 1.0
        lib = _library(self.method)
        return lib.reduction(self.config) if lib else float(self.config.ratio)

    # ------------------------------------------------------------------------- running

    def apply(self, model: Any, seed: int | None = None) -> None:
        """Patch ``model`` (a UNet, an ldm/sgm model or a diffusers pipeline). ``seed``: ToMe's
        random cells (the WebUI seeds them with the image seed); tomesd draws its own from
        torch's global RNG."""
        if self.method == "baseline":
            return
        if self.impl == "tomesd":
            import tomesd
            kw = {k: getattr(self.config, k) for k in TOMESD_FIELDS}
            if kw["max_downsample"] is None:
                kw["max_downsample"] = auto_level(model)
            tomesd.apply_patch(tomesd_target(model), **kw)
        elif self.method == "ceiling":
            remove_attention(model, self.config)
        else:
            config = self.config if seed is None else self.config.replace(seed=seed)
            tome.apply_patch(model, config=config, measure=_measurer())

    def remove(self, model: Any) -> None:
        """Undo ``apply``: the model computes exactly what it did before."""
        if self.method == "baseline":
            return
        if self.impl == "tomesd":
            import tomesd
            tomesd.remove_patch(tomesd_target(model))
        elif self.method == "ceiling":
            restore_attention(model)
        else:
            tome.remove_patch(model)

    def patched_blocks(self, model: Any) -> str:
        """``changed/total`` transformer blocks while applied ('' for the baseline)."""
        if self.method == "baseline":
            return ""
        unet = unet_of(model)
        levels = {b.module: b.level for b in _layout.read(unet).blocks}
        if self.method == "ceiling":
            return f"{len(getattr(unet, _CEILING_ATTR, []))}/{len(levels)}"
        if self.impl == "tomesd":
            info = getattr(unet, "_tome_info", {}).get("args", {})
            top = info.get("max_downsample", 1)
            n = sum(1 for b, ds in levels.items()
                    if type(b).__name__ == "ToMeBlock" and 0 < ds <= top)
            return f"{n}/{len(levels)}"
        rep = tome.patch_report(model)
        return "" if rep is None else f"{rep.patched_blocks}/{rep.total_blocks}"


def _text(v: Any) -> str:
    return "auto" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def parse_settings(specs: Sequence[str]) -> list[Setting]:
    """Parse specs; the unmerged reference is always first (and only once)."""
    out = [Setting.parse(s) for s in specs]
    return [Setting()] + [s for s in out if not s.unmerged]


def default_settings(methods: Sequence[str], ratios: Sequence[float] = (0.5,),
                     factors: Sequence[int] = (2,)) -> list[Setting]:
    """The benchmark's settings for ``--methods`` names (``METHOD_GROUPS``); baseline first."""
    out = [Setting()]
    for m in methods:
        m = m.strip()
        if m == "tomesd":
            out += [Setting.make("tomesd", r) for r in ratios]
        elif m == "merge":
            out += [Setting.make("merge", r) for r in ratios]
        elif m == "merge-local":
            out += [Setting.make("merge", r, {"matching": "local"}) for r in ratios]
        elif m == "downsample":
            out += [Setting.make("downsample", f) for f in factors]
        elif m == "auto":  # the auto policy, measuring on this device at the first call
            out += [Setting.make("merge", r, {"policy": "auto"}) for r in ratios]
        elif m == "ceiling":
            out.append(Setting.make("ceiling"))
        elif m == "match-only":
            out += [Setting.make("match-only"), Setting.make("match-only", "tomesd")]
        elif m not in ("baseline", ""):
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHOD_GROUPS)}")
    return out


def unet_of(model: Any) -> nn.Module:
    """The UNet inside ``model`` (the library's reader), a ``TypeError`` if there is none."""
    return _layout.find_unet(model)


# ----------------------------------------------------------------------------- tomesd


class _LdmWrapper(nn.Module):
    """tomesd wants an object with ``.model.diffusion_model`` for ldm UNets."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = unet


def tomesd_target(model: Any) -> Any:
    """What ``tomesd.apply_patch`` accepts for ``model``: diffusers UNets and pipelines and
    ldm models as they are, a bare ldm UNet wrapped (the wrapper holds no state)."""
    if hasattr(model, "down_blocks") or hasattr(model, "unet"):
        return model
    if hasattr(model, "model") and hasattr(model.model, "diffusion_model"):
        return model
    return _LdmWrapper(unet_of(model))


def auto_level(model: Any) -> int:
    """The level ``max_downsample=None`` picks (the library's rule: 1 on SD1/SD2, 2 on
    SDXL)."""
    return _layout.read(model).auto_level(None)


# ----------------------------------------------------------------------------- ceiling


def _zero_forward(attn: nn.Module):
    out_features = attn.to_out[0].out_features

    def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states.new_zeros(*hidden_states.shape[:-1], out_features)

    return forward


def remove_attention(model: Any, config: ToMeConfig | None = None) -> list[str]:
    """Make every self-attention (``attn1``) at the levels ToMe would merge with ``config``
    return zeros (the block keeps its residual path): the speed of a UNet whose attention there
    costs nothing. Only an instance attribute ``forward`` is added; ``restore_attention`` deletes
    it, so weights and code are never touched. Returns the blocks' names."""
    unet = unet_of(model)
    restore_attention(unet)
    tome.apply_patch(unet, config=config or ToMeConfig())  # which levels ToMe would merge
    try:
        report = tome.patch_report(unet)
        top = report.max_downsample
    finally:
        tome.remove_patch(unet)
    names = {m: n for n, m in unet.named_modules()}
    saved, done = [], []
    for block, ds in ((b.module, b.level) for b in _layout.read(unet).blocks):
        attn = getattr(block, "attn1", None)
        if attn is None or not 0 < ds <= top:
            continue
        saved.append((attn, vars(attn).get("forward")))
        attn.forward = _zero_forward(attn)
        done.append(names.get(block, "?"))
    setattr(unet, _CEILING_ATTR, saved)
    return done


def restore_attention(model: Any) -> None:
    """Undo ``remove_attention`` (no-op when nothing was removed)."""
    unet = unet_of(model)
    for attn, old in reversed(vars(unet).pop(_CEILING_ATTR, [])):
        if old is None:
            del attn.forward
        else:
            attn.forward = old

