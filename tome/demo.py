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

    from .bench import build_case, ldm_sdpa

    case = build_case("sd15", args.size, args.dtype)
    unet, side = case.model, args.size // 8
    x, t, ctx = case.inputs["x"], case.inputs["t"], case.inputs["ctx"]

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
