"""The DiT frontier: image fidelity and held-out loss against speed-up on the shipped tiny DiT,
one line per approach (plain pooling, proportional attention, step/block schedules, residual
reuse), and the presets' points on it.

    python -m tome.lab.dit_frontier            # ~8 min on one thread; writes out/dit-frontier/

8 images (classes 0-3, seeds 0 and 4), 20 Euler steps, 64 px, fp32, one thread, every setting
on the same seeds and noise, interleaved per image (``dit_quality.evaluate``); PSNR against
the unpooled image of the same seed. The held-out loss here follows the sampling schedule:
the flow-matching loss on 8 held-out photo crops at each of the 20 steps' flow times, called
in order with the same noise, so windows and residual reuse act as they do when sampling
(``trajectory_loss``); its mean over the steps, relative to the unpooled model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

import tome

from . import dit_quality, quality, report

#: approach -> [(label, apply_patch settings)]; every setting is ``method="downsample"``.
APPROACHES: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "plain pooling": [("x2", {"downsample_factor": 2, "proportional": False}),
                      ("x4", {"downsample_factor": 4, "proportional": False})],
    "proportional": [("x2", {"downsample_factor": 2}), ("x4", {"downsample_factor": 4})],
    "schedule (proportional)": [("single:2@0.3-1", {"schedule": "single:2@0.3-1"}),
                                ("all:2@0.5-1", {"schedule": "all:2@0.5-1"}),
                                ("inner:2", {"schedule": "inner:2"}),
                                ("all:2@0.3-1", {"schedule": "all:2@0.3-1"})],
    "reuse x4 (proportional)": [(f"x4 reuse {n}", {"downsample_factor": 4, "reuse": n})
                                for n in (3, 5, 10)],
    "reuse x8 (proportional)": [(f"x8 reuse {n}", {"downsample_factor": 8, "reuse": n})
                                for n in (3, 5, 10, 20)],
}
PRESETS = ("quality", "fast")
#: The grid's columns (labels as in the table).
GRID = ("unpooled", "plain pooling: x2", "proportional: x2", "preset quality", "preset fast")


def settings() -> list[tuple[str, dict[str, Any] | None]]:
    out: list[tuple[str, dict[str, Any] | None]] = [("unpooled", None)]
    out += [(f"{a}: {label}", spec) for a, rows in APPROACHES.items() for label, spec in rows]
    out += [(f"preset {p}", {"config": tome.preset(p, policy="fixed")}) for p in PRESETS]
    return out


def trajectory_loss(model, heldout: tuple[torch.Tensor, torch.Tensor], steps: int) -> float:
    """Mean flow-matching loss of ``heldout`` over the sampling schedule's flow times, the
    model called at each in order (as a sampler would), the same noise (seed 0)."""
    from .tinydit.model import schedule
    x, c = heldout
    x0 = x * 2 - 1
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    losses = []
    with torch.no_grad():
        for t in schedule(steps)[:-1].tolist():
            xt = (1 - t) * x0 + t * noise
            v = model(xt, torch.full((len(c),), t), c)
            losses.append(float(((v - (noise - x0)) ** 2).mean()))
    return statistics.mean(losses)


def run(out: Path, steps: int = 20, seeds=(0, 4), heldout=None, progress=None
        ) -> list[dict[str, Any]]:
    from . import tinydit
    model = tinydit.load_model()
    images = [(c, s + k) for s in seeds for k, c in enumerate((0, 1, 2, 3))]
    specs = settings()
    rows = dit_quality.evaluate(model, images, steps, 64, progress, None, settings=specs)
    if heldout is not None:
        losses = {}
        for name, spec in specs:
            with dit_quality._pooled(model, spec):
                losses[name] = trajectory_loss(model, heldout, steps)
        for r in rows:
            r["loss_increase"] = losses[r["setting"]] / losses["unpooled"] - 1
    out.mkdir(parents=True, exist_ok=True)
    keep = ("setting", "speedup", "time", "psnr", "ssim", "loss_increase")
    (out / "frontier.json").write_text(json.dumps(
        [{k: r[k] for k in keep if k in r} for r in rows], indent=1, default=str))
    (out / "frontier.md").write_text(table(rows) + "\n")
    plot(rows, out / "frontier.png")
    labels = [f"{tinydit.CLASSES[c]}, seed {s}" for c, s in images]
    grid = [r for name in GRID for r in rows if r["setting"] == name]
    report.grid_image(grid, row_labels=labels, diff_gain=25).save(out / "grid.png")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    loss = "loss_increase" in rows[0]
    lines = ["| approach: setting | time per image | speed-up | PSNR (dB) | SSIM |"
             + (" held-out loss Δ |" if loss else ""),
             "|---|---|---|---|---|" + ("---|" if loss else "")]
    for r in rows:
        psnr = "reference" if r["unmerged"] else f"{r['psnr']:.1f}"
        ssim = "" if r["unmerged"] else f"{r['ssim']:.3f}"
        lines.append(f"| {r['setting']} | {r['time']:.2f} s | {r['speedup']:.2f}x | {psnr} | "
                     f"{ssim} |" + (f" {r['loss_increase']:+.1%} |" if loss else ""))
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """PSNR and held-out loss increase against speed-up: a line per approach, presets marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = "loss_increase" in rows[0]
    fig, axes = plt.subplots(1, 2 if loss else 1, figsize=(12 if loss else 6.5, 4.8),
                             squeeze=False)
    for ax, key, label in ((axes[0][0], "psnr", "PSNR against unpooled (dB)"),
                           (axes[0][-1], "loss_increase", "held-out loss increase")):
        if key == "loss_increase" and not loss:
            continue
        for a in APPROACHES:
            pts = sorted((r["speedup"], r[key]) for r in rows if r["setting"].startswith(a + ":"))
            ax.plot(*zip(*pts), "o-", label=a)
        for r in rows:
            if r["setting"].startswith("preset"):
                ax.plot(r["speedup"], r[key], "k*", markersize=13)
                ax.annotate(r["setting"], (r["speedup"], r[key]), textcoords="offset points",
                            xytext=(6, 6))
        ax.set_xlabel("speed-up (median CPU time per image, one thread)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].axhline(30, color="grey", lw=0.6, ls="--")
    axes[0][0].axhline(25, color="grey", lw=0.6, ls=":")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("tiny DiT (Flux blocks, 1024 image tokens): pooled image keys/values")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tome.lab.dit_frontier",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/dit-frontier")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", default="0,4")
    p.add_argument("--heldout", type=int, default=8, help="held-out crops (0: no loss)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    heldout = None
    if a.heldout > 0:
        heldout, why = quality.heldout_batch(a.heldout, 64)
        if heldout is None:
            print(f"held-out loss skipped: {why}", file=sys.stderr)

    print(f"dit_frontier: {len(settings())} settings, {4 * len(a.seeds.split(','))} images, "
          f"{a.steps} steps, one thread -> {a.out}", file=sys.stderr, flush=True)
    rows = run(Path(a.out), a.steps, [int(s) for s in a.seeds.split(",")], heldout)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
