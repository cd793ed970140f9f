"""One configuration object for every host: library, WebUI controls, API, infotext and XYZ.

Each field carries its own metadata (label, infotext key, range, help text), so the UI,
the API parser and the infotext writer are all generated from this one place and cannot
drift apart.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import dit, methods
from .ratio import MAX_STRIDE, RATIO_RULE, check_ratio, ratio_limit  # noqa: F401 (the hosts')
from .values import (  # noqa: F401 (the names hosts import from here)
    AUTO,
    coerce,
    describe,
    in_range,
    range_text,
    shown,
)

MATCHINGS = ("global", "local")
SHARES = ("level", "block")
POLICIES = ("fixed", "auto")
MAX_DOWNSAMPLES = (1, 2, 4, 8)


def _meta(label: str, infotext: str, help: str, **kw: Any) -> dict[str, Any]:
    return {"label": label, "infotext": infotext, "help": help, **kw}


@dataclass(frozen=True)
class ToMeConfig:
    """Validated settings of one patch. Invalid values raise ``ValueError`` at construction."""

    ratio: float = field(default=0.5, metadata=_meta(
        "Ratio", "ToMe ratio",
        "Fraction of tokens merged in each patched block. Higher is faster and changes the image "
        f"more; the maximum is {RATIO_RULE}.", minimum=0.0, step=0.01))
    max_downsample: int | None = field(default=None, metadata=_meta(
        "Max downsample", "ToMe max downsample",
        "Deepest UNet level merged (1 = full resolution only, 2, 4, 8). Auto picks the "
        "highest-resolution level that has transformer blocks: 1 on SD1/SD2, 2 on SDXL.",
        choices=(AUTO, "1", "2", "4", "8")))
    sx: int = field(default=2, metadata=_meta(
        "Stride x", "ToMe stride x",
        "Width of the cell that keeps one destination token. Larger allows more merging but "
        "coarser.", minimum=1, maximum=MAX_STRIDE, step=1))
    sy: int = field(default=2, metadata=_meta(
        "Stride y", "ToMe stride y",
        "Height of the cell that keeps one destination token.", minimum=1, maximum=MAX_STRIDE,
        step=1))
    use_rand: bool = field(default=True, metadata=_meta(
        "Random destinations", "ToMe random",
        "Pick the destination in each cell at random (seeded) instead of top-left. Random "
        "avoids grid artifacts at high ratios."))
    merge_attn: bool = field(default=True, metadata=_meta(
        "Merge self-attention", "ToMe merge attn",
        "Merge before self-attention: almost all of the speed-up."))
    merge_crossattn: bool = field(default=False, metadata=_meta(
        "Merge cross-attention", "ToMe merge crossattn",
        "Also merge before cross-attention: little speed-up, some quality loss."))
    merge_mlp: bool = field(default=False, metadata=_meta(
        "Merge MLP", "ToMe merge mlp",
        "Also merge before the feed-forward layer: little speed-up, large quality loss."))
    method: str = field(default="merge", metadata=_meta(
        "Method", "ToMe method",
        "merge: ToMe (merge similar tokens, unmerge after). downsample: ToDo (queries keep every "
        "token, keys and values are pooled by the downsample factor; no unmerge). On DiTs "
        "only downsample applies: the image tokens' keys and values are pooled.",
        choices=methods.REGISTRY.keys()))  # a live view: registered methods join it
    downsample_factor: int = field(default=2, metadata=_meta(
        "Downsample factor", "ToMe downsample factor",
        "Pooling factor per side for the downsample method (2 = 4x fewer keys/values).",
        minimum=1, maximum=dit.MAX_FACTOR, step=1))
    rope: str = field(default="pooled", metadata=_meta(
        "DiT RoPE", "ToMe rope",
        "DiTs with rotary positions (Flux, Qwen-Image, Wan, HunyuanVideo; SD3 has none): "
        "pooled: keys and positions are pooled, each pooled key gets its cell's mean position; "
        "before: keys are rotated by their own positions, then pooled.", choices=dit.ROPES))
    blocks: str = field(default="all", metadata=_meta(
        "DiT blocks", "ToMe blocks",
        "DiTs: which blocks pool image keys/values: all, double (double-stream/joint blocks "
        "only) or a range of block indices such as 0-18 (double-stream blocks count first). "
        "A schedule names its blocks itself (then leave this at all)."))
    matching: str = field(default="global", metadata=_meta(
        "Matching", "ToMe matching",
        "global: every source may merge into any destination (as tomesd). local: only into "
        "nearby destinations; much faster and leaner on large images.", choices=MATCHINGS))
    share: str = field(default="level", metadata=_meta(
        "Plan sharing", "ToMe share",
        "level: the first block of a UNet level matches its tokens and every other block at "
        "that level reuses the plan in the same step (fast on GPUs). block: every block matches "
        "its own input, as tomesd does.", choices=SHARES))
    policy: str = field(default="fixed", metadata=_meta(
        "Policy", "ToMe policy",
        "fixed: merge exactly the levels the settings name. auto: merge a level only where it "
        "pays on this device: at the first image of each size, each level is timed merged and "
        "unmerged on your own model (a few seconds, remembered in a cache file) and merged from "
        "1.05x faster; where it cannot be timed, the device kind's token thresholds decide.",
        choices=POLICIES))
    start: float = field(default=0.0, metadata=_meta(
        "Start", "ToMe start",
        "Merge from this point of the denoising process (0 = first, noisiest step).",
        minimum=0.0, maximum=1.0, step=0.01))
    end: float = field(default=1.0, metadata=_meta(
        "End", "ToMe end",
        "Merge until this point of the denoising process (1 = last step).",
        minimum=0.0, maximum=1.0, step=0.01))
    seed: int = field(default=0, metadata=_meta(
        "Seed", "ToMe seed",
        "Seed of the random destination choice. The WebUI uses the image seed."))
    # DiT-only settings (after the older fields: hosts list settings in this order).
    proportional: bool = field(default=True, metadata=_meta(
        "DiT proportional attention", "ToMe proportional",
        "DiTs: each pooled image key counts for the tokens of its cell (log of the cell size "
        "added to its logit), so pooled images keep their share of attention against the "
        "unpooled text keys. Much closer images (docs/quality.md#dit); off: plain pooling."))
    schedule: str = field(default="", metadata=_meta(
        "DiT schedule", "ToMe schedule",
        "DiTs: which blocks pool by which factor at which steps, e.g. 'inner:2@0.3-1' or "
        "'all:2@0.3-1,inner:4@0.6-1' (blocks: all, double, single, first, last, inner or "
        "a-b; a later item wins where it applies). Empty: the downsample factor in the DiT "
        "blocks over start-end. The presets set it; UNets ignore it."))
    reuse: int = field(default=0, metadata=_meta(
        "DiT residual reuse", "ToMe reuse",
        "DiTs: every N steps each pooled block also runs its attention unpooled and keeps the "
        "difference, added to the pooled output on the steps between (extrapolated from the "
        "last two). It keeps the difference and its slope per pooled block and per call of a "
        "step (cond and uncond apart) until the generation ends; what it will keep is checked "
        "against free memory first, and where that is short it keeps less or turns off and "
        "says so. 0: off.", minimum=0, maximum=20, step=1))
    paced: bool = field(default=False, metadata=_meta(
        "DiT reuse paced to steps", "ToMe paced",
        "DiTs with residual reuse: 'reuse' is the period at 20 steps, scaled with the square "
        "root of the step count (N=5: every 2 steps at 4, 3 at 8, 8 at 50), which kept the "
        "image about as close at 4 to 50 steps on the tiny DiT (docs/quality.md). Where the "
        "host does not tell the step count, or off: every 'reuse' steps."))
    temporal: int = field(default=1, metadata=_meta(
        "DiT frames per cell", "ToMe temporal",
        "Video DiTs (Wan, HunyuanVideo, LTX-Video...): how many consecutive latent frames one "
        "pooled key spans. 1: each frame pooled on its own; 2: pairs of frames too (2x2x2 "
        "cells at factor 2: 8 keys into one). Frames a model keeps whole (an image-to-video's "
        "first frame, LTX-Video's guide frames) stay whole. Images ignore it.",
        minimum=1, maximum=4, step=1))

    def __post_init__(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"ToMe: invalid {name}={shown(getattr(self, name))}: {msg}")

        for f in dataclasses.fields(self):  # types first: the checks below compare values
            v = getattr(self, f.name)
            if isinstance(f.default, str) and not isinstance(v, str):
                fail(f.name, "must be a string")
            if "maximum" in f.metadata and not in_range(f, v):
                fail(f.name, f"must be {range_text(f)}")  # the range UIs and nodes show
        if self.method not in methods.REGISTRY:
            fail("method", f"must be one of {methods.names()}")
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) \
                or not math.isfinite(self.ratio):
            fail("ratio", "must be a number")
        problem = methods.REGISTRY[self.method].problem(self)
        if problem:
            fail(*problem)
        check_ratio("ratio", self.ratio, self.sx, self.sy)
        if self.max_downsample is not None and (isinstance(self.max_downsample, bool) or not
                                                isinstance(self.max_downsample, int) or
                                                self.max_downsample not in MAX_DOWNSAMPLES):
            fail("max_downsample", f"must be one of {MAX_DOWNSAMPLES} or None (auto)")
        if self.rope not in dit.ROPES:
            fail("rope", f"must be one of {dit.ROPES}")
        try:
            dit.parse_blocks(self.blocks)
        except ValueError as e:
            fail("blocks", str(e))
        if self.matching not in MATCHINGS:
            fail("matching", f"must be one of {MATCHINGS}")
        if self.share not in SHARES:
            fail("share", f"must be one of {SHARES}")
        if self.policy not in POLICIES:
            fail("policy", f"must be one of {POLICIES}")
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp", "proportional"):
            if not isinstance(getattr(self, name), bool):
                fail(name, "must be a boolean")
        if self.start > self.end:
            fail("start", f"must not be after end={self.end}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            fail("seed", "must be an integer")
        try:
            dit.Schedule.parse(self.schedule)
        except ValueError as e:
            fail("schedule", str(e))
        if self.schedule.strip() and dit.parse_blocks(self.blocks)[0] != "all":
            try:  # the schedule with these blocks, where its items name all blocks
                hint = repr(dit.Schedule.parse(self.schedule).retarget(self.blocks))
            except ValueError:
                hint = "e.g. 'double:8'"
            fail("blocks", f"schedule={shown(self.schedule)} names the blocks itself, so this "
                 f"would do nothing; write them in the schedule ({hint}) or leave blocks at "
                 "'all'")

    @property
    def max_ratio(self) -> float:
        return ratio_limit(self.sx, self.sy)

    @property
    def active(self) -> bool:
        """False when the settings cannot change the model's output."""
        return self.start < self.end and methods.REGISTRY[self.method].active(self)

    def replace(self, **changes: Any) -> ToMeConfig:
        check_names(changes)
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, base: ToMeConfig | None = None) -> ToMeConfig:
        """Build from loosely typed values (API JSON, infotext strings, gradio numbers).

        Unknown keys raise, so a typo in an API request is reported instead of ignored; missing
        keys keep ``base``'s values (the defaults when ``base`` is None).
        """
        base = base or cls()
        check_names(data)
        values = {k: coerce(FIELDS[k], v) for k, v in data.items()}
        return dataclasses.replace(base, **values)


#: Every setting's field (name -> ``dataclasses.Field``): its metadata drives UI, API, infotext.
FIELDS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(ToMeConfig)}


def unknown_names(names: Any, known: Any = None) -> str | None:
    """The error for the names in ``names`` that are not settings (``known``: FIELDS), each
    with the closest known name where one is close (``ratoi``: ``ratio``); None if all are."""
    known = sorted(FIELDS if known is None else known)
    unknown = sorted((n for n in names if n not in known), key=str)
    if not unknown:
        return None
    close = {n: m[0] for n in unknown if (m := difflib.get_close_matches(str(n), known, 1))}
    if len(unknown) == 1 and close:
        hint = f" (did you mean {close[unknown[0]]!r}?)"
    elif close:
        hint = " (did you mean " + ", ".join(f"{m!r} for {n!r}" for n, m in close.items()) + "?)"
    else:
        hint = ""
    return f"ToMe: unknown setting(s) {unknown}{hint}; known: {known}"


def check_names(names: Any, known: Any = None) -> None:
    """Raise ``unknown_names``' ``ValueError`` (not Python's ``TypeError`` for a keyword):
    a mistyped setting is a bad setting like any other."""
    problem = unknown_names(names, known)
    if problem:
        raise ValueError(problem)


def choices(name: str) -> tuple:
    """The allowed values of a field with choices (for ``method``: every registered one)."""
    return tuple(FIELDS[name].metadata["choices"])



# Named settings for people who do not want to know what a stride is. Each is a partial
# ``ToMeConfig`` applied over the defaults; all use the ``auto`` policy, so a preset never makes
# a pass slower. Chosen from the showcase (docs/quality.md): at equal speed-up ToDo keeps more
# of the image than merging, so the quality end uses it. A preset is one config for every
# model kind: a UNet reads the fields above, a DiT its own (``DIT_PRESETS``: the tiny DiT's
# measured frontier, docs/quality.md#dit), so ``apply_patch(model, config=preset("quality"))``
# does each kind's best at that point.
UNET_PRESETS: dict[str, dict[str, Any]] = {
    "quality": {"method": "downsample", "downsample_factor": 2, "policy": "auto"},
    "balanced": {"method": "merge", "ratio": 0.5, "policy": "auto"},
    "fast": {"method": "downsample", "downsample_factor": 4, "max_downsample": 2,
             "policy": "auto"},
}
# DiT points (docs/quality.md#dit, `python -m tome_lab.dit_frontier`): image keys/values
# pooled x8 in every block with proportional attention, the full attention's residual
# refreshed every 5 (quality) or 10 (fast) steps, keys rotated before they are pooled
# (``rope="before"``: what ComfyUI's path applies anyway, its keys arriving rotated, so a
# preset gives the same image on every path). On the tiny DiT (8 images, 20 steps, one
# thread of a CPU) 31.5 dB and 26.9 dB, where ``rope="pooled"`` gave 30.8 and 26.0 dB at
# about the same speed (within this CPU's noise); x2 throughout gives 22.3 dB, and no step
# window or block choice without reuse came close. Full-size Flux is not measured. The
# period is paced to the step count (``paced``: 5 at 20 steps, 3 at 8, 2 at 4): a fixed 5
# refreshed once in 4 or 8 steps (23.3 and 26.9 dB; paced 31.9 and 34.4 dB).
DIT_PRESETS: dict[str, dict[str, Any]] = {
    "quality": {"schedule": "all:8", "reuse": 5, "paced": True, "rope": "before"},
    "balanced": {},  # merge has no DiT form: a DiT is left as it is
    "fast": {"schedule": "all:8", "reuse": 10, "paced": True, "rope": "before"},
}
PRESETS: dict[str, dict[str, Any]] = {k: {**v, **DIT_PRESETS[k]} for k, v in UNET_PRESETS.items()}
#: The DiT points without residual reuse, for a host path that cannot reuse and for reuse
#: that does not fit in memory: the best schedules measured without it (tiny DiT, rope
#: before: 29.5 dB and 25.7 dB; 1.07x and 1.25x in the frontier run; docs/quality.md#dit).
#: They set the schedule alone, so the preset's rope (or the user's) stays, as the memory
#: budget's fallback keeps it: rope pooled measured 0.02, 0.13 and 0.24 dB above before on
#: these points, within the time noise and with a held-out loss up to 1 point worse, not
#: worth a second rope per path. A point naming blocks a model lacks (Wan, Qwen-Image and
#: the other DiTs without single-stream blocks) gives way to the next that names one of its
#: blocks (``all:2@0.5-1``: 27.3 dB, 1.16x), never to nothing.
DIT_NO_REUSE: dict[str, tuple[dict[str, Any], ...]] = {
    "quality": ({"schedule": "single:2@0.3-1"}, {"schedule": "all:2@0.5-1"}),
    "fast": ({"schedule": "all:2@0.3-1"},)}
#: The fields only a DiT reads (a UNet ignores them; a DiT ignores the merge fields and
#: ``max_downsample``).
DIT_FIELDS = ("rope", "blocks", "proportional", "schedule", "reuse", "paced", "temporal")


def preset(name: str, **changes: Any) -> ToMeConfig:
    """The ``ToMeConfig`` of a named preset (``quality``, ``balanced``, ``fast``)."""
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise ValueError(f"ToMe: unknown preset {name!r}; known: {sorted(PRESETS)}")
    check_names(changes)
    return ToMeConfig(**{**PRESETS[key], **on_preset(PRESETS[key], changes)})


def from_preset(name: str, data: dict[str, Any]) -> ToMeConfig:
    """``preset(name)`` with loosely typed ``data`` over it (coerced as ``ToMeConfig.from_dict``
    does): the WebUI's API and X/Y/Z, where keys given next to a preset override it."""
    check_names(data)
    return preset(name, **{k: coerce(FIELDS[k], v) for k, v in data.items()})


def on_preset(values: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``changes`` to a preset's ``values``: its DiT schedule is a starting point, so
    ``blocks`` and ``downsample_factor`` given without a schedule go into it (quality's
    ``all:8``, blocks double: ``double:8``; factor 4: ``all:4``; a UNet reads the factor as
    ever) rather than doing nothing. That point is the user's: without reuse it stays."""
    schedule = values.get("schedule", "")
    if not schedule or "schedule" in changes or not {"blocks", "downsample_factor"} & set(changes):
        return changes
    try:
        text = dit.Schedule.parse(schedule).retarget(changes.get("blocks", "all"),
                                                      changes.get("downsample_factor"))
    except ValueError:  # ``ToMeConfig`` names the bad value
        return changes
    return {**changes, "schedule": text, "blocks": "all"}


def without_reuse(config: ToMeConfig, kinds: Sequence[str] | None = None) -> ToMeConfig:
    """``config`` for a path that cannot reuse residuals: a preset's DiT point, known by its
    schedule and reuse (a rope the user changed is theirs and stays), becomes that preset's
    point without reuse (``DIT_NO_REUSE``): the first whose schedule pools a block of
    ``kinds`` (the model's block kinds in order, e.g. ``["double", "single"]``; None: the
    first point); any other config keeps its schedule with ``reuse=0``."""
    if not config.reuse:
        return config
    for name, point in DIT_PRESETS.items():
        if point and (config.schedule, config.reuse) == (point["schedule"], point["reuse"]):
            points = [config.replace(reuse=0, **p) for p in DIT_NO_REUSE[name]]
            return next((c for c in points if kinds is None or _pools_a_block(c, kinds)),
                        points[-1])
    return config.replace(reuse=0)


def _pools_a_block(config: ToMeConfig, kinds: Sequence[str]) -> bool:
    schedule = dit.schedule_of(config)
    return any(schedule.factor(i, kind, len(kinds), None) > 1 for i, kind in enumerate(kinds))
