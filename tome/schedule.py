"""The DiT schedule: which factor pools which block at which point of sampling
(``ToMeConfig.schedule``, the ``blocks`` setting), parsed once; ``dit.py`` re-exports it.
Also when residual reuse refreshes at a step count (``period``: ``ToMeConfig.paced``)."""

from __future__ import annotations

import functools
import math
import re
from typing import Any

BLOCKS_HELP = "all, double (double-stream / joint blocks only) or a range of block indices 'a-b'"
#: The largest pooling factor per side (a schedule item's, and ``downsample_factor``'s).
MAX_FACTOR = 8
#: The most items a schedule may have: a DiT has at most a few dozen blocks, and every pooled
#: block reads the items at every call where windows differ.
MAX_ITEMS = 64
_RANGE = re.compile(r"([0-9]{1,4})(?:-([0-9]{1,4}))?")  # block indices: ASCII digits


def parse_blocks(text: str) -> tuple[str, int, int]:
    """``("all"|"double", 0, 0)`` or ``("range", a, b)`` from the ``blocks`` setting; raises
    ``ValueError`` with what is allowed."""
    t = str(text).strip().lower().replace(" ", "")
    if t in ("all", "double"):
        return t, 0, 0
    m = _RANGE.fullmatch(t)
    if m and int(m[1]) <= int(m[2] or m[1]):
        return "range", int(m[1]), int(m[2] or m[1])
    raise ValueError(f"must be {BLOCKS_HELP}")


SCHEDULE_HELP = ("items 'blocks[:factor][@start-end]' separated by commas; blocks: all, double, "
                 "single, first, last, inner or 'a-b'; a later item wins where it applies")
_SELECTORS = ("all", "double", "single", "first", "last", "inner")


def _selected(sel: tuple[str, int, int], index: int, kind: str, count: int) -> bool:
    which, a, b = sel
    return {"all": True, "double": kind == "double", "single": kind == "single",
            "first": index == 0, "last": index == count - 1,
            "inner": 0 < index < count - 1}.get(which, a <= index <= b)


class Schedule:
    """Which factor pools which block at which point of sampling (``ToMeConfig.schedule``).

    Items ``(selector, factor, start, end)``; for a block at sampling progress ``p`` (0 = the
    first, noisiest step) the last item that names the block and whose window holds ``p``
    gives the factor (0 where none does: unpooled; 1 runs the pooled path's maths unpooled).
    DiTs differ from UNets in where pooling costs
    (docs/quality.md#dit): this says it per block and window in one setting."""

    __slots__ = ("items", "text")

    def __init__(self, items: tuple, text: str):
        self.items, self.text = items, text

    @classmethod
    def parse(cls, text: str, factor: int = 2, start: float = 0.0, end: float = 1.0,
              blocks: str = "all") -> Schedule:
        """From the ``schedule`` setting; empty: ``factor`` in ``blocks`` over
        ``start``-``end`` (the settings before schedules). Raises ``ValueError``. Parsed once
        per setting (cached): a config, its patch and its report share the result."""
        return _parse(str(text).strip().lower().replace(" ", ""), factor, start, end,
                      str(blocks))

    def factor(self, index: int, kind: str, count: int, p: float | None) -> int:
        """The factor of block ``index`` of ``count`` (``kind``: double/single) at progress
        ``p`` (None: ignore windows: the largest factor the block may get); 0: not named."""
        f = 0
        for sel, fac, lo, hi in self.items:
            if _selected(sel, index, kind, count):
                if p is None:
                    f = max(f, fac)
                elif lo <= p <= hi:
                    f = fac
        return f

    def factors(self, index: int, kind: str, count: int) -> tuple[int, ...]:
        """Every factor block ``index`` takes over sampling, 0 (unpooled) included where a
        window leaves it out: what a compiled block switches between (``wrappers.switch``)."""
        edges = sorted({0.0, 1.0, *(e for *_, lo, hi in self.items for e in (lo, hi))})
        points = edges + [(a + b) / 2 for a, b in zip(edges, edges[1:])]
        return tuple(sorted({self.factor(index, kind, count, p) for p in points}))

    def describe(self) -> str:
        """``x4 in all blocks, steps 0.3-1; x2 in block 0`` (what a patch resolved to)."""
        def blocks(sel: tuple[str, int, int]) -> str:
            which, a, b = sel
            if which != "range":
                return f"{which} blocks" if which in ("all", "double", "single", "inner") \
                    else f"the {which} block"
            return f"block {a}" if a == b else f"blocks {a}-{b}"
        return "; ".join(f"x{fac} in {blocks(sel)}" + (
            f", steps {lo:g}-{hi:g}" if (lo, hi) != (0, 1) else "")
            for sel, fac, lo, hi in self.items)

    def retarget(self, blocks: str = "all", factor: int | None = None) -> str:
        """This schedule's text with its ``all`` items in ``blocks`` (the ``blocks``
        setting's values) and every item at ``factor`` (None: its own): a preset's schedule
        with the user's ``blocks`` and ``downsample_factor`` (``config.on_preset``). Raises
        ``ValueError`` where ``blocks`` is not a setting's value, or is not ``all`` and an
        item names blocks of its own."""
        which = parse_blocks(blocks)[0]
        items = []
        for (sel, a, b), fac, lo, hi in self.items:
            named = f"{a}-{b}" if sel == "range" else sel
            if which != "all":
                if sel != "all":
                    raise ValueError(f"blocks={blocks!r} beside a schedule item naming "
                                     f"{named}: set a schedule instead")
                named = str(blocks).strip().lower().replace(" ", "")
            window = f"@{lo:g}-{hi:g}" if (lo, hi) != (0, 1) else ""
            items.append(f"{named}:{fac if factor is None else factor}{window}")
        return ",".join(items)

    def window(self) -> tuple[float, float]:
        """The steps where any block may pool (what the planner's window needs to let in)."""
        pooled = [(lo, hi) for _, fac, lo, hi in self.items] or [(0.0, 0.0)]
        return min(lo for lo, _ in pooled), max(hi for _, hi in pooled)

    def varies(self) -> bool:
        """Whether blocks need the call's progress (items with different windows)."""
        return len({(lo, hi) for _, _, lo, hi in self.items}) > 1


@functools.lru_cache(maxsize=64)
def _parse(t: str, factor: int, start: float, end: float, blocks: str) -> Schedule:
    """``Schedule.parse`` of a normalised text (a Schedule is immutable: shared)."""
    if not t:
        return Schedule(((parse_blocks(blocks), factor, start, end),), "")
    if t.count(",") >= MAX_ITEMS:
        raise ValueError(f"{t.count(',') + 1} items: at most {MAX_ITEMS} ({SCHEDULE_HELP})")
    items = []
    for part in t.split(","):
        sel, _, window = part.partition("@")
        sel, _, f = sel.partition(":")
        try:
            lo, hi = (float(v) for v in window.split("-")) if window else (start, end)
            fac = int(f) if f else factor
        except ValueError:
            raise ValueError(f"{part!r}: must be {SCHEDULE_HELP}") from None
        if not (0 <= lo <= hi <= 1 and 1 <= fac <= MAX_FACTOR):
            raise ValueError(f"{part!r}: factor 1-{MAX_FACTOR}, window within 0-1 "
                             "(start <= end)")
        which = (sel, 0, 0) if sel in _SELECTORS else parse_blocks(sel)
        items.append((which, fac, lo, hi))
    return Schedule(tuple(items), t)


def schedule_of(config: Any) -> Schedule:
    """The DiT schedule a config resolves to (``schedule``, or the plain settings)."""
    return Schedule.parse(getattr(config, "schedule", ""), config.downsample_factor,
                          config.start, config.end, config.blocks)


#: The step count at which a paced ``reuse`` N holds as given (``period``).
PACE_STEPS = 20


def period(every: int, paced: bool, steps: int | None) -> int:
    """Steps between refreshes: ``every`` at 20 steps, scaled with the square root of the
    step count where ``paced`` and the host tells it (N=5: 2 at 4 steps, 3 at 8, 8 at 50;
    never below 2 from above), else ``every``. Measured on the tiny DiT (quality's x8), that
    kept 31-34 dB from 4 to 20 steps (50: 7 gave 31.3 dB) where a fixed period 5 ranged
    23-34 dB and 4 refreshes per generation 29-40 dB (docs/quality.md#stacked-with-step-caches)."""
    if not paced or not steps or not every:
        return every
    return max(min(every, 2), round(every * math.sqrt(steps / PACE_STEPS)))
