"""The video frontier on the trained tiny video DiT (``tome_lab/tinyvdit``): per-frame pooling
(x2, x4), time-axis cells, residual reuse, the presets, and diffusers' step caches
(FirstBlockCache, MagCache, TaylorSeer) alone and stacked with pooling, at 20 and at 6 steps,
with and without CFG: speed-up against PSNR, SSIM and flicker of each video against the
unpatched model's (the same seeds and classes).

    python -m tome_lab.video_frontier                       # writes out/video-frontier/
    python -m tome_lab.video_frontier --runs 6g1 --seeds 0  # a quick look

Speed: the sampling thread's CPU time of each (seed, 4 classes) batch, configurations
interleaved (the order reversed every other seed), the median over seeds of each
configuration's time against the unpatched one's of the same seed. Each sampling is one
generation (``tome.generation``: reuse paced to the step count, the caches' state reset) in
the cache's context. MagCache needs the model's magnitude ratios: diffusers' calibration mode
(``MagCacheConfig(calibrate=True)``) run here on this model at each step count and guidance,
classes 0-3 on seeds 100-103 (not the measured videos), averaged (``calibrate``).
TaylorSeer gets Wan's attention modules named (diffusers' default patterns match none of them).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tome

from . import stack_frontier, tinyvdit
from .device import machine
from .video_quality import compare_videos

#: The runs: name -> (steps, guidance).
RUNS = {"20g1": (20, 1.0), "20g3": (20, 3.0), "6g1": (6, 1.0), "6g3": (6, 3.0)}
#: Pooling points (``apply_patch`` settings; policy fixed, rope before as the presets).
POOLING: dict[str, dict[str, Any]] = {
    "x2": {"downsample_factor": 2},
    "x4": {"downsample_factor": 4},
    "x2 2x2x2": {"downsample_factor": 2, "temporal": 2},
    "x2 2x2x4": {"downsample_factor": 2, "temporal": 4},
    "x4 reuse 5": {"downsample_factor": 4, "reuse": 5, "paced": True},
    "x2 2x2x4 reuse 5": {"downsample_factor": 2, "temporal": 4, "reuse": 5, "paced": True},
    "x2 2x2x2 reuse 5": {"downsample_factor": 2, "temporal": 2, "reuse": 5, "paced": True},
    "preset quality": {"preset": "quality"},
    "preset fast": {"preset": "fast"},
    "preset quality 2 frames": {"preset": "quality", "temporal": 2},
    "preset fast 2 frames": {"preset": "fast", "temporal": 2},
}
#: The caches per step count (thresholds bracketing the ones the issue's first table ran).
CACHES = {20: ("FBC 0.1", "FBC 0.3", "Mag 0.1", "Mag 0.3", "TS 3"),
          6: ("FBC 0.3", "FBC 0.5", "Mag 0.1", "Mag 0.3", "TS 2")}
#: The pooling points each cache is stacked with.
STACKED = ("x2 2x2x4 reuse 5", "x2 2x2x4")
WAN_ATTENTION = [r"^blocks\.\d+\.attn\d$"]  # TaylorSeer's modules on Wan (attn1, attn2)


def cache_config(name: str, steps: int, ratios: list[float] | None = None) -> Any:
    """The diffusers cache config a name stands for, on Wan: MagCache with the model's
    calibrated ``ratios``, TaylorSeer on Wan's attention modules after at most 3 steps."""
    return stack_frontier.cache_config(name, steps, ratios, WAN_ATTENTION, min(3, steps // 3))


def configurations(steps: int, only: set[str] | None = None) -> list[dict[str, Any]]:
    """``none``, each pooling point, each cache alone and stacked with ``STACKED`` (``only``:
    those named, ``none`` always)."""
    out: list[dict[str, Any]] = [{"name": "none"}]
    out += [{"name": p, "tome": p} for p in POOLING]
    for c in CACHES[steps]:
        out.append({"name": c, "cache": c})
        out += [{"name": f"{c} + {p}", "cache": c, "tome": p} for p in STACKED]
    return [s for s in out if only is None or s["name"] in only | {"none"}]


@contextlib.contextmanager
def applied(model, spec: dict[str, Any], steps: int, ratios: list[float] | None):
    """``model`` with ``spec``'s cache and pooling for one sampling (a fresh cache state)."""
    tr = model.transformer
    if spec.get("cache"):
        tr.enable_cache(cache_config(spec["cache"], steps, ratios))
    point = POOLING.get(spec.get("tome", ""))
    if point is not None:
        if "preset" in point:
            over = {k: v for k, v in point.items() if k != "preset"}
            tome.apply_patch(model, config=tome.preset(point["preset"], policy="fixed", **over))
        else:
            tome.apply_patch(model, method="downsample", policy="fixed", rope="before",
                             **point)
    try:
        context = tr.cache_context("video") if spec.get("cache") else contextlib.nullcontext()
        with tome.generation(model, steps), context:
            yield
    finally:
        if point is not None:
            tome.remove_patch(model)
        if spec.get("cache"):
            tr.disable_cache()


def calibrate(model, steps: int, guidance: float, seeds=(100, 101, 102, 103)) -> list[float]:
    """MagCache's magnitude ratios of ``model`` at ``steps`` and ``guidance``: diffusers'
    calibration mode (it skips nothing and prints the ratios at the last step), one sampling
    of classes 0-3 per seed, averaged over the seeds."""
    import diffusers
    got = []
    for seed in seeds:
        tr = model.transformer
        tr.enable_cache(diffusers.MagCacheConfig(calibrate=True, num_inference_steps=steps))
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), tr.cache_context("calibrate"):
                tinyvdit.sample(model, [0, 1, 2, 3], seed=seed, steps=steps, guidance=guidance)
        finally:
            tr.disable_cache()
        lines = [ln for ln in printed.getvalue().splitlines() if ln.startswith("[")]
        got.append(ast.literal_eval(lines[-1]))
    return [sum(v) / len(v) for v in zip(*got)]


def run(name: str, seeds: list[int], progress=None, only: set[str] | None = None,
        calibration: tuple[int, ...] = (100, 101, 102, 103)) -> dict[str, Any]:
    """One run (``RUNS[name]``): every configuration on every seed's 4 classes, interleaved;
    a row per configuration (the unpatched one first)."""
    steps, guidance = RUNS[name]
    model = tinyvdit.load_model()
    ratios = calibrate(model, steps, guidance, calibration) if any(
        "Mag" in s.get("cache", "") for s in configurations(steps, only)) else None
    specs = configurations(steps, only)
    videos: dict[str, list[torch.Tensor]] = {s["name"]: [] for s in specs}
    times: dict[str, list[float]] = {s["name"]: [] for s in specs}
    classes = list(range(len(tinyvdit.CLASSES)))
    for j, seed in enumerate(seeds):
        for s in specs if j % 2 == 0 else specs[::-1]:
            if progress:
                progress(f"{name} seed {seed}: {s['name']}")
            with applied(model, s, steps, ratios):
                t0 = time.thread_time()
                videos[s["name"]].append(tinyvdit.sample(model, classes, seed=seed,
                                                         steps=steps, guidance=guidance))
                times[s["name"]].append(time.thread_time() - t0)
    ref = torch.cat(videos["none"])
    rows = []
    for s in specs:
        got = torch.cat(videos[s["name"]])
        ratios_s = [a / b for a, b in zip(times["none"], times[s["name"]])]
        row = {"run": name, "steps": steps, "guidance": guidance, "setting": s["name"],
               "seconds": statistics.median(times[s["name"]]),
               "speedup": statistics.median(ratios_s),
               "speedup_range": [min(ratios_s), max(ratios_s)],
               "identical": bool(torch.equal(got, ref))}
        if s["name"] != "none":
            row.update(compare_videos(got, ref))
        rows.append(row)
    return {"run": name, "mag_ratios": ratios, "rows": rows}


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| run | setting | speed-up (CPU) | range | PSNR | worst frame | SSIM | "
             "frame-to-frame error | motion kept |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for row in r["rows"]:
            if row["setting"] == "none":
                continue
            lo, hi = row["speedup_range"]
            q = ("identical | – | 1.000 | 0% | 1.000" if row["identical"] else
                 f"{row['psnr']:.1f} dB | {row['psnr_min']:.1f} dB | {row['ssim']:.3f} | "
                 f"{row['motion_error']:.0%} | {row['motion_ratio']:.2f}")
            lines.append(f"| {r['run']} | {row['setting']} | {row['speedup']:.2f}x | "
                         f"{lo:.2f}-{hi:.2f} | {q} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """PSNR against speed-up, one panel per run; pooling, caches and stacks apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4.4), squeeze=False)
    for ax, r in zip(axes[0], runs):
        for row in r["rows"]:
            if row["setting"] == "none":
                continue
            kind = ("stack" if "+" in row["setting"] else
                    "cache" if row["setting"].split()[0] in ("FBC", "Mag", "TS") else "pool")
            psnr = 60.0 if row["identical"] else min(row["psnr"], 60.0)
            ax.scatter(row["speedup"], psnr, s=22, marker={"pool": "o", "cache": "s",
                                                           "stack": "^"}[kind],
                       color={"pool": "C0", "cache": "C1", "stack": "C2"}[kind])
            ax.annotate(row["setting"], (row["speedup"], psnr), fontsize=6,
                        xytext=(3, 2), textcoords="offset points")
        ax.set_title(f"{r['run']}: {RUNS[r['run']][0]} steps, cfg {RUNS[r['run']][1]:g}")
        ax.set_xlabel("speed-up (thread CPU time, tiny model)")
        ax.set_ylabel("PSNR vs unpatched (dB; identical at 60)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(handles=[plt.Line2D([], [], marker=m, color=c, ls="", label=lab)
                               for m, c, lab in (("o", "C0", "pooling"), ("s", "C1", "cache"),
                                                 ("^", "C2", "cache + pooling"))],
                      fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_lab.video_frontier",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="20g1,6g1,20g3,6g3")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="out/video-frontier")
    ap.add_argument("--only", default=None, help="these configurations (comma-separated)")
    ap.add_argument("--calibration-seeds", default="100,101,102,103",
                    help="MagCache's calibration samplings (not the measured seeds)")
    ap.add_argument("--combine", default=None,
                    help="runs from these video_frontier.json files (comma-separated) into one "
                         "table and plot in --out, nothing sampled")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.combine:
        runs = [r for f in args.combine.split(",")
                for r in json.loads(Path(f).read_text())["runs"]]
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "video_frontier.md").write_text(table(runs) + "\n")
        plot(runs, out / "video_frontier.png")
        print(table(runs))
        return 0
    from diffusers.utils import logging as diffusers_logging
    diffusers_logging.set_verbosity_error()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(v) for v in args.seeds.split(",")]
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)

    runs = []
    for name in args.runs.split(","):
        runs.append(run(name, seeds, progress,
                        set(args.only.split(",")) if args.only else None,
                        tuple(int(v) for v in args.calibration_seeds.split(","))))
        text = (f"Tiny video DiT, {len(seeds)} seed(s) x 4 classes, {args.threads} thread(s), "
                f"{machine(torch.device('cpu'))}\n\n" + table(runs))
        (out / "video_frontier.md").write_text(text + "\n")
        (out / "video_frontier.json").write_text(json.dumps(
            {"machine": machine(torch.device("cpu")), "seeds": seeds, "runs": runs}, indent=1))
        plot(runs, out / "video_frontier.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
