"""DiT speed: Flux- and SD3-shaped transformers, unpooled against pooled image keys/values.

    python -m tome.lab.dit_bench                       # Flux and SD3 at 512, 1024, 2048 px
    python -m tome.lab.dit_bench --quick               # tiny configs, one round (a smoke test)

The models are diffusers' ``FluxTransformer2DModel`` (FLUX.1-dev's widths: 24 heads x 128,
T5 width 4096, RoPE axes 16/56/56) and ``SD3Transformer2DModel`` (SD3.5-medium's: 24 heads x
64, qk RMS norm, dual attention in its first blocks) built from their configs with random
weights and only a few blocks of each kind (``--double``, ``--single``): the block is what
pooling changes, and a few of them show its cost. Text length as the pipelines use it (Flux
512 T5 tokens, SD3 333 = 77 CLIP + 256 T5). Batch 1, one forward per timing, the variants
interleaved round-robin in one run; each figure is the median of ``--rounds``.

Variants: ``none`` (unpatched), ``x2`` and ``x4`` (``tome.apply_patch(model,
method="downsample", downsample_factor=f)``; Flux also ``x2 before``, the other RoPE
option), and ``ceiling``: every image key and value pooled into one (the factor covers the
whole grid), i.e. attention over the text alone: the most any key/value reduction can save.
``image attention share`` is (none - ceiling) / none: the share of the forward spent on
attending to image keys. ``auto`` is what the auto policy decides at the size, measured on
this machine with this model (one round, a throw-away cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import tome
from tome.measurements import MeasurementCache, Measurer

from .device import machine, pick_dtype

FLUX = dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
            joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
SD3 = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
           num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
           pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm")
TINY_FLUX = dict(FLUX, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
TINY_SD3 = dict(SD3, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=64)
TEXT = {"flux": 512, "sd3": 333}


def build(family: str, double: int, single: int, quick: bool, dtype: torch.dtype):
    """The transformer with random weights (std 0.02: activations stay finite)."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    g = torch.Generator().manual_seed(0)
    if family == "flux":
        model = FluxTransformer2DModel(**(TINY_FLUX if quick else FLUX), num_layers=double,
                                       num_single_layers=single)
    else:
        model = SD3Transformer2DModel(**(TINY_SD3 if quick else SD3), num_layers=double,
                                      dual_attention_layers=tuple(range(double)))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval() if dtype == torch.float32 else model.eval().to(dtype)


def inputs(model, family: str, px: int, dtype: torch.dtype, quick: bool) -> dict[str, Any]:
    """One call's arguments at ``px`` (latent px/8; Flux packs 2x2, SD3 patches 2x2)."""
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    text = 8 if quick else TEXT[family]
    lat = px // 8
    ctx = torch.randn(1, text, cfg.joint_attention_dim, generator=g).to(dtype)
    pooled = torch.randn(1, cfg.pooled_projection_dim, generator=g).to(dtype)
    if family == "flux":
        h = w = lat // 2
        ids = torch.zeros(h * w, 3)
        ids[:, 1] = torch.arange(h).repeat_interleave(w)
        ids[:, 2] = torch.arange(w).repeat(h)
        return dict(hidden_states=torch.randn(1, h * w, cfg.in_channels, generator=g).to(dtype),
                    encoder_hidden_states=ctx, pooled_projections=pooled,
                    timestep=torch.tensor([0.5]), img_ids=ids, txt_ids=torch.zeros(text, 3),
                    guidance=torch.tensor([3.5]) if cfg.guidance_embeds else None)
    return dict(hidden_states=torch.randn(1, cfg.in_channels, lat, lat, generator=g).to(dtype),
                encoder_hidden_states=ctx, pooled_projections=pooled,
                timestep=torch.tensor([500.0]))


def variants(family: str) -> dict[str, dict[str, Any] | None]:
    """Name -> ``apply_patch`` settings (None: unpatched; the ceiling is patched apart)."""
    out: dict[str, dict[str, Any] | None] = {"none": None, "x2": {"downsample_factor": 2},
                                             "x4": {"downsample_factor": 4}}
    if family == "flux":
        out["x2 before"] = {"downsample_factor": 2, "rope": "before"}
    out["ceiling"] = None
    return out


def _ceiling(model, px: int) -> None:
    """Pool the whole grid into one key: patch with a factor of the grid's side. The config
    caps the factor at 8, so larger grids use the adapter's plan directly."""
    from tome import processors
    tome.apply_patch(model, method="downsample", downsample_factor=8)
    state = vars(model)[processors.STATE_ATTR]
    grid = px // 16
    orig = state.planner.plan

    def plan(call, x, decoder=False):
        p = orig(call, x, decoder)
        if p is not None:
            p.factor = grid
            state.planner.tokens[state.layout.dit.patch] = (p.h * p.w, p.h * p.w - 1)
        return p
    state.planner.plan = plan


def run_size(model, family: str, px: int, rounds: int, dtype: torch.dtype, quick: bool,
             say) -> dict[str, Any]:
    args = inputs(model, family, px, dtype, quick)
    specs = variants(family)
    names = list(specs)
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        # round 0 warms up (not at the large sizes: a smaller size has warmed the kernels, and
        # one forward there takes minutes on a CPU)
        for r in range(0 if px < 2048 else 1, rounds + 1):
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                if name == "ceiling":
                    _ceiling(model, px)
                elif specs[name] is not None:
                    tome.apply_patch(model, method="downsample", **specs[name])
                t0 = time.perf_counter()
                out = model(**args).sample
                took = time.perf_counter() - t0
                tome.remove_patch(model)
                if not torch.isfinite(out).all():
                    raise RuntimeError(f"{family} {px} px {name}: non-finite output")
                if r:
                    times[name].append(took)
            say(f"  {family} {px} px round {r}/{rounds}: "
                + ", ".join(f"{n} {times[n][-1] * 1e3:.0f} ms" for n in names if times[n])
                if r else f"  {family} {px} px: warmed up")
    med = {n: statistics.median(v) for n, v in times.items()}
    tokens = (px // 16) ** 2
    row = {"family": family, "px": px, "image_tokens": tokens, "rounds": rounds,
           "ms": {n: med[n] * 1e3 for n in names},
           "speedup": {n: med["none"] / med[n] for n in names},
           "image_attention_share": (med["none"] - med["ceiling"]) / med["none"]}
    return row


def auto_decision(model, family: str, px: int, dtype: torch.dtype, quick: bool) -> str:
    """What the auto policy decides at ``px`` on this machine (one measuring round)."""
    with tempfile.TemporaryDirectory() as tmp:
        lines: list[str] = []
        service = Measurer(MeasurementCache(Path(tmp) / "m.json", say=lines.append),
                           say=lines.append, rounds=1, warmup=0)
        tome.apply_patch(model, method="downsample", policy="auto", measure=service)
        try:
            with torch.no_grad():
                model(**inputs(model, family, px, dtype, quick))
            decisions = list(tome.patch_report(model).decisions.values())
        finally:
            tome.remove_patch(model)
    return "; ".join(d.reason for d in decisions) or "; ".join(lines)


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | px | image tokens | none ms | x2 | x4 | x2 before | ceiling | "
             "image attention share | auto |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r["speedup"]
        lines.append(
            f"| {r['family']} | {r['px']} | {r['image_tokens']} | {r['ms']['none']:.0f} | "
            f"{s['x2']:.2f}x | {s['x4']:.2f}x | "
            + (f"{s['x2 before']:.2f}x" if "x2 before" in s else "-")
            + f" | {s['ceiling']:.2f}x | {r['image_attention_share'] * 100:.0f}% | "
            f"{r.get('auto', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="flux,sd3")
    ap.add_argument("--sizes", default="512,1024,2048", help="px, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rounds-large", type=int, default=1, help="rounds at 2048 px and above")
    ap.add_argument("--double", type=int, default=1, help="double-stream (joint) blocks")
    ap.add_argument("--single", type=int, default=1, help="single-stream blocks (Flux)")
    ap.add_argument("--no-auto", action="store_true", help="skip the auto policy's decisions")
    ap.add_argument("--quick", action="store_true", help="tiny widths, 256 px, one round")
    ap.add_argument("--dtype", default="auto", help="fp32, bf16 (auto: bf16 where native)")
    ap.add_argument("--out", default="out/dit_bench")
    args = ap.parse_args(argv)
    sizes = [256] if args.quick else [int(s) for s in args.sizes.split(",")]
    rounds = 1 if args.quick else args.rounds
    name, why = pick_dtype("cpu", args.dtype)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]

    def say(msg: str) -> None:
        print(msg, flush=True)

    from diffusers.utils import logging as diffusers_logging
    diffusers_logging.set_verbosity_error()  # its dtype advice is not for random-weight models
    say(f"DiT bench on {machine('cpu')}; {why}")
    rows = []
    for family in args.models.split(","):
        model = build(family, args.double, args.single, args.quick, dtype)
        say(f"{family}: {args.double} double + {args.single if family == 'flux' else 0} single "
            f"block(s), {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
        for px in sizes:
            row = run_size(model, family, px, args.rounds_large if px >= 2048 else rounds,
                           dtype, args.quick, say)
            if not args.no_auto:
                row["auto"] = auto_decision(model, family, px, dtype, args.quick)
            rows.append(row)
            say(f"{family} {px} px: " + ", ".join(f"{n} {v:.2f}x"
                                                   for n, v in row["speedup"].items())
                + f"; image attention {row['image_attention_share'] * 100:.0f}%"
                + (f"; auto: {row['auto']}" if "auto" in row else ""))
        del model
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dit_bench.json").write_text(json.dumps({"machine": machine("cpu"), "dtype": name,
                                                    "rows": rows}, indent=1))
    text = table(rows)
    (out / "dit_bench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
