"""A one-minute look at ToMe on the real SD1.5 UNet (random weights, built from its config).

    python -m tome_lab.speed_demo [--size 512] [--ratio 0.5] [--device auto] [--dtype auto]

Patches the model, prints which blocks were patched and how many tokens each level merged,
and times one forward pass against the unpatched model (interleaved, median of repeats).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import tome
from tome.config import ToMeConfig

from .device import DEVICES, device_name, pick_device, pick_dtype
from .models import DTYPES, build_case, ldm_sdpa
from .timing import Timer


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tome_lab.speed_demo",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=512, help="image size in pixels (latent = /8)")
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--device", choices=DEVICES, default="auto")
    ap.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                    help="auto: fp16 on GPUs; on CPUs bf16 where native, else fp32")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="0: PyTorch's default")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        device = pick_device(args.device)
        dtype, why = pick_dtype(device, args.dtype)
    except ValueError as e:
        ap.error(str(e))
    print(why, file=sys.stderr)

    case = build_case("sd15", args.size, dtype, device=device)
    unet, side = case.model, args.size // 8
    timer = Timer(device)
    config = ToMeConfig(ratio=args.ratio, seed=0)

    def forward() -> float:
        return timer(case.forward)[0]

    times: dict[str, list[float]] = {"baseline": [], "tome": []}
    with torch.inference_mode(), ldm_sdpa():
        tome.apply_patch(unet, config=config)
        report = tome.patch_report(unet)
        forward()  # warm-up, also fills the per-level token counts
        tome.remove_patch(unet)
        forward()
        for _ in range(args.repeats):  # interleaved: baseline, tome, baseline, tome
            times["baseline"].append(forward())
            tome.apply_patch(unet, config=config)
            times["tome"].append(forward())
            tome.remove_patch(unet)

    print(report.summary())
    print("\n| level | tokens | merged | remaining |\n|---|---|---|---|")
    for ds, (n, r) in sorted(report.tokens.items()):
        print(f"| ds{ds} ({side // ds}x{side // ds}) | {n} | {r} | {n - r} |")
    base, ours = (statistics.median(v) for v in times.values())
    print(f"\nSD1.5 UNet, {args.size}x{args.size}, batch 2, {dtype}, {device_name(device)}, "
          f"SDPA attention, median of {args.repeats}:")
    print(f"baseline {base:.3f} s, ToMe r={args.ratio:g} {ours:.3f} s: {base / ours:.2f}x")


if __name__ == "__main__":
    main()
