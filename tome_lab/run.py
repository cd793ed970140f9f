"""The benchmark's run loop: every setting on every case, interleaved, one row each.

Per case: ``warmup`` rounds, then ``repeats`` timed rounds; a round runs every setting once,
in alternating order (A B C, C B A, ...), so slow phases of a shared machine or a GPU's clock
changes hit every setting alike. The first warm-up round also counts FLOPs and peak memory
(when ``measure``) and keeps the output, compared with the baseline's as the deviation.

With ``compile`` the model is compiled once (``torch.compile``) and every setting runs through
it: dynamo guards on the patches' hooks, so each setting gets its own graphs. Rows then say how
many graphs, graph breaks and recompilations (frames compiled after the setting's first call)
each setting caused, instead of hiding them.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import timing
from .models import Case, ldm_sdpa
from .settings import Setting


class Progress:
    """tqdm when installed, else one line per step on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        self.total, self.n, self.enabled = total, 0, enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, text: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(text[:60])
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.n}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def default_warmup(device: torch.device | str, compile: bool = False) -> int:
    """Warm-up rounds: one on a CPU (a UNet call is long), three on a GPU (kernel selection,
    allocator, clocks), at least two when compiling (the first call compiles)."""
    n = 1 if torch.device(device).type == "cpu" else 3
    return max(n, 2) if compile else n


def run_benchmark(cases: Iterable[Case], settings: Sequence[Setting], repeats: int = 3,
                  measure: bool = True, progress: bool = True,
                  on_row: Callable[[dict[str, Any]], None] | None = None,
                  warmup: int | None = None, compile: bool = False,
                  compile_backend: str = "inductor") -> list[dict[str, Any]]:
    """Time every setting on every case; one row per (case, setting), with the raw times and
    the derived numbers (speed-up vs the baseline and vs tomesd)."""
    cases = list(cases)
    rounds = [max(warmup if warmup is not None else default_warmup(c.device, compile),
                  2 if compile else 1) + repeats for c in cases]
    bar = Progress(sum(r * len(settings) for r in rounds), progress)
    rows: list[dict[str, Any]] = []
    config = timing.compile_config() if compile else contextlib.nullcontext()
    try:
        with config:
            for case, n in zip(cases, rounds):
                new = _run_case(case, settings, n - repeats, repeats, measure, bar, compile,
                                compile_backend)
                rows += new
                for r in new if on_row else ():
                    on_row(r)
    finally:
        bar.close()
    return rows


def same_bits_twice(case: Case, setting: Setting) -> bool:
    """Whether the patched UNet gives the same bits when called twice on the same inputs, with
    torch's deterministic algorithms left off, as people run it: what "same seed, same image"
    needs from the device (designed for with a fixed-point merge without atomics)."""
    with torch.inference_mode(), ldm_sdpa():
        setting.apply(case.model)
        try:
            first, second = case.forward(), case.forward()
        finally:
            setting.remove(case.model)
    return torch.equal(first, second)


def _run_case(case: Case, settings: Sequence[Setting], warmup: int, repeats: int,
              measure: bool, bar: Progress, compile: bool, backend: str
              ) -> list[dict[str, Any]]:
    n = len(settings)
    timer = timing.Timer(case.device)
    times: list[list[float]] = [[] for _ in range(n)]
    outputs: list[torch.Tensor | None] = [None] * n
    flops: list[int | None] = [None] * n
    peaks: list[float | None] = [None] * n
    patched: list[str] = [""] * n
    comp: list[dict[str, Any] | None] = [None] * n
    model = torch.compile(case.model, backend=backend) if compile else case.model
    with torch.inference_mode(), ldm_sdpa():
        for rnd in range(warmup + repeats):
            order = list(range(n)) if rnd % 2 == 0 else list(reversed(range(n)))
            for i in order:
                s = settings[i]
                s.apply(case.model)
                try:
                    torch.manual_seed(case.seed)  # tomesd draws its random cells globally
                    before = timing.compile_counters() if compile else None
                    if rnd == 0:
                        if s.config is not None and s.config.policy == "auto":
                            case.forward(model)  # measures: kept out of FLOPs and memory
                        patched[i] = s.patched_blocks(case.model)
                        outputs[i], flops[i], peak = _first_call(case, model, measure, compile)
                        peaks[i] = peak if not compile else None
                    elif compile and measure and rnd == warmup - 1:
                        mem: dict[str, float | None] = {}
                        with timing.peak_memory(mem, case.device):
                            case.forward(model)
                        peaks[i] = mem.get("peak")
                    else:
                        dt, _ = timer(lambda: case.forward(model))
                        if rnd >= warmup:
                            times[i].append(dt)
                    if compile:
                        d = timing.compile_delta(before, timing.compile_counters())
                        comp[i] = _add_compile(comp[i], d, first=rnd == 0)
                finally:
                    s.remove(case.model)
                stage = "warm-up" if rnd < warmup else f"#{rnd - warmup + 1}"
                bar.step(f"{case.label} {s.label} {stage}")
    base = next((i for i, s in enumerate(settings) if s.unmerged), None)
    rows = []
    for i, s in enumerate(settings):
        med = statistics.median(times[i]) if times[i] else math.nan
        rows.append({
            "model": case.model_name, "size": case.size, "dtype": case.dtype,
            "batch": case.batch, "device": case.device.type,
            "setting": s.label, "group": s.group, "spec": s.spec, "method": s.method,
            "impl": s.impl, "value": s.value, "options": dict(s.options), "reduction": s.reduction,
            "times": times[i], "median": med, "min": min(times[i], default=math.nan),
            "max": max(times[i], default=math.nan), "flops": flops[i], "peak": peaks[i],
            "patched": patched[i], "compile": comp[i],
            "deviation": (deviation(outputs[i], outputs[base])
                          if base is not None and outputs[i] is not None else math.nan),
        })
    derive(rows)
    return rows


def _first_call(case: Case, model: torch.nn.Module, measure: bool, compile: bool):
    """The first warm-up call: output (eager when compiling, so FLOPs are counted on the real
    ops), FLOPs and peak memory."""
    if not measure:
        return case.forward(model).float(), None, None
    mem: dict[str, float | None] = {}
    with contextlib.ExitStack() as ctx:
        counter = ctx.enter_context(timing.flop_counter())
        if not compile:
            ctx.enter_context(timing.peak_memory(mem, case.device))
        out = case.forward()  # eager: FLOP counting does not trace through dynamo
    if compile:
        case.forward(model)  # compile it now, outside the counter
    return out.float(), counter.get_total_flops(), mem.get("peak")


def _add_compile(acc: dict[str, Any] | None, d: dict[str, Any], first: bool) -> dict[str, Any]:
    acc = acc or {"graphs": 0, "breaks": 0, "recompiles": 0, "reasons": []}
    acc["graphs"] += d["graphs"]
    acc["breaks"] += d["breaks"]
    if not first:
        acc["recompiles"] += d["frames"]
    acc["reasons"] += [r for r in d["reasons"] if r not in acc["reasons"]]
    return acc


def deviation(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||``."""
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def derive(rows: list[dict[str, Any]]) -> None:
    """Speed-ups of one case's rows vs its baseline and vs tomesd: the tomesd row with the
    same ratio (merge), else tomesd at ratio 0.5 (downsample, ceiling), else the first tomesd
    row; match-only is compared with tomesd's match-only."""
    base = next((r for r in rows if r["method"] == "baseline"), None)
    tomesd = [r for r in rows if r["method"] == "tomesd"]
    for r in rows:
        r["speedup"] = base["median"] / r["median"] if base else math.nan
        if r["method"] == "match-only":
            ref = next((t for t in rows if t["method"] == "match-only"
                        and t.get("impl") == "tomesd"), None)
        else:
            want = r["value"] if r["method"] in ("merge", "tomesd") else 0.5
            ref = next((t for t in tomesd if t["value"] == want and not t["options"]),
                       next((t for t in tomesd if t["value"] == want),
                            tomesd[0] if tomesd else None))
        r["vs_tomesd"] = (ref["median"] / r["median"]
                          if ref is not None and r["method"] != "baseline" else math.nan)
