"""The ``auto`` policy: merge a UNet level only where it pays on the device that runs it.

Merging costs a fixed amount of work per block (matching, gathers, kernel launches) and saves
attention work that grows with the square of the token count. On a CPU the saving wins from
about a thousand tokens; on a fast GPU with fused attention (SDPA, xFormers) a 512 px SD1.5
image (4096 tokens at the top level) is faster *without* merging, and the gain starts at
1024 px. Measurements behind each threshold are in ``docs/speed.md``.

Two sources, best first: a measurement of this model on this device at this size
(``measure.py``: a level is merged where it was measured at least ``MARGIN`` faster and its
timed rounds agree on that: ``uncertain``), else a token threshold per device kind (each
method's ``thresholds``).

Pure decisions on plain numbers: no model, no tensors, so hosts can say what will happen
(console line, infotext) and tests can check every branch without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from . import methods
from .config import ToMeConfig

# The device kinds with thresholds. The thresholds belong to each method
# (``methods.Method.thresholds``). CPU: tome.bench on an AMD EPYC core, fp32 (AVX2): at 1024
# tokens (256 px) merge 0.5 0.96x, ToDo x2 0.94x, tomesd 0.95x; at 4096 tokens (512 px) merge
# 1.13x, ToDo x2 1.20x (in bf16, on CPUs that have it, 1024 tokens already paid: 1.08-1.11x).
# CUDA: H100, fp16, SDPA, batch 2: at 4096 tokens ToDo x2 1.01x and merge 0.5 0.82-0.91x; at
# 16384 1.25x and 1.01-1.08x. MPS: not measured; Apple GPUs have far less attention
# throughput than an H100, so merging pays earlier there: the CPU's figure as an estimate.
KINDS = ("cpu", "cuda", "mps")
# Devices without a measurement are treated like the fastest kind: never merged too early.
FALLBACK = "cuda"
# A measured level is merged only where it ran at least this much faster: timing noise on a
# busy machine is a few percent, and a wrong "merge" costs quality for nothing.
MARGIN = 0.05


def pays(speedup: float, margin: float = MARGIN) -> bool:
    """A measured speed-up that justifies merging: at least ``1 + margin``."""
    return speedup >= 1.0 + margin


def uncertain(low: float | None, high: float | None, margin: float = MARGIN) -> bool:
    """A measurement whose timed rounds disagree about the decision: the slowest round's
    speed-up (``low``) is under ``1 + margin``, the fastest's (``high``) at or above it. A
    figure from such rounds is a coin flip on a busy machine, so it never merges. No spread
    (``None``: a reading cached before spreads were kept) is certain."""
    return low is not None and high is not None and not pays(low, margin) and pays(high, margin)


def verdict(speedup: float, low: float | None = None, high: float | None = None,
            margin: float = MARGIN) -> str:
    """``merged``, ``not merged`` or ``uncertain (rounds 0.92x to 1.31x), not merged``: the
    words every console line, infotext note and table uses for a measured level."""
    if uncertain(low, high, margin):
        return f"uncertain (rounds {low:.2f}x to {high:.2f}x), not merged"
    return "merged" if pays(speedup, margin) else "not merged"


def device_kind(device: object) -> str:
    """``cpu``, ``cuda`` or ``mps`` for a ``torch.device`` (or its string); others map to
    the most conservative kind."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return kind if kind in KINDS else FALLBACK


class LevelSpeed(NamedTuple):
    """A level's measured speed-up (unmerged time / merged time), the device measured on and
    the spread of its timed rounds' speed-ups (``low``, ``high``; None where not known): what
    a measurement hands the policy (``measurements.speedups``)."""

    speedup: float
    device: str
    low: float | None = None
    high: float | None = None

    @property
    def merged(self) -> bool:
        """Merged: at least ``MARGIN`` faster, and not ``uncertain``."""
        return pays(self.speedup) and not uncertain(self.low, self.high)


@dataclass(frozen=True)
class Decision:
    """Whether one UNet level is merged in a pass, and why (for the console and infotext)."""

    level: int        # downsample factor of the level (1 = full resolution)
    tokens: int       # tokens a block at this level sees
    merged: bool
    reason: str


# What a latent pixel is in the image: 8 px per side (every VAE the hosts run so far), and a
# causal video VAE's frames (Wan, HunyuanVideo): the first latent frame is one frame, each
# later one 4.
SCALE, FRAME_SCALE = 8, 4


def latent_grid(latent: tuple[int, ...]) -> tuple[int, int, int]:
    """``(frames, height, width)`` of a latent size: an image's ``(height, width)`` is one
    frame; a video latent's ``(frames, height, width)`` as it is."""
    size = tuple(int(s) for s in latent)
    if len(size) == 2:
        return (1, *size)
    if len(size) != 3:
        raise ValueError(f"ToMe: a latent size is (height, width) or (frames, height, width), "
                         f"not {size}")
    return size


def level_tokens(latent: tuple[int, ...], level: int) -> int:
    """Tokens at ``level`` for a latent of ``(height, width)`` or ``(frames, height, width)``
    (frames keep their count): the UNet's stride-2 convolutions round up, so odd sizes keep
    their last row and column."""
    t, h, w = latent_grid(latent)
    return t * math.ceil(h / level) * math.ceil(w / level)


def pixels(latent: tuple[int, ...], scale: int = SCALE, frame_scale: int = FRAME_SCALE
           ) -> tuple[int, int, int]:
    """``(width, height, frames)`` of the image or video a latent decodes to."""
    t, h, w = latent_grid(latent)
    return w * scale, h * scale, (t - 1) * frame_scale + 1


def size_text(latent: tuple[int, ...], scale: int = SCALE) -> str:
    """The size every console line names: ``512x512 px``, a video ``832x480 px, 33 frames``."""
    w, h, frames = pixels(latent, scale)
    return f"{w}x{h} px" + (f", {frames} frames" if frames > 1 else "")


def decide_level(config: ToMeConfig, level: int, tokens: int, kind: str,
                 measured: LevelSpeed | None = None, method: object = None) -> Decision:
    """Whether a level with ``tokens`` tokens is merged under ``config.policy`` on ``kind``;
    ``measured``: ``LevelSpeed`` (or ``(speed-up, device name)``) of this level on this device,
    if measured: merged from ``MARGIN`` faster unless its rounds disagree (``uncertain``);
    ``method``: the form that runs (a DiT's ``dit.DitPool``, with its own thresholds), else
    ``config.method``'s."""
    if config.policy == "fixed":
        return Decision(level, tokens, True, "fixed policy")
    if measured is not None:
        m = LevelSpeed(*measured)
        return Decision(level, tokens, m.merged, f"measured {m.speedup:.2f}x on {m.device}, "
                        + verdict(m.speedup, m.low, m.high))
    threshold = _threshold(config, kind, method)
    if tokens >= threshold:
        return Decision(level, tokens, True, f"{tokens} tokens, at or above the {kind.upper()} "
                        f"threshold ({threshold})")
    return Decision(level, tokens, False, f"{tokens} tokens, below the {kind.upper()} threshold "
                    f"({threshold}), not merged")


def _threshold(config: ToMeConfig, kind: str, method: object) -> int:
    thresholds = getattr(method, "thresholds", None) or methods.get(config.method).thresholds
    return thresholds.get(kind, thresholds.get(FALLBACK, 0))


def merges(config: ToMeConfig, tokens: int, kind: str, measured: LevelSpeed | None = None,
           method: object = None) -> bool:
    """``decide_level(...).merged`` without its reason: what a compiled graph asks, where
    ``tokens`` is symbolic (the comparison is a guard that holds until the threshold is
    crossed; a reason's text would pin the count)."""
    if config.policy == "fixed":
        return True
    if measured is not None:
        return LevelSpeed(*measured).merged
    return tokens >= _threshold(config, kind, method)


def decide(config: ToMeConfig, latent: tuple[int, ...], levels: list[int] | tuple[int, ...],
           kind: str, measured: dict[int, LevelSpeed] | None = None,
           method: object = None) -> list[Decision]:
    """One ``Decision`` per level in ``levels`` (those the settings would merge).

    ``fixed`` merges every one of them; ``auto`` those measured at least ``MARGIN`` faster
    and not ``uncertain`` (``measured``: level -> ``LevelSpeed``), the others by the device
    kind's threshold.
    """
    measured = measured or {}
    return [decide_level(config, lv, level_tokens(latent, lv), kind, measured.get(lv), method)
            for lv in sorted(levels)]


def summary(decisions: list[Decision], latent: tuple[int, ...], scale: int = SCALE) -> str:
    """One line, e.g. ``512x512 px: ds1 4096 tokens, below the CUDA threshold (16384); not
    merged`` (a video: ``832x480 px, 33 frames: ...``)."""
    head = size_text(latent, scale)
    if not decisions:
        return f"{head}: no level to merge"
    return head + ": " + "; ".join(f"ds{d.level} {d.reason}" for d in decisions)
