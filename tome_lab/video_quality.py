"""Does key/value pooling keep a video? The tiny trained video DiT (``tome_lab/tinyvdit``: the
real diffusers ``WanTransformer3DModel``, 32 px x 9 frames) samples the same (class, seed)
videos unpooled and pooled (per frame x2, x4; time-axis cells 2x2x2, 4x4x2; residual reuse;
the presets), with and without guidance, at 20 and at 6 steps; each video against the
unpooled one of the same seed:

- PSNR and SSIM per frame (peak 1: pixels in [0, 1]);
- what users see in a video: the frame-to-frame difference ``d_f = v[f + 1] - v[f]`` pooled
  against unpooled, as its relative error ``|d_pooled - d_unpooled| / |d_unpooled|`` (is the
  motion kept) and the ratio ``mean |d_pooled| / mean |d_unpooled|`` (above 1: flicker
  added; below: motion smoothed away).

    python -m tome_lab.video_quality                 # the trained tiny video DiT (a few minutes)
    python -m tome_lab.video_quality --quick         # 1 seed, fewer settings (a test)
    python -m tome_lab.video_quality --synthetic     # the Wan 2.1 1.3B-wide random-weight check

A comparison row runs the same architecture with random weights (what every video figure here
was before the trained model). ``--synthetic``: a Wan-shaped transformer with random weights
(std 0.02) and its norms' weights at 1, fed a smooth random field that moves one latent pixel
per frame plus noise (``t``: its share), its first block's self-attention output and its
output compared per latent frame (the frame-to-frame figures as above). The time column is
the sampling thread's CPU time on this machine (a 0.6M-parameter model whose attention is a
small share: not a speed figure for a full-size Wan; ``dit_bench`` times those shapes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import tome

from . import quality
from .device import DEVICES, machine, pick_device, pick_dtype
from .dit_bench import patched
from .dit_shapes import Size, build, inputs
from .models import DTYPES

SETTINGS = {"x2": {"downsample_factor": 2}, "x2 2x2x2": {"downsample_factor": 2, "temporal": 2},
            "x4": {"downsample_factor": 4}, "x4 4x4x2": {"downsample_factor": 4, "temporal": 2}}

#: The trained model's rows: (label, ``apply_patch`` settings; None: unpooled, the reference).
#: Its frames are 8x8 tokens: x2 keeps 16 keys of 64 per frame, 2x2x2 8, x4 and 2x2x4 4.
TRAINED: tuple[tuple[str, dict[str, Any] | None], ...] = (
    ("unpooled", None),
    ("x2", {"downsample_factor": 2}),
    ("x2 2x2x2", {"downsample_factor": 2, "temporal": 2}),
    ("x2 2x2x4", {"downsample_factor": 2, "temporal": 4}),
    ("x4", {"downsample_factor": 4}),
    ("x4 4x4x2", {"downsample_factor": 4, "temporal": 2}),
    ("x4 reuse 5", {"downsample_factor": 4, "reuse": 5}),
    ("x2 2x2x4 reuse 5", {"downsample_factor": 2, "temporal": 4, "reuse": 5}),
    ("x4 4x4x2 reuse 5", {"downsample_factor": 4, "temporal": 2, "reuse": 5}),
    ("preset quality", {"config": tome.preset("quality", policy="fixed")}),
    ("preset fast", {"config": tome.preset("fast", policy="fixed")}),
    # diffusers' own step caches (``transformer.enable_cache``), alone and under x4 pooling;
    # MagCache needs magnitude ratios calibrated per model and scheduler: video_frontier
    # calibrates them and runs it
    ("FirstBlockCache 0.1", {"cache": ("FirstBlockCacheConfig", {"threshold": 0.1})}),
    ("FirstBlockCache 0.3", {"cache": ("FirstBlockCacheConfig", {"threshold": 0.3})}),
    # TaylorSeer's default module patterns (``^blocks.*attn``, full match) miss Wan's attn1
    # and attn2, so on Wan it hooks nothing unless told which modules
    ("TaylorSeer", {"cache": ("TaylorSeerCacheConfig", {
        "cache_interval": 3, "cache_identifiers": [r"^blocks\.\d+\.attn\d$"]})}),
    ("x4 + FirstBlockCache 0.1", {"downsample_factor": 4,
                                  "cache": ("FirstBlockCacheConfig", {"threshold": 0.1})}),
)
QUICK = ("unpooled", "x2", "x2 2x2x2", "x4")
RANDOM = ("unpooled", "x2", "x2 2x2x2", "x4")  # the random-weight comparison rows


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


# ----------------------------------------------------------------------------- the trained model

def compare_videos(out: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Videos ``out`` against ``ref`` (``[N, 3, F, H, W]`` in [0, 1]): PSNR and SSIM per frame
    (each the mean over the videos), the frame-to-frame difference's relative error (mean over
    videos and frame pairs) and its size against the reference's (motion kept)."""
    frames = ref.shape[2]
    p = [float(quality.psnr(out[:, :, f], ref[:, :, f]).mean()) for f in range(frames)]
    s = [float(quality.ssim(out[:, :, f], ref[:, :, f]).mean()) for f in range(frames)]
    d_out, d_ref = out.double().diff(dim=2), ref.double().diff(dim=2)
    err = ((d_out - d_ref).flatten(3).norm(dim=-1).div(d_ref.flatten(3).norm(dim=-1)
                                                         .clamp_min(1e-12)))
    return {"psnr_per_frame": p, "ssim_per_frame": s, "psnr": sum(p) / frames,
            "psnr_min": min(p), "ssim": sum(s) / frames, "motion_error": float(err.mean()),
            "motion_ratio": float(d_out.abs().mean() / d_ref.abs().mean())}


def sample_settings(model, settings, seeds, classes, steps: int, guidance: float,
                    progress=None) -> dict[str, tuple[torch.Tensor, float]]:
    """Each setting's videos of ``classes`` for every seed (``[len(seeds) * len(classes), 3,
    F, H, W]``) and its sampling thread's CPU seconds; settings interleaved per seed (the
    order reversed every other seed: nothing always runs first)."""
    from . import tinyvdit
    from .dit_quality import _pooled
    outs: dict[str, list[torch.Tensor]] = {name: [] for name, _ in settings}
    times = dict.fromkeys(outs, 0.0)
    for j, seed in enumerate(seeds):
        for name, spec in settings if j % 2 == 0 else settings[::-1]:
            if progress:
                progress(f"{steps} steps, cfg {guidance:g}, seed {seed}: {name}")
            spec = dict(spec) if spec is not None else None
            cache = spec.pop("cache", None) if spec else None
            with _pooled(model, spec or None), _cached(model.transformer, cache):
                t0 = time.thread_time()
                outs[name].append(tinyvdit.sample(model, classes, seed=seed, steps=steps,
                                                  guidance=guidance))
                times[name] += time.thread_time() - t0
    return {name: (torch.cat(outs[name]), times[name]) for name in outs}


@contextlib.contextmanager
def _cached(transformer, cache: tuple[str, dict[str, Any]] | None):
    """diffusers' cache ``cache`` (its config class's name and arguments) on ``transformer``
    for one sampling run (a fresh state each run), in one cache context (the guided batch is
    one call)."""
    if cache is None:
        yield
        return
    import diffusers
    transformer.enable_cache(getattr(diffusers, cache[0])(**cache[1]))
    try:
        with transformer.cache_context("video"):
            yield
    finally:
        transformer.disable_cache()


def trained_rows(model, settings, seeds, classes, steps: int, guidance: float,
                 progress=None, label: str = "") -> list[dict[str, Any]]:
    """One row per pooled setting: ``compare_videos`` against the first setting's videos,
    with its speed-up over the reference's CPU time."""
    got = sample_settings(model, settings, seeds, classes, steps, guidance, progress)
    ref, t_ref = got[settings[0][0]]
    return [{"setting": label + name, "reference": ref, "steps": steps, "guidance": guidance,
             "seconds": t, "speedup": t_ref / t, "videos": v, **compare_videos(v, ref)}
            for name, (v, t) in got.items() if name != settings[0][0]]


def trained_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| steps | cfg | setting | speed-up (CPU, tiny) | PSNR | worst frame | SSIM | "
             "frame-to-frame error | motion kept |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['steps']} | {r['guidance']:g} | {r['setting']} | "
                     f"{r['speedup']:.2f}x | {r['psnr']:.1f} dB | {r['psnr_min']:.1f} dB | "
                     f"{r['ssim']:.3f} | {r['motion_error']:.1%} | {r['motion_ratio']:.3f} |")
    return "\n".join(lines)


def per_frame_table(rows: list[dict[str, Any]]) -> str:
    frames = len(rows[0]["psnr_per_frame"])
    lines = ["| steps | cfg | setting | " + " | ".join(f"f{f}" for f in range(frames)) + " |",
             "|---" * (frames + 3) + "|"]
    for r in rows:
        lines.append(f"| {r['steps']} | {r['guidance']:g} | {r['setting']} | "
                     + " | ".join(f"{v:.1f}" for v in r["psnr_per_frame"]) + " |")
    return "\n".join(lines)


def strip(ref: torch.Tensor, rows: list[dict[str, Any]], video: int = 0, scale: int = 3):
    """One video's frames left to right, the reference's row first, then each setting's."""
    from PIL import Image, ImageDraw
    named = [("unpooled", ref[video])] + [(r["setting"], r["videos"][video]) for r in rows]
    frames, s = ref.shape[2], ref.shape[-1] * scale
    img = Image.new("RGB", (150 + frames * (s + 2), len(named) * (s + 2)), "white")
    draw = ImageDraw.Draw(img)
    for i, (name, v) in enumerate(named):
        draw.text((2, i * (s + 2) + s // 2 - 5), name, fill="black")
        tiles = (v.clamp(0, 1) * 255).round().byte().permute(1, 2, 3, 0).numpy()
        for f, tile in enumerate(tiles):
            img.paste(Image.fromarray(tile).resize((s, s), Image.NEAREST),
                      (150 + f * (s + 2), i * (s + 2)))
    return img


def _write(out: Path, rows: list[dict[str, Any]], seeds: list[int], classes: list[int]
           ) -> str:
    """``video_quality.md`` and ``.json`` in ``out`` from ``rows``; the text."""
    head = (f"Tiny video DiT (tome_lab/tinyvdit: WanTransformer3DModel, 32x32 px x 9 frames, "
            f"9 x 8 x 8 = 576 video tokens), {len(seeds)} seed(s) x {len(classes)} classes, "
            f"Euler steps, fp32, {torch.get_num_threads()} thread(s); each video against the "
            "unpooled one of the same seed; speed-up: the sampling thread's CPU time on this "
            "machine (attention is a small share of this tiny model: not a full-size Wan's "
            "speed).")
    text = head + "\n\n" + trained_table(rows) + "\n\nPSNR per frame (dB):\n\n" + \
        per_frame_table([r for r in rows if not r["setting"].startswith("random")])
    (out / "video_quality.md").write_text(text + "\n")
    (out / "video_quality.json").write_text(json.dumps(
        {"machine": machine(torch.device("cpu")), "seeds": seeds, "classes": classes,
         "rows": [{k: v for k, v in r.items() if k not in ("videos", "reference")}
                  for r in rows]}, indent=1))
    return text


def run_trained(args) -> int:
    from . import tinyvdit
    torch.set_num_threads(args.threads or 1)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"\r[{time.perf_counter() - t0:5.0f} s] {msg:<60}", end="", file=sys.stderr,
              flush=True)

    settings = tuple((n, s) for n, s in TRAINED if not args.quick or n in QUICK)
    seeds = [int(v) for v in args.seeds.split(",")][:1 if args.quick else None]
    classes = list(range(len(tinyvdit.CLASSES)))
    model = tinyvdit.load_model(args.weights)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps_list = [int(v) for v in args.steps.split(",")]
    rows: list[dict[str, Any]] = []
    for steps in steps_list:
        for g in [float(v) for v in args.guidance.split(",")]:
            got = trained_rows(model, settings, seeds, classes, steps, g, progress)
            rows += got
            strip(got[0]["reference"], got).save(out / f"video_strip_{steps}steps_cfg{g:g}.png")
            _write(out, rows, seeds, classes)  # each block as it comes: a run cut off keeps it
    torch.manual_seed(0)  # the comparison: the same architecture, random weights
    random = tinyvdit.build_model().eval().requires_grad_(False)
    rows += trained_rows(random, tuple((n, s) for n, s in TRAINED if n in RANDOM), seeds,
                         classes, max(steps_list), 1.0, progress, label="random weights: ")
    print(file=sys.stderr)
    print(_write(out, rows, seeds, classes))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_lab.video_quality",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="832x480x33", help="WxHxF")
    ap.add_argument("--blocks", type=int, default=4, help="Wan blocks")
    ap.add_argument("--t", default="0.3,0.7", help="noise shares of the input, comma-separated")
    ap.add_argument("--quick", action="store_true",
                    help="1 seed, 4 settings; --synthetic: tiny width and size (a test)")
    ap.add_argument("--device", choices=DEVICES, default="auto")
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="out/video_quality")
    ap.add_argument("--synthetic", action="store_true",
                    help="the Wan-shaped random-weight check (--size, --blocks, --t) instead")
    ap.add_argument("--weights", default=None, help="the tiny video DiT's (default: shipped)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", default="20,6", help="sampling steps, comma-separated")
    ap.add_argument("--guidance", default="1,3", help="guidance scales, comma-separated")
    args = ap.parse_args(argv)
    if not args.synthetic:
        return run_trained(args)
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
