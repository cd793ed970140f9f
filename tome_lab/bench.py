"""Benchmark: real UNets from config (random weights), unmerged vs tomesd vs our methods.

    python -m tome_lab.bench --quick                       # a few minutes on one CPU thread
    python -m tome_lab.bench --device cuda --sizes 512,1024,2048       # SD1.5 and SDXL on a GPU
    python -m tome_lab.bench --model sd15 --sizes 1024 --dtype bf16 --ratios 0.5 --factors 2,4
    python -m tome_lab.bench --device cuda --compile --sizes 1024
    python -m tome_lab.bench --suite matching --tokens 65536

Every setting of a case runs on the same model and inputs, interleaved (A B C, C B A, ...)
after warm-up; the median is reported. ``--device auto`` takes CUDA, then MPS, then the CPU;
the dtype defaults to fp16 on GPUs and, on CPUs, to bf16 only where it is native (AMX,
AVX512-BF16), else fp32. The run loop is ``tome_lab.run``, the settings ``tome_lab.settings``,
the output ``tome_lab.report``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import report
from .device import DEVICES, device_name, machine, pick_device, pick_dtype
from .matching import run_matching
from .models import DTYPES, MODELS, build_case
from .run import run_benchmark, same_bits_twice
from .settings import METHOD_GROUPS, Setting, default_settings

CPU_METHODS = "tomesd,merge,merge-local,downsample,auto"
GPU_METHODS = "ceiling,tomesd,merge,merge-local,downsample,auto,match-only"


def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v.strip()]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tome_lab.bench", description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("unet", "matching", "all"), default="unet")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto (default): cuda, then mps, then cpu")
    p.add_argument("--model", default=None,
                   help=f"comma-separated: {', '.join(MODELS)} (default: sd15 on a CPU, "
                        "sd15,sdxl on a GPU)")
    p.add_argument("--sizes", default="512", help="image sizes in pixels (default 512)")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, from {', '.join(METHOD_GROUPS)} (the unmerged model "
                        f"always runs; default {CPU_METHODS} on a CPU, {GPU_METHODS} on a GPU)")
    p.add_argument("--ratios", default="0.5", help="merge ratios for tomesd/merge")
    p.add_argument("--factors", default="2", help="downsample factors")
    p.add_argument("--setting", action="append", default=[],
                   help="extra setting, e.g. merge:0.5:max_downsample=2, "
                        "tomesd:0.5:max_downsample=2, ceiling, match-only:tomesd (repeatable)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="auto (default): fp16 on GPUs; on CPUs bf16 where native, else fp32")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--same-bits", action="store_true",
                   help="also check that merge gives the same bits in two calls (always on GPUs)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds (default 3 on a CPU, 10 on a GPU)")
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up rounds (default 1 on a CPU, 3 on a GPU; >= 2 with --compile)")
    p.add_argument("--compile", action="store_true",
                   help="run the unmerged and every patched model through torch.compile and "
                        "report graphs, graph breaks and recompiles")
    p.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)
    p.add_argument("--no-measure", action="store_true",
                   help="skip FLOPs and peak memory (faster warm-up)")
    p.add_argument("--tokens", type=int, default=65536, help="matching suite: tokens")
    p.add_argument("--channels", type=int, default=320, help="matching suite: channels")
    p.add_argument("--matching-dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--quick", action="store_true",
                   help="SD1.5 at 256 px and matching at 4096 tokens: a few minutes on one CPU "
                        "thread")
    p.add_argument("--plot", default=None, help="write the PNG plot here")
    p.add_argument("--json", default=None, help="write the raw rows here")
    p.add_argument("--markdown", default=None, help="also write the tables here")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    try:
        device = pick_device(a.device)
        dtype, why = pick_dtype(device, a.dtype)
    except ValueError as e:
        p.error(str(e))
    gpu = device.type != "cpu"
    if a.quick:
        a.suite, a.model, a.sizes, a.tokens = "all", a.model or "sd15", "256", 4096
        a.repeats = a.repeats or 2
    models = (a.model or ("sd15,sdxl" if gpu else "sd15")).split(",")
    for name in models:
        if name not in MODELS:
            p.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    repeats = a.repeats if a.repeats is not None else (10 if gpu else 3)
    torch.set_num_threads(a.threads)
    progress = not a.no_progress
    text = [f"Device: {machine(device)}", why, ""]
    result: dict[str, Any] = {"machine": machine(device), "device": device_name(device),
                              "dtype": dtype, "dtype_reason": why,
                              "argv": list(argv if argv is not None else sys.argv[1:])}
    if a.suite in ("unet", "all"):
        try:
            settings = default_settings((a.methods or (GPU_METHODS if gpu else CPU_METHODS))
                                        .split(","), _floats(a.ratios), _ints(a.factors))
            settings += [Setting.parse(s) for s in a.setting]
        except ValueError as e:
            p.error(str(e))
        rows: list[dict[str, Any]] = []
        bits: list[str] = []
        for name in models:
            model = case = None
            for size in _ints(a.sizes):
                t0 = time.perf_counter()
                case = build_case(name, size, dtype, a.batch, model=model, device=device)
                model = case.model
                if progress:
                    print(f"built {case.label} on {device} in {time.perf_counter() - t0:.1f} s",
                          file=sys.stderr)
                rows += run_benchmark([case], settings, repeats, not a.no_measure, progress,
                                      warmup=a.warmup, compile=a.compile,
                                      compile_backend=a.compile_backend)
                ours = next((s for s in settings if s.impl == "tome" and not s.unmerged
                             and s.method == "merge"), None)
                if ours is not None and (gpu or a.same_bits):
                    same = same_bits_twice(case, ours)
                    bits.append(f"Same bits twice ({ours.label}, {case.label}, two UNet calls, "
                                f"deterministic algorithms off): {'yes' if same else 'NO'}")
            del model, case
            if device.type == "cuda":
                torch.cuda.empty_cache()
        summary = report.summary_table(rows)
        if summary and len({(r["model"], r["size"]) for r in rows}) > 1:
            text += [summary, ""]
        text.append(report.markdown_table(rows))
        if bits:
            text += [""] + bits
        result["unet"] = rows
        result["same_bits"] = bits
        if a.plot:
            text.append(f"\nPlot: {report.plot(rows, a.plot)}")
    if a.suite in ("matching", "all"):
        mrows = run_matching(a.tokens, a.channels, a.batch, a.matching_dtype,
                             repeats=1 if a.quick else (10 if gpu else 2), progress=progress,
                             device=device)
        text += ["", report.matching_table(mrows)]
        result["matching"] = mrows
    out = "\n".join(text)
    print(out)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(out + "\n")
    if a.json:
        report.save_json(a.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
