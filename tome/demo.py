"""A one-minute look at ToMe on the real SD1.5 UNet (random weights, built from its config).

    python -m tome.demo [--size 512] [--ratio 0.5] [--dtype bf16] [--threads N]

Patches the model, prints which blocks were patched and how many tokens each level merged,
and times one forward pass against the unpatched model (interleaved, median of repeats).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import tome

SD15 = dict(image_size=64, in_channels=4, out_channels=4, model_channels=320,
            attention_resolutions=[4, 2, 1], num_res_blocks=2, channel_mult=[1, 2, 4, 4],
            num_heads=8, use_spatial_transformer=True, transformer_depth=1, context_dim=768,
            use_checkpoint=False, legacy=False)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512, help="image size in pixels (latent = /8)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from ldm.modules.diffusionmodules.openaimodel import UNetModel

    from .bench import ldm_sdpa

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    unet = UNetModel(**SD15).eval().to(dtype)
    g = torch.Generator().manual_seed(1)
    side = args.size // 8
    x = torch.randn(2, 4, side, side, generator=g).to(dtype)
    t = torch.tensor([500.0, 500.0])
    ctx = torch.randn(2, 77, 768, generator=g).to(dtype)

    def forward() -> float:
        start = time.perf_counter()
        unet(x, t, context=ctx)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"baseline": [], "tome": []}
    with torch.no_grad(), ldm_sdpa():
        tome.apply_patch(unet, ratio=args.ratio, seed=0)
        report = tome.patch_report(unet)
        forward()  # warm-up, also fills the per-level token counts
        tome.remove_patch(unet)
        forward()
        for _ in range(args.repeats):  # interleaved: baseline, tome, baseline, tome
            times["baseline"].append(forward())
            tome.apply_patch(unet, ratio=args.ratio, seed=0)
            times["tome"].append(forward())
            tome.remove_patch(unet)

    print(report.summary())
    print("\n| level | tokens | merged | remaining |\n|---|---|---|---|")
    for ds, (n, r) in sorted(report.tokens.items()):
        print(f"| ds{ds} ({side // ds}x{side // ds}) | {n} | {r} | {n - r} |")
    base, ours = (statistics.median(v) for v in times.values())
    print(f"\nSD1.5 UNet, {args.size}x{args.size}, batch 2, {args.dtype}, "
          f"{torch.get_num_threads()} thread(s), SDPA attention, median of {args.repeats}:")
    print(f"baseline {base:.2f} s, ToMe r={args.ratio:g} {ours:.2f} s: {base / ours:.2f}x")


if __name__ == "__main__":
    main()
