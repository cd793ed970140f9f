"""See what each ToMe setting costs: a grid of images, a quality-vs-speed plot and a table.

    python -m tome_lab.showcase                 # about 2 minutes on one CPU core, fp32
    python -m tome_lab.showcase --steps 20 --timesteps 100,300,500,700,900   # the docs' run
    python -m tome_lab.showcase --seeds 0,1 --steps 25 --threads 2 --out out/showcase
    python -m tome_lab.showcase --preset full   # every method and option of the library

Uses the small diffusion model shipped in ``tome_lab/tinyldm`` (trained on photos, real ``ldm``
UNet, 4096 tokens at its top level as SD 1.5 at 512 px), then the tiny DiT of
``tome_lab/tinydit`` (diffusers Flux blocks) unpooled and pooled (``dit_quality.py``). Every
setting samples the same seeds, so each image can be compared with the unmerged one above its
caption: PSNR/SSIM measure how far it drifted. The held-out loss says whether the model got worse at
denoising photos it never saw (needs the photo packages; skipped when unavailable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import quality, report
from .device import machine, pick_dtype
from .models import DTYPES
from .settings import parse_settings

#: The grid's settings: each method at increasing strength, plus a timestep window.
DEFAULT_SETTINGS = (
    "unmerged",
    "merge:0.25",
    "merge:0.5",
    "merge:0.75",
    "merge:0.5:matching=local",
    "downsample:2",
    "downsample:4",
    "merge:0.75:end=0.5",
)

#: Every method and option of the library, for the full quality table.
FULL_SETTINGS = DEFAULT_SETTINGS + (
    "merge:0.25:matching=local",
    "merge:0.75:matching=local",
    "merge:0.5:use_rand=False",
    "merge:0.5:max_downsample=2",
    "merge:0.5:merge_crossattn=True",
    "merge:0.5:merge_mlp=True",
    "merge:0.5:start=0.5",
    "downsample:2:max_downsample=2",
)

QUICK_SETTINGS = ("unmerged", "merge:0.5", "downsample:2")


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tome_lab.showcase",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out/showcase", help="output folder (default out/showcase)")
    p.add_argument("--steps", type=int, default=10,
                   help="DDIM steps (default 10: the tiny model's images barely change past "
                        "that; the docs' figures used 20)")
    p.add_argument("--seeds", default="0",
                   help="comma-separated seeds; one image per class and seed, class k "
                        "using seed+k, so rows differ (default 0)")
    p.add_argument("--classes", default=None, help="class ids (default: all four)")
    p.add_argument("--size", type=int, default=64, help="image size (default 64)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: steadier timings on a busy machine)")
    p.add_argument("--preset", choices=("default", "full"), default="default",
                   help="settings: default (the grid's) or full (every option)")
    p.add_argument("--setting", action="append", default=[],
                   help="replace the preset: e.g. merge:0.5, merge:0.5:matching=local, "
                        "downsample:2, merge:0.75:end=0.5 (repeatable)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="compute dtype of sampling (auto: bf16 where the CPU has it natively, "
                        "else fp32)")
    p.add_argument("--fp32", action="store_true", help="= --dtype fp32")
    p.add_argument("--heldout", type=int, default=8,
                   help="held-out crops for the denoising loss (0: skip; default 8)")
    p.add_argument("--timesteps", default="100,500,900",
                   help="timesteps of the held-out loss (default 100,500,900)")
    p.add_argument("--cache", default=None, help="photo cache folder (default: the user cache)")
    p.add_argument("--weights", default=None, help="model file (default: the shipped one)")
    p.add_argument("--sd", action="store_true",
                   help="also measure the output deviation on the SD1.5 UNet (random weights)")
    p.add_argument("--sd-size", type=int, default=512)
    p.add_argument("--diff", type=float, default=25,
                   help="grid: also show |image - unmerged| times this (0: off; default 25)")
    p.add_argument("--at", default="1.5,2",
                   help="speed-ups at which to compare the methods (default 1.5,2)")
    p.add_argument("--quick", action="store_true",
                   help="tiny run for tests: 32 px, 4 steps, 2 classes, 3 settings, no DiT")
    p.add_argument("--dit-steps", type=int, default=20,
                   help="Euler steps of the tiny DiT's rows (0: skip the DiT; default 20)")
    a = p.parse_args(argv)

    if a.threads:
        torch.set_num_threads(a.threads)
    specs = a.setting or (FULL_SETTINGS if a.preset == "full" else DEFAULT_SETTINGS)
    timesteps = _ints(a.timesteps)
    if a.quick:
        a.size, a.steps, specs = 32, 4, a.setting or QUICK_SETTINGS
        a.heldout, timesteps = min(a.heldout, 4), [100, 900]
        a.classes = a.classes or "0,1"
    try:
        settings = parse_settings(specs)
    except ValueError as e:
        p.error(str(e))
    dtype, why = pick_dtype("cpu", "fp32" if a.fp32 else a.dtype)

    from . import tinyldm

    path = Path(a.weights) if a.weights else tinyldm.DEFAULT_WEIGHTS
    if not path.is_file():
        p.error(f"model weights not found: {path}")
    model = tinyldm.load_model(path)
    names = model.config["classes"]
    classes = _ints(a.classes) if a.classes else list(range(len(names)))
    seeds = _ints(a.seeds)
    trained = model.metadata.get("steps", "?")

    heldout, skipped = ((None, "--heldout 0") if a.heldout <= 0
                        else quality.heldout_batch(a.heldout, a.size, a.cache))
    images = [(c, s + k) for s in seeds for k, c in enumerate(classes)]
    n_img = len(images)
    print(f"tiny diffusion model ({tinyldm.num_params(model) / 1e6:.1f}M parameters, "
          f"{trained} training steps), {n_img} image(s) x {len(settings)} settings, "
          f"{a.steps} DDIM steps, {a.size}x{a.size}, {dtype}, "
          f"{torch.get_num_threads()} thread(s)", file=sys.stderr)
    print(why, file=sys.stderr)
    if heldout is None:
        print(f"held-out loss skipped: {skipped}", file=sys.stderr)

    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"\r[{time.perf_counter() - t0:5.0f} s] {msg:<60}", end="", file=sys.stderr,
              flush=True)

    rows = quality.evaluate(model, settings, images, steps=a.steps, size=a.size,
                            dtype=dtype, heldout=heldout, timesteps=timesteps,
                            progress=progress)
    print(file=sys.stderr)

    if a.sd:
        progress(f"SD1.5 UNet at {a.sd_size} px: output deviation")
        sd_rows = quality.sd_deviation(settings, "sd15", a.sd_size, dtype)
        print(file=sys.stderr)
        for r, sd in zip(rows, sd_rows):
            r["sd_deviation"] = sd["deviation"]

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    labels = [f"{names[c]}, seed {s}" for c, s in images]
    grid = report.grid_image(rows, row_labels=labels, diff_gain=a.diff)
    grid.save(out / "grid.png")
    what = (f"tiny diffusion model, {a.size}x{a.size}, {a.steps} DDIM steps, {n_img} image(s), "
            f"{dtype}")
    title = f"{what}, {torch.get_num_threads()} CPU thread(s)"
    report.quality_plot(rows, str(out / "quality_vs_speed.png"), title=title)

    cmd = "python -m tome_lab.showcase" + (" " + " ".join(argv if argv is not None
                                                      else sys.argv[1:])).rstrip()
    clock = ("CPU seconds of the sampling thread, so other processes on a busy machine do "
             "not inflate it; on an idle machine it equals wall time" if rows[0]["clock"] == "cpu"
             else "wall-clock seconds")
    notes = [f"Time: median time to sample one image ({a.steps} steps; {clock}), settings "
             "interleaved. Speed-up: unmerged time / setting time. MSE, PSNR, SSIM: final "
             "images against the unmerged images from the same seeds (MSE lower, PSNR and "
             "SSIM higher = closer)."]
    if heldout is not None:
        notes.append(f"Loss Δ: relative increase of the denoising loss on {len(heldout[1])} "
                     "held-out photo crops at each timestep t (0 = clean, 1000 = pure noise), "
                     "same noise for every setting.")
    if a.sd:
        notes.append(f"SD1.5 deviation: ||out - unmerged|| / ||unmerged|| of one call of the "
                     f"SD1.5 UNet at {a.sd_size} px (random weights, {dtype}, t=500).")
    text = [f"`{cmd.strip()}`: {what}; {machine()}; {why}.", "", report.quality_table(rows), "",
            *notes, "",
            "Each method at equal speed-up (interpolated between its settings, starting from "
            "the unmerged model at 1x" + (f"; loss: loss Δ at t={min(timesteps)}"
                                          if heldout is not None else "") + "):", "",
            report.equal_speed_table(rows, [float(x) for x in a.at.split(",")])]
    table = "\n".join(text)
    (out / "table.md").write_text(table + "\n")
    raw = [{k: v for k, v in r.items() if k != "images"} for r in rows]
    (out / "rows.json").write_text(json.dumps({"command": cmd.strip(), "rows": raw}, indent=1,
                                              default=str) + "\n")
    print(table)
    print()
    written = ["grid.png", "quality_vs_speed.png", "table.md"]
    if a.dit_steps > 0 and not a.quick:
        from . import dit_quality
        print(file=sys.stderr)
        print(dit_quality.run(out, steps=a.dit_steps, seeds=seeds,
                               heldout=heldout if a.size == 64 else None))
        print()
        written += ["dit_grid.png", "dit_table.md"]
    for name in written:
        print(f"wrote {os.path.join(a.out, name)}")
    print(f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
