"""The DiT rows of the showcase: the tiny trained DiT (``tome_lab/tinydit``) unpooled against
image keys/values pooled: plain (no proportional attention), x2 and x4 with it, x2 with the
other RoPE option and in the second half of sampling only, and the presets' DiT points, on
the same seeds.

    python -m tome_lab.dit_quality      # also run by `make demo` (python -m tome_lab.showcase)

Every setting samples the same (class, seed) images with the same noise; the settings run
interleaved per image, timed on the sampling thread's CPU clock. PSNR/SSIM compare each image
with the unpooled one; the held-out loss (the flow-matching loss on crops of photos never
trained on, at flow times ``LOSS_TIMES``, fixed noise) says whether pooling makes the model a
worse denoiser, not only a different one. Writes ``dit_grid.png`` and ``dit_table.md`` into
the output folder.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tome

from . import quality, report

#: (label, apply_patch settings or None for the unpooled model); every setting is
#: ``method="downsample"``; ``config`` passes a whole ``ToMeConfig`` (the presets).
SETTINGS: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("unpooled", None),
    ("x2 plain pooling", {"downsample_factor": 2, "proportional": False}),
    # Proportional attention (the default): pooled keys count for their cells.
    ("x2", {"downsample_factor": 2}),
    ("x2 rope before", {"downsample_factor": 2, "rope": "before"}),
    ("x4", {"downsample_factor": 4}),
    ("x2 steps 0.5-1", {"downsample_factor": 2, "start": 0.5}),
    # The presets' DiT points: x8 everywhere with residual reuse (docs/quality.md#dit).
    ("preset quality", {"config": tome.preset("quality", policy="fixed")}),
    ("preset fast", {"config": tome.preset("fast", policy="fixed")}),
)


def _reuses(spec: dict[str, Any] | None) -> bool:
    """Residual reuse needs a sampling trajectory: a loss at one flow time would be the
    refresh call's, i.e. the unpooled model's (``dit_frontier`` measures it along the
    schedule)."""
    return bool(spec) and bool(spec.get("reuse") or getattr(spec.get("config"), "reuse", 0))


#: Flow times of the held-out loss (1 = pure noise, 0 = clean).
LOSS_TIMES = (0.1, 0.5, 0.9)


def heldout_loss(model, heldout: tuple[torch.Tensor, torch.Tensor]) -> dict[float, float]:
    """The flow-matching loss on ``heldout`` (images in [0, 1], classes) at each of
    ``LOSS_TIMES``, the same noise (seed 0) for every setting."""
    from .tinydit.model import flow_loss
    x, c = heldout
    out = {}
    with torch.no_grad():
        for t in LOSS_TIMES:
            g = torch.Generator().manual_seed(0)
            out[t] = float(flow_loss(model, x * 2 - 1, c, g, t=torch.full((len(c),), t)))
    return out


@contextlib.contextmanager
def _pooled(model, spec: dict[str, Any] | None):
    """``model`` pooled with ``spec`` for the duration (None: as it is); ``keep``
    (``attend.Keep``): what residual reuse keeps, whatever memory says (a ladder step)."""
    if spec is not None:
        spec = dict(spec)
        keep = spec.pop("keep", None)
        tome.apply_patch(model, **{"method": "downsample", **spec})
        if keep is not None:
            tome.patch_handle(model).fix_keep(keep)
    try:
        yield
    finally:
        tome.remove_patch(model)


def held(model) -> int:
    """Bytes residual reuse holds on ``model`` now (0 without a patch or reuse)."""
    found = tome.patch_handle(model)
    return found.held_bytes() if found is not None else 0


def evaluate(model, images: list[tuple[int, int]], steps: int, size: int,
             progress=None, heldout: tuple[torch.Tensor, torch.Tensor] | None = None,
             settings=None) -> list[dict[str, Any]]:
    """One row per setting in ``settings`` (default ``SETTINGS``; the first is the reference),
    in the showcase's row format (with ``loss_increase`` per flow time where ``heldout`` is
    given)."""
    from . import tinydit
    SETTINGS = tuple(settings or globals()["SETTINGS"])  # noqa: N806
    outs: dict[str, list[torch.Tensor]] = {name: [] for name, _ in SETTINGS}
    times: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
    kept: dict[str, int] = {}  # what residual reuse held at the end of sampling, at most
    for j, (cls, seed) in enumerate(images):
        order = SETTINGS if j % 2 == 0 else SETTINGS[::-1]  # nothing always runs first
        for name, spec in order:
            if progress:
                progress(f"tiny DiT: image {j + 1}/{len(images)}, {name}")
            with _pooled(model, spec):
                t0 = time.thread_time()
                img = tinydit.sample(model, [cls], seed=seed, steps=steps, size=size)
                times[name].append(time.thread_time() - t0)
                kept[name] = max(kept.get(name, 0), held(model))
            outs[name].append(img[0])
    losses: dict[str, dict[float, float]] = {}
    for name, spec in SETTINGS if heldout is not None else ():
        if _reuses(spec):
            continue
        if progress:
            progress(f"tiny DiT: held-out loss, {name}")
        with _pooled(model, spec):
            losses[name] = heldout_loss(model, heldout)
    base = SETTINGS[0][0]
    ref = torch.stack(outs[base])
    t_ref = statistics.median(times[base])
    rows = []
    for name, spec in SETTINGS:
        imgs = torch.stack(outs[name])
        p = [float(quality.psnr(a[None], b[None])) for a, b in zip(imgs, ref)]
        s = [float(quality.ssim(a[None], b[None])) for a, b in zip(imgs, ref)]
        t = statistics.median(times[name])
        rows.append({"setting": name, "unmerged": spec is None, "images": imgs,
                     "jobs": images, "speedup": t_ref / t, "time": t,
                     "mse": float(quality.mse(imgs, ref).mean()),
                     "psnr": statistics.mean(p) if spec is not None else float("inf"),
                     "ssim": statistics.mean(s) if spec is not None else 1.0,
                     "held": kept.get(name, 0),
                     "per_image": {"time": times[name], "psnr": p, "ssim": s}})
        if name in losses:
            rows[-1]["loss"] = losses[name]
            rows[-1]["loss_increase"] = {t: losses[name][t] / losses[base][t] - 1
                                         for t in LOSS_TIMES}
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    loss = "loss_increase" in rows[0]
    head = "| setting | time per image | speed-up | PSNR (dB) | SSIM |" + "".join(
        f" loss Δ t={t:g} |" for t in LOSS_TIMES if loss)
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        psnr = "reference" if r["unmerged"] else f"{r['psnr']:.1f}"
        ssim = "" if r["unmerged"] else f"{r['ssim']:.3f}"
        lines.append(f"| {r['setting']} | {r['time']:.2f} s | {r['speedup']:.2f}x | {psnr} | "
                     f"{ssim} |" + "".join(f" {r['loss_increase'][t]:+.1%} |"
                                           if "loss_increase" in r else " n/a (reuse) |"
                                           for t in LOSS_TIMES if loss))
    return "\n".join(lines)


def run(out: Path, steps: int = 20, size: int = 64, seeds=(0,), classes=(0, 1, 2, 3),
        weights: str | None = None, diff: float = 25,
        heldout: tuple[torch.Tensor, torch.Tensor] | None = None) -> str:
    """Sample, write ``dit_grid.png`` and ``dit_table.md`` into ``out``; the table text.
    ``heldout``: (images in [0, 1] at ``size``, classes) for the loss columns, or None."""
    from . import tinydit
    model = tinydit.load_model(weights)
    images = [(c, s + k) for s in seeds for k, c in enumerate(classes)]
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"\r[{time.perf_counter() - t0:5.0f} s] {msg:<60}", end="", file=sys.stderr,
              flush=True)

    rows = evaluate(model, images, steps, size, progress, heldout)
    print(file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    labels = [f"{tinydit.CLASSES[c]}, seed {s}" for c, s in images]
    report.grid_image(rows, row_labels=labels, diff_gain=diff).save(out / "dit_grid.png")
    grid = (size // 2) ** 2
    text = (f"Tiny DiT (Flux architecture, {size}x{size} px, {grid} image tokens), {steps} Euler "
            f"steps, {len(images)} image(s), fp32, {torch.get_num_threads()} thread(s); time: "
            "median CPU seconds of the sampling thread per image, settings interleaved; PSNR/SSIM "
            "against the unpooled image of the same seed" + (
                f"; loss Δ: relative increase of the flow-matching loss on {len(heldout[1])} "
                "held-out photo crops at flow time t (1 = pure noise), the same noise for every "
                "setting" if heldout is not None else "") + ".\n\n" + table(rows))
    (out / "dit_table.md").write_text(text + "\n")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tome_lab.dit_quality",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/showcase")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", default="0")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--weights", default=None)
    p.add_argument("--heldout", type=int, default=8,
                   help="held-out photo crops for the loss columns (0: skip; default 8)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    heldout = None
    if a.heldout > 0:
        heldout, why = quality.heldout_batch(a.heldout, 64)
        if heldout is None:
            print(f"held-out loss skipped: {why}", file=sys.stderr)
    print(run(Path(a.out), a.steps, seeds=[int(s) for s in a.seeds.split(",")],
              weights=a.weights, heldout=heldout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
