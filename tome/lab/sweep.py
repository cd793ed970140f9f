"""Does the measured auto policy decide right? Measured decisions against whole UNet calls.

    python -m tome.lab.sweep                 # SD1.5 and SDXL shapes, several sizes (CPU: long)
    python -m tome.lab.sweep --models sd15 --sizes 256,512 --repeats 3 --threads 1

For each model and size: ``tome.measure.measure`` times every candidate level (one block per
level, as the auto policy does at a generation's first call); then whole UNet calls are timed,
interleaved: unmerged, each level merged alone, and the auto policy with what it measured. A
level's decision *agrees* when "measured at least 1 + MARGIN faster" matches "the UNet call
merged at that level alone was faster than unmerged"; a disagreement *costs* when the decision
was wrong by more than ``NOISE`` of the UNet call (where a level's effect on the whole call is
within the timing noise, either decision costs nothing). Also reported: where auto merged, its
UNet call against unmerged (never more than 2% slower is the goal), and what measuring cost as
a share of a 20-step generation at that size (20 UNet calls of this batch).

Random-weight UNets from their configs, fp32 on a CPU (bf16 where native), fp16 on a GPU;
ldm attention through SDPA (the WebUI's default). Writes ``out/sweep/sweep.json`` and a
Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

from tome import patch as _patch
from tome import policy
from tome.config import ToMeConfig
from tome.measure import measure
from tome.unet import find_unet, known_levels

from .device import device_name, pick_device, pick_dtype
from .models import build_case, ldm_sdpa
from .run import Progress
from .timing import Timer

DEFAULT_SIZES = {"sd15": (256, 384, 512, 768), "sdxl": (512, 768, 1024)}
GENERATION_STEPS = 20
NOISE = 0.01


def _forced(levels: dict[int, bool]):
    """A measurer that says exactly which levels pay: how one level alone is merged."""
    return lambda size, batch, device: {lv: (2.0 if on else 0.5, "forced")
                                        for lv, on in levels.items()}


def sweep_case(case: Any, config: ToMeConfig, repeats: int, rounds: int,
               timer: Timer) -> list[dict[str, Any]]:
    """Rows of one (model, size): one per candidate level, plus the auto policy's."""
    unet = find_unet(case.model)
    top = config.max_downsample or max(known_levels(unet))
    levels = [lv for lv in known_levels(unet) if lv <= top]
    latent = (case.size // 8, case.size // 8)
    t0 = time.perf_counter()
    m = measure(unet, latent, case.batch, config, rounds=rounds, levels=levels)
    measure_s = time.perf_counter() - t0
    measured = {r.level: r for r in m.rows}
    settings: dict[str, Any] = {"unmerged": None}
    for lv in levels:
        settings[f"ds{lv}"] = _forced({x: x == lv for x in levels})
    settings["auto"] = _forced({r.level: policy.pays(r.speedup) for r in m.rows})
    times: dict[str, list[float]] = {k: [] for k in settings}
    names = list(settings)
    for i in range(repeats + 1):  # the first round warms up
        for name in names if i % 2 == 0 else names[::-1]:
            if settings[name] is not None:
                _patch.apply(unet, config.replace(policy="auto"), settings[name])
            try:
                seconds, _ = timer(case.forward)
            finally:
                _patch.remove(unet)
            if i:
                times[name].append(seconds)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["unmerged"]
    rows = []
    for lv in levels:
        r = measured[lv]
        actual = base / med[f"ds{lv}"]
        rows.append({"model": case.model_name, "size": case.size, "level": lv,
                     "tokens": r.tokens, "measured": r.speedup,
                     "decision": policy.pays(r.speedup), "actual": actual,
                     "agrees": policy.pays(r.speedup) == (actual > 1.0),
                     "costs": (actual < 1 - NOISE) if policy.pays(r.speedup)
                     else (actual > 1 + NOISE)})
    auto_levels = [lv for lv in levels if policy.pays(measured[lv].speedup)]
    rows.append({"model": case.model_name, "size": case.size, "level": "auto",
                 "merged": auto_levels, "auto": base / med["auto"],
                 "unmerged_s": base, "measure_s": measure_s,
                 "overhead": measure_s / (GENERATION_STEPS * base)})
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    levels = [r for r in rows if r["level"] != "auto"]
    autos = [r for r in rows if r["level"] == "auto"]
    merged = [r for r in autos if r["merged"]]
    return {
        "agreement": sum(r["agrees"] for r in levels) / max(1, len(levels)),
        "costly": sum(r["costs"] for r in levels),
        "cases": len(levels),
        "auto_worst_where_merged": min((r["auto"] for r in merged), default=None),
        "overhead_max": max((r["overhead"] for r in autos), default=None),
    }


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| model | size | level | tokens | measured | decision | UNet call merged | agrees |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["level"] == "auto":
            merged = ", ".join(f"ds{lv}" for lv in r["merged"]) or "nothing"
            out.append(f"| {r['model']} | {r['size']} | auto | | | {merged} | {r['auto']:.2f}x "
                       f"| measuring {r['measure_s']:.1f} s = {100 * r['overhead']:.1f}% of "
                       f"{GENERATION_STEPS} steps |")
        else:
            out.append(f"| {r['model']} | {r['size']} | ds{r['level']} | {r['tokens']} | "
                       f"{r['measured']:.2f}x | {'merge' if r['decision'] else 'no'} | "
                       f"{r['actual']:.2f}x | {'yes' if r['agrees'] else 'no'}"
                       f"{' (costs)' if r['costs'] else ''} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome.lab.sweep", description=__doc__.split(
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
    a = ap.parse_args(argv)
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
    os.makedirs(a.out, exist_ok=True)

    def save() -> dict[str, Any]:  # after every case: a long run keeps what it measured
        summary = summarise(rows)
        with open(os.path.join(a.out, "sweep.json"), "w") as f:
            json.dump({"args": vars(a), "device": device_name(device), "dtype": dtype,
                       "rows": rows, "summary": summary}, f, indent=1)
        return summary

    with ldm_sdpa():
        model = None
        for name, size in plan:
            if model is None or model[0] != name:
                model = None  # free the previous model before building the next
                model = (name, build_case(name, 64, dtype, a.batch, device=device).model)
            case = build_case(name, size, dtype, a.batch, model=model[1], device=device)
            rows += sweep_case(case, config, a.repeats, a.rounds, timer)
            save()
            bar.step(f"{name} {size}px")
    bar.close()
    summary = save()
    text = table(rows)
    with open(os.path.join(a.out, "sweep.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    worst = summary["auto_worst_where_merged"]
    print(f"\nagreement {100 * summary['agreement']:.0f}% of {summary['cases']} (model, size, "
          f"level) cases; wrong by more than {100 * NOISE:g}% of the UNet call: "
          f"{summary['costly']}")
    print(f"auto where it merged: worst {worst:.2f}x of unmerged" if worst is not None
          else "auto merged nothing")
    print(f"measuring cost at most {100 * summary['overhead_max']:.1f}% of a "
          f"{GENERATION_STEPS}-step generation")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
