"""Does the measured auto policy decide right? Measured decisions against whole UNet calls.

    python -m tome_lab.sweep                 # SD1.5 and SDXL shapes, several sizes (CPU: long)
    python -m tome_lab.sweep --models sd15 --sizes 256,512 --repeats 3 --threads 1

For each model and size: ``tome.measure.measure`` times every candidate level (one block per
level, as the auto policy does at a generation's first call); then whole UNet calls are timed,
interleaved: unmerged, each level merged alone, and the auto policy with what it measured.

The truth a decision is checked against comes from those whole calls. A deep level merged
alone moves a whole call by about 1%, below what a whole-call timing resolves on a shared
machine (a fixed matmul drifts by 10% over seconds here), so each call also records the time
spent inside every level's transformer blocks (hooks; CUDA events on a GPU), and a level's
*in-call* speed-up is its share of its own call, unmerged against merged, per round (the
rest of the call, the same work in both, cancels the drift), median over rounds. A decision
*agrees* when the library's decision (``measure.decide``: measured at least 1 + MARGIN
faster, its rounds agreeing on that, else "uncertain", not merged) matches "the level ran faster
inside the merged call"; it *costs* when it was wrong by more than ``NOISE`` of the whole call. The
whole-call speed-up (median of per-round ratios) is reported beside it with its range, and
agreement with it is counted where every round lands on the same side of 1. Also reported:
where auto merged, its whole call against unmerged (never more than 2% slower is the goal),
and what measuring cost as a share of a 20-step generation (20 UNet calls of this batch).

Random-weight UNets from their configs, fp32 on a CPU (bf16 where native), fp16 on a GPU;
ldm attention through SDPA (the WebUI's default). Writes ``out/sweep/sweep.json`` and a
Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from typing import Any

import torch

from tome import adapters as _patch
from tome import layout as _layout
from tome import policy
from tome.config import ToMeConfig
from tome.measure import decide, measure

from .device import device_name, pick_device, pick_dtype
from .models import build_case, ldm_sdpa
from .run import Progress
from .timing import Timer

DEFAULT_SIZES = {"sd15": (256, 384, 512, 768), "sdxl": (512, 768, 1024)}
GENERATION_STEPS = 20
NOISE = 0.01


class _forced:  # noqa: N801 (used like a function: _forced({1: True}))
    """A measuring service that says exactly which levels pay: how one level alone is
    merged. Like ``measurements.Measurer``, each adapter asks it for a model's measurer."""

    def __init__(self, levels: dict[int, bool]):
        self.levels = levels

    def for_model(self, model: Any, config: Any, runner: Any):
        return lambda size, batch, device: {
            lv: policy.LevelSpeed(2.0 if on else 0.5, "forced") for lv, on in self.levels.items()}


class LevelClock:
    """Seconds spent inside each level's transformer blocks during one call: ``with
    clock.record() as spent: unet(...)``, then ``spent[level]``. Hooks outermost on every
    block (plan building and unmerging included); CUDA events on a GPU, read after the call."""

    def __init__(self, unet: torch.nn.Module, device: torch.device):
        self.levels = {b.module: b.level for b in _layout.read(unet).blocks if b.level}
        self.cuda = device.type == "cuda"

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @contextlib.contextmanager
    def record(self):
        spans: list[tuple[int, Any, Any]] = []
        starts: dict[int, Any] = {}
        handles = []
        for block, level in self.levels.items():
            def pre(m, args, kwargs):
                starts[id(m)] = self._now()

            def post(m, args, kwargs, out, level=level):
                spans.append((level, starts.pop(id(m)), self._now()))
            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True, prepend=True))
            handles.append(block.register_forward_hook(post, with_kwargs=True))
        spent: dict[int, float] = {}
        try:
            yield spent
        finally:
            for h in handles:
                h.remove()
        if self.cuda:
            torch.cuda.synchronize()
        for level, t0, t1 in spans:
            seconds = t0.elapsed_time(t1) / 1000.0 if self.cuda else t1 - t0
            spent[level] = spent.get(level, 0.0) + seconds


def sweep_case(case: Any, config: ToMeConfig, repeats: int, rounds: int,
               timer: Timer) -> list[dict[str, Any]]:
    """Rows of one (model, size): one per candidate level, plus the auto policy's."""
    unet = _layout.find_unet(case.model)
    known = _layout.read(unet).levels
    top = config.max_downsample or max(known)
    levels = [lv for lv in known if lv <= top]
    latent = (case.size // 8, case.size // 8)
    t0 = time.perf_counter()
    m = measure(unet, latent, case.batch, config, rounds=rounds, levels=levels,
                runner=_patch.runner(_layout.read(unet)))
    measure_s = time.perf_counter() - t0
    measured = {r.level: r for r in m.rows}
    settings: dict[str, Any] = {"unmerged": None}
    for lv in levels:
        settings[f"ds{lv}"] = _forced({x: x == lv for x in levels})
    settings["auto"] = _forced({r.level: decide(r) for r in m.rows})  # the library's decision
    clock = LevelClock(unet, case.device)
    calls: dict[str, list[float]] = {k: [] for k in settings}
    inside: dict[str, list[dict[int, float]]] = {k: [] for k in settings}
    names = list(settings)
    for i in range(repeats + 1):  # the first round warms up
        for name in names if i % 2 == 0 else names[::-1]:
            if settings[name] is not None:
                _patch.apply(unet, config.replace(policy="auto"), settings[name])
            try:
                with clock.record() as spent:
                    seconds, _ = timer(case.forward)
            finally:
                _patch.remove(unet)
            if i:
                calls[name].append(seconds)
                inside[name].append(spent)

    def whole(name: str) -> list[float]:  # per-round speed-ups of the whole call
        return sorted(u / v for u, v in zip(calls["unmerged"], calls[name]))

    def share(name: str, lv: int) -> list[float]:  # the level's time / the rest of its call
        return [d[lv] / (c - d[lv]) for c, d in zip(calls[name], inside[name])]

    base = statistics.median(calls["unmerged"])
    rows = []
    for lv in levels:
        r, name = measured[lv], f"ds{lv}"
        in_call = statistics.median(u / v for u, v in zip(share("unmerged", lv), share(name, lv)))
        level_share = statistics.median(d[lv] / c for c, d in zip(calls["unmerged"],
                                                                  inside["unmerged"]))
        saved = level_share * (1 - 1 / in_call)  # of the whole unmerged call
        ratios, decision = whole(name), decide(r)
        rows.append({"model": case.model_name, "size": case.size, "level": lv,
                     "tokens": r.tokens, "measured": r.speedup, "decision": decision,
                     "uncertain": r.uncertain(),
                     "in_call": in_call, "level_share": level_share, "saved": saved,
                     "agrees": decision == (in_call > 1.0),
                     "costs": saved < -NOISE if decision else saved > NOISE,
                     "actual": statistics.median(ratios), "actual_range": [ratios[0],
                                                                           ratios[-1]],
                     "resolved": ratios[0] > 1.0 or ratios[-1] < 1.0,
                     "agrees_whole": decision == (statistics.median(ratios) > 1.0)})
    auto_levels = [lv for lv in levels if decide(measured[lv])]
    rows.append({"model": case.model_name, "size": case.size, "level": "auto",
                 "merged": auto_levels, "auto": statistics.median(whole("auto")),
                 "unmerged_s": base, "measure_s": measure_s,
                 "overhead": measure_s / (GENERATION_STEPS * base)})
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    levels = [r for r in rows if r["level"] != "auto"]
    resolved = [r for r in levels if r["resolved"]]
    autos = [r for r in rows if r["level"] == "auto"]
    merged = [r for r in autos if r["merged"]]
    return {
        "agreement": sum(r["agrees"] for r in levels) / max(1, len(levels)),
        "costly": sum(r["costs"] for r in levels),
        "cases": len(levels),
        "whole_call_resolved": len(resolved),
        "whole_call_agreement": sum(r["agrees_whole"] for r in resolved) / max(1, len(resolved)),
        "auto_worst_where_merged": min((r["auto"] for r in merged), default=None),
        "overhead_max": max((r["overhead"] for r in autos), default=None),
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | size | level | tokens | measured | decision | in the call | agrees "
           "| whole call (range) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["level"] == "auto":
            merged = ", ".join(f"ds{lv}" for lv in r["merged"]) or "nothing"
            out.append(f"| {r['model']} | {r['size']} | auto | | | {merged} | | "
                       f"| {r['auto']:.2f}x; measuring {r['measure_s']:.1f} s = "
                       f"{100 * r['overhead']:.1f}% of {GENERATION_STEPS} steps |")
        else:
            lo, hi = r["actual_range"]
            said = "merge" if r["decision"] else "uncertain" if r.get("uncertain") else "no"
            out.append(f"| {r['model']} | {r['size']} | ds{r['level']} | {r['tokens']} | "
                       f"{r['measured']:.2f}x | {said} | "
                       f"{r['in_call']:.2f}x ({100 * r['saved']:+.1f}% of the call) | "
                       f"{'yes' if r['agrees'] else 'no'}{' (costs)' if r['costs'] else ''} | "
                       f"{r['actual']:.3f}x ({lo:.2f}-{hi:.2f}) |")
    return "\n".join(out)


def report(summary: dict[str, Any]) -> str:
    worst = summary["auto_worst_where_merged"]
    return "\n".join([
        f"agreement {100 * summary['agreement']:.0f}% of {summary['cases']} (model, size, "
        f"level) cases (in the call); wrong by more than {100 * NOISE:g}% of the UNet call: "
        f"{summary['costly']}",
        f"whole calls resolved one way in every round: {summary['whole_call_resolved']}, "
        f"agreement there {100 * summary['whole_call_agreement']:.0f}%",
        f"auto where it merged: worst {worst:.2f}x of unmerged" if worst is not None
        else "auto merged nothing",
        f"measuring cost at most {100 * summary['overhead_max']:.1f}% of a "
        f"{GENERATION_STEPS}-step generation"])


def write(out: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """``sweep.json`` (rows, summary) and ``sweep.md`` in ``out``; returns the summary."""
    summary = summarise(rows)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump({**meta, "rows": rows, "summary": summary}, f, indent=1)
    with open(os.path.join(out, "sweep.md"), "w") as f:
        f.write(table(rows) + "\n")
    return summary


def combine(dirs: list[str], out: str) -> int:
    runs = []
    for d in dirs:
        with open(os.path.join(d, "sweep.json")) as f:
            runs.append(json.load(f))
    rows = [r for run in runs for r in run["rows"]]
    summary = write(out, rows, {"combined": dirs, "device": runs[0]["device"],
                                "dtype": runs[0]["dtype"]})
    print(table(rows) + "\n\n" + report(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_lab.sweep", description=__doc__.split(
        "\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="sd15,sdxl")
    ap.add_argument("--sizes", default=None, help="px, comma-separated (default per model)")
    ap.add_argument("--method", default="merge", help="merge or downsample")
    ap.add_argument("--max-downsample", type=int, default=4,
                    help="deepest level considered (default 4: every level with attention "
                         "but the middle)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds of whole UNet calls")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the measurement")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="out/sweep")
    ap.add_argument("--combine", nargs="+", metavar="DIR",
                    help="summarise the sweep.json of several runs (e.g. one model per core) "
                         "into --out instead of measuring")
    a = ap.parse_args(argv)
    if a.combine:
        return combine(a.combine, a.out)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = pick_device(a.device)
    dtype, why = pick_dtype(device, a.dtype)
    config = ToMeConfig(method=a.method, max_downsample=a.max_downsample)
    print(f"ToMe sweep on {device_name(device)}; {why}; batch {a.batch}, {a.method}, "
          f"{torch.get_num_threads()} thread(s)")
    plan = [(name, size) for name in a.models.split(",")
            for size in ([int(s) for s in a.sizes.split(",")] if a.sizes
                         else DEFAULT_SIZES[name])]
    rows: list[dict[str, Any]] = []
    bar = Progress(len(plan))
    timer = Timer(device)
    meta = {"args": vars(a), "device": device_name(device), "dtype": str(dtype)}
    with ldm_sdpa():
        model = None
        for name, size in plan:
            if model is None or model[0] != name:
                model = None  # free the previous model before building the next
                model = (name, build_case(name, 64, dtype, a.batch, device=device).model)
            case = build_case(name, size, dtype, a.batch, model=model[1], device=device)
            rows += sweep_case(case, config, a.repeats, a.rounds, timer)
            write(a.out, rows, meta)  # after every case: a long run keeps what it measured
            bar.step(f"{name} {size}px")
    bar.close()
    summary = write(a.out, rows, meta)
    print(table(rows) + "\n\n" + report(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
