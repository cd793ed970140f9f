"""Train the tiny diffusion model on one CPU thread.

    OMP_NUM_THREADS=1 python -m tome_lab.tinyldm.train --out out/tinyldm --seed 0 --minutes 60

Training is progressive: first 32x32 crops (the top level then has 1024 tokens, so
attention costs 16x less), then 64x64 crops at the same pixel density; the UNet is
resolution-agnostic, and the last phase adapts its 4096-token attention.

The machine is shared, so step speed varies. A phase without a step count
(``--phases 32:16,64:8``) runs until its share of ``--minutes`` (``--split``) is used;
the step counts actually run are saved as ``phases`` in the weights' metadata. Everything
random comes from the seed (init, crops, noise, timesteps, class dropout) and the learning
rate is constant after warm-up, so passing that ``phases`` string back repeats the run.
Checkpoints (EMA weights) are written every ``--ckpt-minutes``.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import data
from .model import build_model, denoising_loss, num_params

EVAL_N = 32


def parse_phases(text: str) -> list[tuple[int, int, int | None]]:
    """'32:16:3000,64:8' -> [(size, batch, steps or None = until its time share), ...]."""
    phases = []
    for p in text.split(","):
        v = [int(x) for x in p.split(":")]
        phases.append((v[0], v[1], v[2] if len(v) > 2 else None))
    return phases


def lr_at(step: int, base: float, warmup: int) -> float:
    """Linear warm-up, then constant: independent of run length, so capped runs repeat."""
    return base * min(1.0, (step + 1) / warmup)


def save_weights(model, path: Path, meta: dict) -> None:
    """EMA weights as fp16 safetensors (loaded back into fp32 by ``load_model``)."""
    from safetensors.torch import save_file

    state = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={k: str(v) for k, v in meta.items()})
    os.replace(tmp, path)


def plot(out: Path, phase_starts: list[int]) -> None:
    """loss_curve.png from the two CSV logs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(out / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    with open(out / "eval_log.csv") as f:
        evals = list(csv.DictReader(f))
    steps = [int(r["step"]) for r in rows]
    loss = [float(r["loss"]) for r in rows]
    smooth, s = [], loss[0] if loss else 0.0
    for v in loss:
        s = 0.98 * s + 0.02 * v
        smooth.append(s)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(steps, loss, color="tab:blue", alpha=0.15, lw=0.5)
    ax.plot(steps, smooth, color="tab:blue", label="train loss (batch, smoothed)")
    if evals:
        es = [int(r["step"]) for r in evals]
        ax.plot(
            es,
            [float(r["heldout"]) for r in evals],
            "o-",
            color="tab:red",
            ms=3,
            label="held-out photos, EMA, 64 px",
        )
        ax.plot(
            es,
            [float(r["train_fixed"]) for r in evals],
            "o-",
            color="tab:green",
            ms=3,
            label="fixed train crops, EMA, 64 px",
        )
    for p in phase_starts[1:]:
        ax.axvline(p, color="gray", ls="--", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("MSE of the v prediction")
    ax.set_title("tiny ldm: denoising loss (dashed: 32 px -> 64 px)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png")
    plt.close(fig)


def save_grid(weights: Path, path: Path, steps: int = 25, seed: int = 0, guidance=(1.0, 2.0)):
    """2 samples per class, one row per CFG scale, into a labelled PNG (3x upscaled)."""
    from PIL import Image, ImageDraw

    from .model import load_model, sample

    model = load_model(weights)
    classes = model.config["classes"]
    ids = [c for c in range(len(classes)) for _ in range(2)]
    s, pad, label = 64 * 3, 4, 14
    row_h = s + label + pad
    grid = Image.new("RGB", (len(ids) * (s + pad) + pad, len(guidance) * row_h), "white")
    draw = ImageDraw.Draw(grid)
    for r, g in enumerate(guidance):
        imgs = sample(model, ids, seed=seed, steps=steps, guidance=g)
        tiles = (imgs * 255).round().byte().permute(0, 2, 3, 1).numpy()
        for i, tile in enumerate(tiles):
            x, y = pad + i * (s + pad), r * row_h
            grid.paste(Image.fromarray(tile).resize((s, s), Image.NEAREST), (x, y + label))
            draw.text((x + 2, y + 1), f"{classes[ids[i]]}  cfg {g:g}", fill="black")
    grid.save(path)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=60.0, help="wall-clock cap")
    ap.add_argument("--phases", default="32:16,64:8", help="size:batch[:steps],...")
    ap.add_argument(
        "--split",
        type=float,
        default=0.5,
        help="time share of the first phase, for phases without steps",
    )
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--ema", type=float, default=0.996)
    ap.add_argument("--cond-drop", type=float, default=0.1, help="null-class rate (for CFG)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    ap.add_argument("--cache", type=Path, default=None, help="photo cache directory")
    ap.add_argument(
        "--grid",
        type=Path,
        default=None,
        help="only write OUT/samples.png from these weights (no training)",
    )
    args = ap.parse_args(argv)
    if args.grid is not None:
        torch.set_num_threads(1)
        args.out.mkdir(parents=True, exist_ok=True)
        save_grid(args.grid, args.out / "samples.png", seed=args.seed)
        return

    torch.set_num_threads(1)  # other work shares this machine: keep to one core
    torch.set_num_interop_threads(1)
    torch.manual_seed(args.seed)  # model init only; everything else uses generators
    out = args.out
    out.mkdir(parents=True, exist_ok=True)

    phases = parse_phases(args.phases)
    bf16 = not args.fp32
    dtype = torch.bfloat16 if bf16 else None
    train_photos = data.load_photos("train", args.cache)
    heldout = data.heldout_batch(EVAL_N, 64, seed=0, cache_dir=args.cache)
    fixed = data.random_crops(train_photos, EVAL_N, 64, torch.Generator().manual_seed(1))
    eval_t = torch.linspace(20, 980, EVAL_N).long()

    model = build_model().train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    g_data = torch.Generator().manual_seed(args.seed)
    g_noise = torch.Generator().manual_seed(args.seed + 1)
    print(f"params {num_params(model) / 1e6:.2f}M, phases {phases}, bf16={bf16}", flush=True)

    meta = {
        "config": json.dumps(model.config),
        "seed": args.seed,
        "lr": args.lr,
        "ema": args.ema,
        "data_sources": data.sources(),
        "command": "python -m tome_lab.tinyldm.train "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "dtype": "float16",
    }

    def evaluate(step: int, elapsed: float) -> tuple[float, float]:
        with torch.no_grad():
            h = denoising_loss(ema, *heldout, eval_t, 0, dtype=dtype).item()
            f = denoising_loss(ema, *fixed, eval_t, 0, dtype=dtype).item()
        with open(out / "eval_log.csv", "a", newline="") as fh:
            csv.writer(fh).writerow([step, f"{elapsed:.1f}", f"{h:.5f}", f"{f:.5f}"])
        print(f"eval step {step}: held-out {h:.4f} train-fixed {f:.4f}", flush=True)
        return h, f

    for name, header in (
        ("train_log.csv", "step,size,elapsed_s,lr,loss"),
        ("eval_log.csv", "step,elapsed_s,heldout,train_fixed"),
    ):
        (out / name).write_text(header + "\n")

    start = last_ckpt = time.time()
    step, phase_starts, done, stopped_early = 0, [], [], False
    log = open(out / "train_log.csv", "a", newline="")
    for i, (size, batch, n) in enumerate(phases):
        phase_starts.append(step)
        share = args.split if i == 0 else 1.0  # cumulative share of --minutes
        deadline = start + args.minutes * 60 * (share if n is None else 1.0)
        for _ in range(n if n is not None else 10**9):
            if time.time() > deadline:
                stopped_early = n is not None  # hit the --minutes cap
                break
            lr = lr_at(step, args.lr, args.warmup)
            for group in opt.param_groups:
                group["lr"] = lr
            x, y = data.random_crops(train_photos, batch, size, g_data)
            drop = torch.rand(batch, generator=g_noise) < args.cond_drop
            y = torch.where(drop, torch.full_like(y, model.null_class), y)
            t = torch.randint(0, len(model.alphas_cumprod), (batch,), generator=g_noise)
            loss = denoising_loss(model, x, y, t, g_noise, dtype=dtype)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            decay = min(args.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.lerp_(pm, 1 - decay)
            step += 1
            elapsed = time.time() - start
            csv.writer(log).writerow(
                [step, size, f"{elapsed:.1f}", f"{lr:.3e}", f"{loss.item():.5f}"]
            )
            if step % 50 == 0:
                log.flush()
                print(
                    f"step {step} size {size} loss {loss.item():.4f} "
                    f"lr {lr:.2e} {elapsed / 60:.1f} min",
                    flush=True,
                )
            if step % args.eval_every == 0:
                evaluate(step, elapsed)
            if time.time() - last_ckpt > args.ckpt_minutes * 60:
                ckpt_meta = {
                    **meta,
                    "steps": step,
                    "phases": ",".join(done + [f"{size}:{batch}:{step - phase_starts[-1]}"]),
                }
                save_weights(ema, out / "checkpoint_ema.safetensors", ckpt_meta)
                log.flush()
                plot(out, phase_starts)
                last_ckpt = time.time()
        done.append(f"{size}:{batch}:{step - phase_starts[-1]}")
        if stopped_early:
            break
    log.close()
    elapsed = time.time() - start
    held, fixed_loss = evaluate(step, elapsed)
    meta.update(
        steps=step,
        phases=",".join(done),
        stopped_early=stopped_early,
        wall_minutes=f"{elapsed / 60:.1f}",
        heldout_loss=f"{held:.5f}",
        train_fixed_loss=f"{fixed_loss:.5f}",
    )
    save_weights(ema, out / "tiny64.safetensors", meta)
    plot(out, phase_starts)
    (out / "summary.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"done: {step} steps in {elapsed / 60:.1f} min, held-out loss {held:.4f}", flush=True)


if __name__ == "__main__":
    main()
