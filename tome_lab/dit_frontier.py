"""The DiT frontier: image fidelity and held-out loss against speed-up on the shipped tiny DiT,
one line per approach (plain pooling, proportional attention, step/block schedules, residual
reuse), and the presets' points on it.

    python -m tome_lab.dit_frontier            # ~8 min on one thread; writes out/dit-frontier/
    python -m tome_lab.dit_frontier --ladder   # only the quality preset's memory ladder (~4 min)

8 images (classes 0-3, seeds 0 and 4), 20 Euler steps, 64 px, fp32, one thread, every setting
on the same seeds and noise, interleaved per image (``dit_quality.evaluate``); PSNR against
the unpooled image of the same seed. The held-out loss here follows the sampling schedule:
the flow-matching loss on 8 held-out photo crops at each of the 20 steps' flow times, called
in order with the same noise, so windows and residual reuse act as they do when sampling
(``trajectory_loss``); its mean over the steps, relative to the unpooled model's.

Residual reuse's memory: each row says what reuse held on the tiny DiT (``reuse keeps``), the
``ladder`` rows run the quality preset with each step of ``budget.ladder`` (what the memory
budget keeps where everything does not fit, forced whatever the memory) and the preset's point
without reuse; ``memory_table`` gives, by the estimator alone (``budget.reuse_bytes``; no
such model runs on a CPU), what the presets keep on released models at full depth and size
(Flux-dev at 1024 and 2048 px, Qwen-Image at 1328 px, Wan at 480p and 720p x 81 frames) and
which ladder step the budget lands on with a 24 and an 80 GiB card's free memory.
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
from tome import budget, memory
from tome.config import without_reuse

from . import dit_quality, quality, report
from .dit_shapes import Size

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
#: The memory ladder on the quality preset: each step ``budget.ladder`` can take (float32:
#: the tiny DiT's), then the preset's point without reuse.
LADDER = "ladder (quality)"


def ladder_settings() -> list[tuple[str, dict[str, Any]]]:
    config = tome.preset("quality", policy="fixed")
    rows = [(f"{LADDER}: keeps {keep.words()}", {"config": config, "keep": keep})
            for keep in budget.ladder(torch.float32, "cpu")]
    return rows + [(f"{LADDER}: no reuse ({without_reuse(config).schedule})",
                    {"config": without_reuse(config)})]
#: The grid's columns (labels as in the table).
GRID = ("unpooled", "plain pooling: x2", "proportional: x2", "preset quality", "preset fast")


def settings(ladder_only: bool = False) -> list[tuple[str, dict[str, Any] | None]]:
    out: list[tuple[str, dict[str, Any] | None]] = [("unpooled", None)]
    if not ladder_only:
        out += [(f"{a}: {label}", spec) for a, rows in APPROACHES.items()
                for label, spec in rows]
        out += [(f"preset {p}", {"config": tome.preset(p, policy="fixed")}) for p in PRESETS]
    return out + ladder_settings()


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


def run(out: Path, steps: int = 20, seeds=(0, 4), heldout=None, progress=None,
        ladder_only: bool = False) -> list[dict[str, Any]]:
    from . import tinydit
    model = tinydit.load_model()
    images = [(c, s + k) for s in seeds for k, c in enumerate((0, 1, 2, 3))]
    specs = settings(ladder_only)
    rows = dit_quality.evaluate(model, images, steps, 64, progress, None, settings=specs)
    if heldout is not None:
        losses = {}
        for name, spec in specs:
            with dit_quality._pooled(model, spec):
                losses[name] = trajectory_loss(model, heldout, steps)
        for r in rows:
            r["loss_increase"] = losses[r["setting"]] / losses["unpooled"] - 1
    out.mkdir(parents=True, exist_ok=True)
    keep = ("setting", "speedup", "time", "psnr", "ssim", "loss_increase", "held")
    (out / "frontier.json").write_text(json.dumps(
        [{k: r[k] for k in keep if k in r} for r in rows], indent=1, default=str))
    (out / "frontier.md").write_text(table(rows) + "\n\n" + memory_table() + "\n")
    if ladder_only:
        return rows
    plot(rows, out / "frontier.png")
    labels = [f"{tinydit.CLASSES[c]}, seed {s}" for c, s in images]
    grid = [r for name in GRID for r in rows if r["setting"] == name]
    report.grid_image(grid, row_labels=labels, diff_gain=25).save(out / "grid.png")
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    loss = "loss_increase" in rows[0]
    lines = ["| approach: setting | time per image | speed-up | PSNR (dB) | SSIM | reuse keeps |"
             + (" held-out loss Δ |" if loss else ""),
             "|---|---|---|---|---|---|" + ("---|" if loss else "")]
    for r in rows:
        psnr = "reference" if r["unmerged"] else f"{r['psnr']:.1f}"
        ssim = "" if r["unmerged"] else f"{r['ssim']:.3f}"
        kept = memory.amount(r["held"]) if r.get("held") else ""
        lines.append(f"| {r['setting']} | {r['time']:.2f} s | {r['speedup']:.2f}x | {psnr} | "
                     f"{ssim} | {kept} |" + (f" {r['loss_increase']:+.1%} |" if loss else ""))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- memory

#: Released models at full depth as the estimator sees them (bf16): pooled blocks (the
#: presets pool all), attention width, text rows in the pooled attention (joint attention;
#: Wan's self-attention has none), parameters in billions (the weights a card holds).
MODELS: dict[str, dict[str, Any]] = {
    "Flux-dev": dict(blocks=57, width=3072, text=512, params=11.9),
    "Qwen-Image": dict(blocks=60, width=3072, text=128, params=20.4),
    "Wan 2.1 1.3B": dict(blocks=30, width=1536, text=0, params=1.4),
    "Wan 14B (2.1; 2.2 A14B per expert)": dict(blocks=40, width=5120, text=0, params=14.3),
}
#: (model, size as ``dit_shapes.Size`` parses it, calls per step: 2 with true CFG).
SHAPES: tuple[tuple[str, str, int], ...] = (
    ("Flux-dev", "1024", 1), ("Flux-dev", "1024", 2), ("Flux-dev", "2048", 1),
    ("Qwen-Image", "1328", 2), ("Wan 2.1 1.3B", "832x480x81", 2),
    ("Wan 14B (2.1; 2.2 A14B per expert)", "832x480x81", 2),
    ("Wan 14B (2.1; 2.2 A14B per expert)", "1280x720x81", 2))
CARDS = (24, 80)  # GiB
RUNTIME = 1 << 30  # what a card holds besides the transformer (CUDA context, buffers)


def card_free(card_gib: int, params_b: float) -> tuple[int, str]:
    """Free memory while sampling on a card: less the transformer's weights in bf16, or in
    8 bits where bf16 leaves under a quarter of the card (the usual fp8 checkpoint), and
    ``RUNTIME``; text encoders and VAE offloaded. With the weights' words."""
    card = card_gib << 30
    weights = int(params_b * 1e9 * 2)
    words = "bf16 weights"
    if card - weights < card // 4:
        weights, words = int(params_b * 1e9), "fp8 weights"
    return card - weights - RUNTIME, words


def estimate(name: str, size: str, calls: int) -> dict[str, Any]:
    """What the quality and fast presets keep (x8 in all blocks, one factor: the same bytes)
    on a released model, per ladder step, and the step the budget lands on per card."""
    m, s = MODELS[name], Size.parse(size)
    tokens = s.tokens
    parts = [budget.Part(i, tokens + m["text"], tokens, m["width"]) for i in range(m["blocks"])]
    dtype = torch.bfloat16
    steps = {k: budget.reuse_bytes(parts, calls, dtype, k) for k in budget.ladder(dtype)}
    reserve = memory.ACTIVATION_COPIES * (tokens + m["text"]) * m["width"] * 2
    cards = {}
    for card in CARDS:
        free, words = card_free(card, m["params"])
        keep, need = budget.fit(parts, calls, dtype, free, reserve)
        cards[card] = (keep, need, free, words)
    return {"model": name, "size": s.label, "calls": calls, "tokens": tokens,
            "steps": steps, "cards": cards}


def memory_table() -> str:
    """The presets' reuse memory on released models (the estimator alone) and where the
    budget lands on a 24 and an 80 GiB card."""
    rows = [estimate(*shape) for shape in SHAPES]
    ladder = budget.ladder(torch.bfloat16)
    head = ["model", "size", "calls/step", "image tokens"] + [k.words() for k in ladder] + [
        f"{c} GiB card" for c in CARDS]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r["model"], str(r["size"]), str(r["calls"]), str(r["tokens"])]
        cells += [memory.amount(r["steps"][k]) for k in ladder]
        for card in CARDS:
            keep, need, free, words = r["cards"][card]
            what = (f"keeps {keep.words()} ({memory.amount(need)})" if keep.blocks != 0
                    else "no reuse")
            cells.append(f"{what}; {memory.amount(max(free, 0))} free ({words})")
        lines.append("| " + " | ".join(cells) + " |")
    return ("Residual reuse's memory on released models (the estimator, `budget.reuse_bytes`, "
            "bf16; quality and fast keep the same: x8 in all blocks, one factor; calls/step 2: "
            "true CFG), per ladder step, and the step the budget lands on per card (free: the "
            "card less the transformer's weights and 1 GiB; the forward's activations "
            "reserved):\n\n" + "\n".join(lines))


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
    p = argparse.ArgumentParser(prog="python -m tome_lab.dit_frontier",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/dit-frontier")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", default="0,4")
    p.add_argument("--heldout", type=int, default=8, help="held-out crops (0: no loss)")
    p.add_argument("--ladder", action="store_true",
                   help="only the quality preset's memory ladder (and the memory table)")
    p.add_argument("--memory", action="store_true",
                   help="only the memory table (the estimator; nothing runs)")
    a = p.parse_args(argv)
    if a.memory:
        print(memory_table())
        return 0
    torch.set_num_threads(1)
    heldout = None
    if a.heldout > 0:
        heldout, why = quality.heldout_batch(a.heldout, 64)
        if heldout is None:
            print(f"held-out loss skipped: {why}", file=sys.stderr)

    if a.ladder:
        heldout = None
    print(f"dit_frontier: {len(settings(a.ladder))} settings, "
          f"{4 * len(a.seeds.split(','))} images, {a.steps} steps, one thread -> {a.out}",
          file=sys.stderr, flush=True)
    rows = run(Path(a.out), a.steps, [int(s) for s in a.seeds.split(",")], heldout,
               ladder_only=a.ladder)
    print(table(rows))
    print()
    print(memory_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
