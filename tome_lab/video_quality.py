"""Does pooling pairs of frames too (2x2x2 cells) keep a video? A Wan-shaped transformer's
output, pooled per frame (2x2) or across pairs of frames (2x2x2), against the unpooled one.

    python -m tome_lab.video_quality                 # Wan 2.1 1.3B's width, 832x480x33
    python -m tome_lab.video_quality --quick         # tiny width and size (a test)

No trained video DiT ships here (nor may one be downloaded), so the model has random weights
(std 0.02) with its norms' weights at 1 as initialised (random norm weights would shrink the
normalised queries and keys to near zero: uniform attention, which no pooling changes), and the
input is made to look like a video's latent at a mid step: a smooth random field that moves one
latent pixel per frame, plus noise (``t``: its share). Queries and keys are then RMS-normed
projections of that content, so attention is sharp on similar content, which moves with the
field. What is measured is how far each pooled output is from the unpooled one, for the first
block's self-attention output (``attention``: pooling's own effect) and the model's output:

- PSNR per latent frame (peak: the unpooled output's range over the whole video);
- frame-to-frame difference: ``d_f = out[f + 1] - out[f]`` pooled against unpooled, as the
  relative error ``|d_pooled - d_unpooled| / |d_unpooled|`` (does the motion survive) and the
  ratio ``mean |d_pooled| / mean |d_unpooled|`` (above 1: flicker added; below: motion
  smoothed away).

With random weights the numbers compare the options with each other; they are not a
video's perceived quality. The speed of each option is ``dit_bench``'s (``x2``, ``x2 2x2x2``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .device import DEVICES, machine, pick_device, pick_dtype
from .dit_bench import patched
from .dit_shapes import Size, build, inputs
from .models import DTYPES

SETTINGS = {"x2": {"downsample_factor": 2}, "x2 2x2x2": {"downsample_factor": 2, "temporal": 2},
            "x4": {"downsample_factor": 4}, "x4 4x4x2": {"downsample_factor": 4, "temporal": 2}}


def moving_latent(model, size: Size, t: float, seed: int = 0) -> torch.Tensor:
    """``[1, C, F, H, W]``: a smooth field (random at 1/8 the resolution, upsampled) shifted by
    one latent pixel per frame to the right, mixed with noise: ``(1 - t) x + t noise``."""
    g = torch.Generator().manual_seed(seed)
    frames, h, w = size.grid()
    c = model.config.in_channels
    hh, ww = 2 * h, 2 * w + frames
    base = torch.randn(1, c, max(2, hh // 8), max(2, ww // 8), generator=g)
    field = F.interpolate(base, size=(hh, ww), mode="bicubic", align_corners=False)
    video = torch.stack([field[..., :, f:f + 2 * w] for f in range(frames)], 2)
    return (1 - t) * video + t * torch.randn(video.shape, generator=g)


def psnr(x: torch.Tensor, ref: torch.Tensor, peak: float) -> float:
    mse = float((x - ref).pow(2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(peak * peak / mse)


def compare(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """PSNR per frame and the frame-to-frame figures of ``out`` against ``ref``
    (``[1, C, F, H, W]``)."""
    out, ref = out.float(), ref.float()
    peak = float(ref.max() - ref.min())
    per_frame = [psnr(out[:, :, f], ref[:, :, f], peak) for f in range(ref.shape[2])]
    d_out, d_ref = out.diff(dim=2), ref.diff(dim=2)
    err = [float((d_out[:, :, f] - d_ref[:, :, f]).norm() / d_ref[:, :, f].norm())
           for f in range(d_ref.shape[2])]
    return {"psnr": psnr(out, ref, peak), "psnr_per_frame": per_frame,
            "psnr_min": min(per_frame), "motion_error": err,
            "motion_error_mean": sum(err) / len(err),
            "motion_ratio": float(d_out.abs().mean() / d_ref.abs().mean())}


def unit_norms(model) -> None:
    """Every norm's weight back to 1 and bias to 0 (their initialisation)."""
    with torch.no_grad():
        for name, m in model.named_modules():
            if "norm" in name.rsplit(".", 1)[-1]:
                if getattr(m, "weight", None) is not None:
                    m.weight.fill_(1)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()


def evaluate(model, size: Size, t: float, dtype: torch.dtype, quick: bool,
             settings: dict[str, dict[str, Any]] = SETTINGS, seed: int = 0
             ) -> list[dict[str, Any]]:
    """One row per setting: the model's output and the first block's self-attention output
    (as a video, ``[1, C, F, h, w]``) against the unpooled ones."""
    latents = moving_latent(model, size, t, seed)
    args = inputs(model, "wan", size, dtype, quick, seed=seed + 1, latents=latents, t=t)
    frames, h, w = size.grid()
    seen: list[torch.Tensor] = []
    hook = model.blocks[0].attn1.register_forward_hook(lambda m, a, out: seen.append(
        out.unflatten(1, (frames, h, w)).permute(0, 4, 1, 2, 3)))
    try:
        with torch.no_grad():
            ref = model(**args).sample
            ref_attn = seen.pop()
            rows = []
            for name, spec in settings.items():
                with patched(model, spec):
                    out = model(**args).sample
                rows.append({"setting": name, "output": compare(out, ref),
                             "attention": compare(seen.pop(), ref_attn)})
    finally:
        hook.remove()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| setting | of | PSNR (all) | PSNR per latent frame | worst frame | frame-to-frame "
             "difference error | motion kept (ratio) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for part in ("attention", "output"):
            m = r[part]
            frames = " ".join(f"{v:.1f}" for v in m["psnr_per_frame"])
            lines.append(f"| {r['setting']} | {part} | {m['psnr']:.1f} dB | {frames} | "
                         f"{m['psnr_min']:.1f} dB | {m['motion_error_mean']:.1%} | "
                         f"{m['motion_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_lab.video_quality",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="832x480x33", help="WxHxF")
    ap.add_argument("--blocks", type=int, default=4, help="Wan blocks")
    ap.add_argument("--t", default="0.3,0.7", help="noise shares of the input, comma-separated")
    ap.add_argument("--quick", action="store_true", help="tiny width and size (a test)")
    ap.add_argument("--device", choices=DEVICES, default="auto")
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="out/video_quality")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = Size.parse("128x96x9" if args.quick else args.size)
    device = pick_device(args.device)
    name, why = pick_dtype(device, args.dtype)
    from diffusers.utils import logging as diffusers_logging
    diffusers_logging.set_verbosity_error()
    print(f"video quality on {machine(device)}; {why}; Wan {args.blocks} blocks, "
          f"{size.label} ({size.tokens} tokens)", flush=True)
    model = build("wan", (args.blocks, 0), args.quick, DTYPES[name], device)
    unit_norms(model)
    results = {}
    text = []
    for t in (float(v) for v in args.t.split(",")):
        rows = evaluate(model, size, t, DTYPES[name], args.quick)
        results[str(t)] = rows
        text.append(f"noise share t={t:g}\n\n" + table(rows))
        print(text[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "video_quality.json").write_text(json.dumps(
        {"machine": machine(device), "dtype": name, "size": str(size.label),
         "blocks": args.blocks, "results": results}, indent=1))
    (out / "video_quality.md").write_text("\n\n".join(text) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
