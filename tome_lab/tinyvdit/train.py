"""Train the tiny video DiT on clips panned, zoomed and rotated over the tiny UNet's photos
(``clips``), on one CPU thread.

    OMP_NUM_THREADS=1 python -m tome_lab.tinyvdit.train --out out/tinyvdit_run

Phases ``frames:batch:minutes`` (5 frames first: fewer tokens, more steps; the rotary
positions carry over as the clip grows), AdamW with warm-up, gradient clipping, an EMA of the
weights (what is shipped, as float16 with the config and the command in its metadata; saved
at every evaluation, so a run cut off still leaves weights), 10% null-class labels for
guidance, and the held-out loss every ``--eval-every`` steps.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import sys
import time
from pathlib import Path

import torch

from ..tinydit.train import save
from ..tinyldm import data
from .clips import clips
from .model import FRAMES, NULL, SIZE, build_model, flow_loss, num_params

EVAL_N = 8
WEIGHTS = "tinyvdit32.safetensors"


def evaluate(model, videos, classes) -> float:
    """Mean flow loss at fixed times 0.05..0.95 and fixed noise (seed 0)."""
    g = torch.Generator().manual_seed(0)
    t = torch.linspace(0.05, 0.95, len(videos))
    with torch.no_grad():
        return float(flow_loss(model, videos * 2 - 1, classes, g, t=t))


def figures(out: Path, weights: Path, steps: int = 20) -> None:
    """``loss_curve.png`` from ``eval_log.csv`` and ``samples.png`` (one clip per class, its
    frames in a row, without and with guidance) from ``weights``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image, ImageDraw

    from .model import CLASSES, load_model, sample

    with open(out / "eval_log.csv") as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps_ = [int(r["step"]) for r in rows]
    for key, label in (("train_loss", "train batches (mean since last point)"),
                       ("heldout_loss", f"held-out clips, EMA, {FRAMES} frames"),
                       ("fixed_loss", f"fixed train clips, EMA, {FRAMES} frames")):
        ax.plot(steps_, [float(r[key]) for r in rows], "o-", ms=2, label=label)
    ax.set(yscale="log", xlabel="step", ylabel="flow-matching MSE",
           title="tiny video DiT: loss (5-frame clips, then 9)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png")
    plt.close(fig)
    model, ids, s = load_model(weights), list(range(len(CLASSES))), 96
    rows_ = [(c, g) for g in (1.0, 3.0) for c in ids]
    grid = Image.new("RGB", (FRAMES * (s + 2) + 2, len(rows_) * (s + 16)), "white")
    draw = ImageDraw.Draw(grid)
    videos = {g: (sample(model, ids, seed=0, steps=steps, guidance=g) * 255).round().byte()
              for g in (1.0, 3.0)}
    for r, (c, g) in enumerate(rows_):
        frames = videos[g][c].permute(1, 2, 3, 0).numpy()  # (F, H, W, 3)
        y = r * (s + 16)
        draw.text((4, y + 1), f"{CLASSES[c]}  cfg {g:g}  (frames left to right)", fill="black")
        for f, tile in enumerate(frames):
            grid.paste(Image.fromarray(tile).resize((s, s), Image.NEAREST),
                       (2 + f * (s + 2), y + 14))
    grid.save(out / "samples.png")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default=f"5:8:25,{FRAMES}:8:40", help="frames:batch:minutes,...")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--ema", type=float, default=0.99)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--figures", type=Path, default=None,
                    help="only write OUT/loss_curve.png and OUT/samples.png from these weights")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.figures is not None:
        figures(args.out, args.figures)
        return
    torch.set_num_interop_threads(1)
    torch.manual_seed(args.seed)  # initialisation only; data and noise use generators
    args.out.mkdir(parents=True, exist_ok=True)
    phases = [tuple(float(v) if i == 2 else int(v) for i, v in enumerate(p.split(":")))
              for p in args.phases.split(",")]
    photos = data.load_photos("train")
    held, held_c = clips(data.load_photos("heldout"), EVAL_N, SIZE, FRAMES,
                         torch.Generator().manual_seed(0))
    fixed, fixed_c = clips(photos, EVAL_N, SIZE, FRAMES, torch.Generator().manual_seed(1))
    model = build_model().train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    g_data, g_noise = (torch.Generator().manual_seed(args.seed + i) for i in (0, 1))
    meta = {"config": json.dumps(model.config), "seed": args.seed, "phases": args.phases,
            "command": "python -m tome_lab.tinyvdit.train "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "data_sources": data.sources(), "torch": torch.__version__}
    print(f"params {num_params(model) / 1e6:.2f}M, phases {phases}", flush=True)
    log = open(args.out / "eval_log.csv", "w", newline="")
    writer = csv.writer(log)
    writer.writerow(["step", "minutes", "frames", "train_loss", "heldout_loss", "fixed_loss"])
    step, start, running = 0, time.perf_counter(), []
    for frames, batch, minutes in phases:
        end = time.perf_counter() + 60 * minutes
        while time.perf_counter() < end:
            x, c = clips(photos, batch, SIZE, frames, g_data)
            drop = torch.rand(batch, generator=g_data) < 0.1
            c = torch.where(drop, torch.full_like(c, NULL), c)
            for group in opt.param_groups:
                group["lr"] = args.lr * min(1.0, (step + 1) / args.warmup)
            loss = flow_loss(model, x * 2 - 1, c, g_noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.lerp_(pm, 1 - args.ema)
            running.append(loss.item())
            step += 1
            if step % args.eval_every == 0:
                mins = (time.perf_counter() - start) / 60
                h, f = evaluate(ema, held, held_c), evaluate(ema, fixed, fixed_c)
                tr = sum(running) / len(running)
                running.clear()
                writer.writerow([step, f"{mins:.2f}", frames, f"{tr:.4f}", f"{h:.4f}",
                                 f"{f:.4f}"])
                log.flush()
                print(f"step {step} ({mins:.1f} min, {frames} frames): train {tr:.4f}, "
                      f"held-out {h:.4f}, fixed {f:.4f}", flush=True)
                save(ema, args.out / WEIGHTS, {**meta, "steps": step, "minutes": f"{mins:.1f}"})
    meta["steps"] = step
    meta["minutes"] = f"{(time.perf_counter() - start) / 60:.1f}"
    save(ema, args.out / WEIGHTS, meta)
    print(f"done: {step} steps, held-out {evaluate(ema, held, held_c):.4f}", flush=True)


if __name__ == "__main__":
    main()
