"""The matching step alone: building merge/unmerge for one block input, as tomesd's
``bipartite_soft_matching_random2d`` does, per implementation: time and peak extra memory."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .models import DTYPES
from .run import Progress
from .timing import Timer, peak_memory

IMPLS = ("tomesd", "global", "local")


def run_matching(tokens: int = 65536, channels: int = 320, batch: int = 2,
                 dtype: str = "fp32", ratio: float = 0.5, repeats: int = 2,
                 which: Sequence[str] = IMPLS, progress: bool = True,
                 device: torch.device | str = "cpu") -> list[dict[str, Any]]:
    """One row per implementation: median time, peak extra memory, speed vs tomesd."""
    from tome import merge

    dev = torch.device(device)
    h = w = round(math.sqrt(tokens))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, h * w, channels, generator=g).to(dev, DTYPES[dtype])
    r = int(h * w * ratio)
    timer = Timer(dev)

    def fn(name: str) -> Callable[[], Any]:
        gen = torch.Generator().manual_seed(1)
        if name == "tomesd":
            from tomesd.merge import bipartite_soft_matching_random2d as ref
            return lambda: ref(x, w, h, 2, 2, r, no_rand=False, generator=gen)
        return lambda: merge.bipartite_soft_matching_random2d(
            x, w, h, 2, 2, r, no_rand=False, generator=gen, matching=name)

    bar = Progress(len(which) * (1 + repeats), progress)
    rows = []
    try:
        with torch.inference_mode():
            for name in which:
                f = fn(name)
                mem: dict[str, float | None] = {}
                with peak_memory(mem, dev):
                    f()
                bar.step(f"matching {name} memory")
                ts = []
                for _ in range(repeats):
                    ts.append(timer(f)[0])
                    bar.step(f"matching {name} timed")
                rows.append({"impl": name, "tokens": h * w, "channels": channels,
                             "batch": batch, "dtype": dtype, "device": dev.type, "times": ts,
                             "median": statistics.median(ts), "peak": mem["peak"]})
    finally:
        bar.close()
    ref = next((row for row in rows if row["impl"] == "tomesd"), None)
    for row in rows:
        row["vs_tomesd"] = ref["median"] / row["median"] if ref else math.nan
    return rows
