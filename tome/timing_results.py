"""What ``measure`` found: one level's timing (``LevelTiming``) and one reading
(``Measurement``), with the strict round trip through JSON the cache (``measurements.py``)
keeps them in. Pure data: timing is ``measure.py``'s, remembering ``measurements.py``'s.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from . import policy
from .policy import MARGIN


@dataclass(frozen=True)
class LevelTiming:
    """One UNet level, per UNet call: ``unmerged_ms`` = blocks x block time; ``merged_ms`` =
    plans x plan build + blocks x merged block time. ``low``/``high``: the spread of the
    speed-up over the timed rounds (each round's own figure, and this one), None in a
    reading cached before spreads were kept."""

    level: int         # downsample factor (1 = full resolution)
    tokens: int        # tokens a block at this level sees
    blocks: int        # transformer blocks at this level
    plans: int         # plans built per call (per UNet side, or per block with share="block")
    unmerged_ms: float
    merged_ms: float
    low: float | None = None
    high: float | None = None

    @property
    def speedup(self) -> float:
        return ratio(self.unmerged_ms, self.merged_ms)

    def uncertain(self, margin: float = MARGIN) -> bool:
        """Its rounds fall on both sides of the decision (``policy.uncertain``)."""
        return policy.uncertain(self.low, self.high, margin)

    def verdict(self, margin: float = MARGIN) -> str:
        """``merged``, ``not merged`` or ``uncertain (rounds ...), not merged``."""
        return policy.verdict(self.speedup, self.low, self.high, margin)


def ratio(a: float, b: float) -> float:
    """``a / b``; infinite where ``b`` is 0 (a merged time too small to read)."""
    return a / b if b > 0 else math.inf


FIELDS = {"device", "dtype", "latent", "batch", "method", "rows"}  # a Measurement's dict
OPTIONAL = {"taken"}  # not in a reading cached before it was kept


@dataclass(frozen=True)
class Measurement:
    """What ``measure`` found on one device for one latent size, batch and method, and when
    (``taken``: UTC, ISO 8601; None in a reading cached before it was kept)."""

    device: str                # e.g. "NVIDIA H100 80GB HBM3", "AMD EPYC 7B13", "Apple MPS"
    dtype: str                 # "float16", "float32", ...
    latent: tuple[int, ...]    # (height, width) of the latent; a video's (frames, height, width)
    batch: int
    method: str
    rows: tuple[LevelTiming, ...]
    taken: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The fields a reading always had, plus ``taken`` and each row's spread where known."""
        d = asdict(self)
        d["latent"] = list(self.latent)
        d["rows"] = [{k: v for k, v in r.items() if v is not None} for r in d["rows"]]
        if d["taken"] is None:
            del d["taken"]
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Measurement:
        """Strict: anything malformed raises ``ValueError`` (the cache then ignores it). A
        reading without ``taken`` or a row without its spread (cached before they were kept)
        is read as it was written."""
        try:
            rows = tuple(LevelTiming(int(r["level"]), int(r["tokens"]), int(r["blocks"]),
                                     int(r["plans"]), float(r["unmerged_ms"]),
                                     float(r["merged_ms"]), *_spread(r)) for r in d["rows"])
            size = tuple(int(v) for v in d["latent"])
            if len(size) not in (2, 3):
                raise ValueError(f"latent {size}")
            taken = d.get("taken")
            if taken is not None and not isinstance(taken, str):
                raise ValueError(f"taken {taken!r}")
            m = cls(str(d["device"]), str(d["dtype"]), size, int(d["batch"]),
                    str(d["method"]), rows, taken)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ToMe: not a measurement: {e!r}") from None
        if not FIELDS <= set(d) <= FIELDS | OPTIONAL or not all(
                math.isfinite(t) and t >= 0 for r in rows for t in (r.unmerged_ms, r.merged_ms)):
            raise ValueError("ToMe: not a measurement: unexpected fields or times")
        return m


def _spread(r: dict[str, Any]) -> tuple[float, float] | tuple[()]:
    """A row's ``(low, high)``, or nothing where the row has no spread; ``ValueError`` for a
    spread that is not one (half of it, negative, NaN, low above high)."""
    if "low" not in r and "high" not in r:
        return ()
    low, high = float(r["low"]), float(r["high"])
    if not 0 <= low <= high:  # also NaN
        raise ValueError(f"spread {low}, {high}")
    return low, high
