"""DiT speed: Flux-, SD3-, Qwen-Image- and Wan-shaped transformers, unpooled against pooled
image keys/values.

    python -m tome_lab.dit_bench            # Flux and SD3 at 512, 768, 1024 and 2048 px
    python -m tome_lab.dit_bench --models qwen,wan --sizes 1024,2048 --video-sizes 832x480x33
    python -m tome_lab.dit_bench --quick    # tiny widths at small sizes, one round (a test)
    python -m tome_lab.dit_bench --models lumina2,z-image,ltxv,cosmos2,kandinsky5,cogvideox

The last: ComfyUI's families pooled only through its attention override (``dit_calls.py``):
one self-attention call each at the released shapes, at ``--call-sizes`` (1024, 2048 px) and
``--call-video-sizes`` (832x480 with 33 and 81 frames), against the ceiling.

The models are diffusers' ``FluxTransformer2DModel`` with FLUX.1-dev's config (24 heads x 128
= 3072 wide, T5 width 4096, pooled CLIP 768, RoPE axes 16/56/56, guidance embedding) and
``SD3Transformer2DModel`` with SD3.5-medium's (24 heads x 64 = 1536 wide, patch 2, qk RMS
norm, pos_embed_max_size 384, dual attention -- an image-only second attention -- in its first
blocks), each with random weights (std 0.02) and only a few blocks (``--flux-blocks``,
``--sd3-blocks``; SD3's first half dual, like SD3.5-medium's 13 of 24): a block is what pooling
changes, and a few of each kind show its cost against the rest of the model. Text as the
pipelines use it: Flux 512 T5 tokens, SD3 333 (77 CLIP + 256 T5). Image tokens: (px / 16)^2
for both (latent px/8; Flux packs 2x2, SD3 patches 2x2). Batch 1.

Qwen-Image: ``QwenImageTransformer2DModel`` with Qwen/Qwen-Image's config (24 heads x 128 =
3072 wide, Qwen2.5-VL width 3584, RoPE axes 16/56/56), ``--qwen-blocks`` double-stream blocks,
a 128-token prompt (its pipelines do not pad), (px / 16)^2 image tokens. Wan: a video DiT,
``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's config (12 heads x 128 = 1536 wide, FFN 8960,
umT5 width 4096; ``--wan-width 14b``: the 14B's 40 heads, 5120 wide, FFN 13824),
``--wan-blocks`` blocks, 512 text tokens (cross-attention), at ``--video-sizes`` WxHxF:
832x480x33 is 9 latent frames of 60 x 104 (VAE 4x in time, 8x in space), 9 x 30 x 52 = 14040
video tokens in every self-attention. Its variants add ``x2 2x2x2``: cells of 2x2 tokens and
2 frames (the ``temporal`` setting).

Variants, interleaved round-robin in one run (A B C, C B A, ...), each the median of
``--rounds``: ``none`` (unpatched), ``x2`` and ``x4`` (``tome.apply_patch(model,
method="downsample", downsample_factor=f)``, rope "pooled"), on Flux ``x2 before`` (the other
RoPE option; below 2048 px unless ``--before-large``), and ``ceiling``: the unpatched model
with the image keys/values dropped from attention entirely (keys = the text's; SD3.5's
image-only ``attn2`` keeps one key), the most any key/value reduction could gain.

In every forward the attention kernel (``torch.nn.functional.scaled_dot_product_attention``,
which diffusers' Flux and SD3 processors and ToMe's pooled ones all call) is timed call by call;
``attention`` is its share of the whole forward, unpooled. The kernel that ran is recorded (on
a CPU: ``_scaled_dot_product_flash_attention_for_cpu``, which never holds the score matrix);
a size whose forward would not fit in the free memory is skipped with one line. ``auto``: what
the auto policy decides at the size, measured on this machine with this model (a throw-away
measurement cache; the forward stops once the transformer's pre-hook has decided).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tome
from tome import layout, measure, memory, policy
from tome.layout import channels
from tome.measurements import MeasurementCache, Measurer

from . import dit_calls, timing
from .device import DEVICES, machine, pick_device, pick_dtype
from .dit_shapes import (
    FAMILIES,
    VIDEO,
    Size,
    build,
    inputs,
    parameters,
    sd3_dual,
    text_tokens,
    width,
)
from .models import DTYPES

LARGE = 2048  # px (larger side) from which rounds are --rounds-large and "x2 before" is left out
# Activations alive at once in one block, as copies of its [tokens, width] input: Flux's single
# block holds q, k, v, their rotations, the 4x MLP before and after its GELU and the 5x concat.
ACTIVATION_COPIES = 24
TEXT_FIRST = ("flux", "qwen")  # joint sequence [text, image]; SD3's is [image, text]


def variants(family: str, size: Size | int = 0, before_large: bool = False
             ) -> dict[str, dict[str, Any] | None]:
    """Name -> ``apply_patch`` settings (None: unpatched; the ceiling is the kernel's;
    ``temporal``: frames per cell, the setting)."""
    side = size.side if isinstance(size, Size) else size
    out: dict[str, dict[str, Any] | None] = {"none": None, "x2": {"downsample_factor": 2},
                                             "x4": {"downsample_factor": 4}}
    if family in ("flux", "qwen") and (side < LARGE or before_large):
        out["x2 before"] = {"downsample_factor": 2, "rope": "before"}
    if family in VIDEO:
        out["x2 2x2x2"] = {"downsample_factor": 2, "temporal": 2}
    out["ceiling"] = None
    return out


@contextlib.contextmanager
def patched(model, spec: dict[str, Any] | None):
    """``model`` pooled by ``spec`` (``apply_patch`` settings; None: as it is) for the
    duration; removed on the way out."""
    if spec is None:
        yield
        return
    tome.apply_patch(model, method="downsample", **spec)
    try:
        yield
    finally:
        tome.remove_patch(model)


# ----------------------------------------------------------------------------- the kernel

class _Ops(TorchDispatchMode):
    """The aten attention kernels one SDPA call dispatches to."""

    def __init__(self, into: set[str]):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "attention" in name or "softmax" in name:
            self.into.add(name.removeprefix("aten.").removesuffix(".default"))
        return func(*args, **(kwargs or {}))


def kernel_name(ops: set[str]) -> str:
    """The fused kernel SDPA ran, or the math path (which materialises the scores)."""
    fused = sorted(o for o in ops if "flash" in o or "efficient" in o or "cudnn" in o)
    return ", ".join(fused) if fused else "math (" + ", ".join(sorted(ops)) + ")"


def full_scores(ops: set[str]) -> bool:
    return kernel_name(ops).startswith("math")


class Kernel:
    """Stands in for ``torch.nn.functional.scaled_dot_product_attention`` during a forward
    (``swapped``): times every call (CUDA events on a GPU, the wall clock elsewhere: CPU
    kernels are synchronous), records the aten kernels it dispatched to, and for the ceiling
    (``drop = (family, text, image)``) passes the kernel the text's keys and values only."""

    def __init__(self, device: torch.device | str = "cpu", clock: str = "wall"):
        self.device = torch.device(device)
        self.now = time.thread_time if clock == "cpu" else time.perf_counter
        self.real: Any = None
        self.ops: set[str] = set()
        self.reset()

    def reset(self, drop: tuple[str, int, int] | None = None) -> None:
        self.drop, self.calls, self._seconds, self._events = drop, 0, 0.0, []

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        family, text, image = self.drop
        s = t.shape[-2]
        if s == text + image and family not in VIDEO:  # joint: [text, image] or [image, text]
            return t[..., :text, :] if family in TEXT_FIRST else t[..., image:, :]
        if s == image:  # image-only attention (SD3.5's attn2, Wan's self-attention): one key
            return t[..., :1, :]
        return t

    def __call__(self, query, key, value, *args, **kwargs):
        if self.drop is not None:
            key, value = self._keep(key), self._keep(value)
        self.calls += 1
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                enable_timing=True)
            start.record()
            out = self.real(query, key, value, *args, **kwargs)
            end.record()
            self._events.append((start, end))
            return out
        timing.synchronize(self.device)
        t0 = self.now()
        with _Ops(self.ops):
            out = self.real(query, key, value, *args, **kwargs)
        timing.synchronize(self.device)
        self._seconds += self.now() - t0
        return out

    def seconds(self) -> float:
        """Kernel time since ``reset`` (after the forward: the Timer has synchronised)."""
        return self._seconds + sum(s.elapsed_time(e) for s, e in self._events) / 1e3


@contextlib.contextmanager
def swapped(kernel: Kernel):
    """``F.scaled_dot_product_attention`` is ``kernel`` for the duration (diffusers' native
    attention backend, ``JointAttnProcessor2_0`` and ToMe's processors look it up per call)."""
    kernel.real = real = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = kernel
    try:
        yield kernel
    finally:
        F.scaled_dot_product_attention = real


def probe_kernel(model, dtype: torch.dtype) -> set[str]:
    """The aten kernels SDPA picks for this model's heads, dtype and device (64 tokens:
    nothing large is allocated before knowing whether the scores would be)."""
    cfg = model.config
    q = torch.randn(1, cfg.num_attention_heads, 64, cfg.attention_head_dim).to(
        next(model.parameters()).device, dtype)
    ops: set[str] = set()
    with torch.no_grad(), _Ops(ops):
        F.scaled_dot_product_attention(q, q, q)
    return ops


def need_bytes(model, family: str, size: Size, quick: bool, scores: bool) -> int:
    """Peak bytes of one unpooled forward above the weights: the activations of one block
    (``ACTIVATION_COPIES``), plus, where SDPA takes its math path, two fp32 score matrices
    (a video DiT's self-attention: video tokens squared; a joint one: text and image)."""
    heads = model.config.num_attention_heads
    n = size.tokens + (0 if family in VIDEO else text_tokens(family, quick))
    elem = next(model.parameters()).element_size()
    return ACTIVATION_COPIES * n * width(model) * elem + (2 * 4 * heads * n * n if scores else 0)


def library_memory(model, size: Size) -> dict[str, Any]:
    """What the library's memory check (``memory.py``, asked before the auto policy times a
    block) says of one unpooled block at ``size``: with the model's own kernel, and were it
    one that holds the score matrix (the math path)."""
    lay = layout.read(model)
    block = lay.blocks[0].module
    tokens = size.tokens
    backend = measure.attention_backend(lay)
    out: dict[str, Any] = {"backend": backend, "available": memory.available(
        next(model.parameters()).device)}
    for name, kernel in (("own", backend), ("math", "math")):
        full = memory.full_scores(kernel)
        need = memory.block_bytes(block, tokens, 1, channels(block), full)
        try:
            memory.check([(block, tokens, channels(block))], 1, kernel)
            out[name] = {"need": need, "fits": True, "full_scores": full}
        except memory.NotEnoughMemoryError as e:
            out[name] = {"need": need, "fits": False, "full_scores": full, "line": str(e)}
    return out


def fits(need: int, device: torch.device) -> tuple[bool, int | None]:
    free = memory.available(device)
    return free is None or need * memory.MARGIN + memory.HEADROOM <= free, free


# ----------------------------------------------------------------------------- running

def run_size(model, family: str, size: Size, rounds: int, dtype: torch.dtype, quick: bool,
             say, before_large: bool = False, clock: str = "wall") -> dict[str, Any]:
    """One size's row: every variant ``rounds`` times, interleaved, medians (``clock``:
    ``timing.Timer``'s: ``cpu`` counts this thread's CPU time, for one thread on a machine
    others load)."""
    device = next(model.parameters()).device
    args = inputs(model, family, size, dtype, quick)
    specs = variants(family, size, before_large)
    names = list(specs)
    text, image = text_tokens(family, quick), size.tokens
    times: dict[str, list[float]] = {n: [] for n in names}
    kernel_s: dict[str, list[float]] = {n: [] for n in names}
    kernel, timer = Kernel(device, clock), timing.Timer(device, clock)
    calls = 0
    what = f"{family} {size.label}"
    with torch.no_grad():
        if size.side < LARGE and size.frames == 1:  # first-call allocations out of round 1
            model(**args)
            say(f"  {what}: warmed up")
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                kernel.reset(drop=(family, text, image) if name == "ceiling" else None)
                with patched(model, specs[name]), swapped(kernel):
                    took, out = timer(lambda: model(**args).sample)
                if not torch.isfinite(out).all():
                    raise RuntimeError(f"{what} {name}: non-finite output")
                del out
                calls = kernel.calls
                times[name].append(took)
                kernel_s[name].append(kernel.seconds())
            say(f"  {what}, round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {times[n][-1]:.2f} s ({kernel_s[n][-1] / times[n][-1]:.0%} attention)"
                for n in names))
    med = {n: statistics.median(v) for n, v in times.items()}
    return {"family": family, "px": size.label, "frames": size.frames, "image_tokens": image,
            "text_tokens": text, "rounds": rounds, "clock": clock, "kernel_calls": calls,
            "kernel": kernel_name(kernel.ops), "ms": {n: med[n] * 1e3 for n in names},
            "range_ms": {n: [min(v) * 1e3, max(v) * 1e3] for n, v in times.items()},
            "attention_ms": {n: statistics.median(v) * 1e3 for n, v in kernel_s.items()},
            "attention_share": {n: statistics.median(k / t for k, t in zip(kernel_s[n], times[n]))
                                for n in names},
            "speedup": {n: med["none"] / med[n] for n in names}}


class _DecidedError(Exception):
    """Stops the forward once the transformer's pre-hook has decided."""


def auto_decision(model, family: str, size: Size, dtype: torch.dtype, quick: bool,
                  rounds: int = 5, warmup: int = 1) -> dict[str, Any]:
    """What the auto policy decides at ``size`` on this machine: ``apply_patch(policy="auto")``
    with a throw-away measurement cache, then a forward that stops right after the
    transformer's pre-hook (where it measures one block of each kind and decides; the blocks
    would only run what was decided). ``rounds``/``warmup``: the measurer's (its defaults
    are the library's)."""
    with tempfile.TemporaryDirectory() as tmp:
        lines: list[str] = []
        service = Measurer(MeasurementCache(Path(tmp) / "m.json", say=lines.append),
                           say=lines.append, rounds=rounds, warmup=warmup)
        tome.apply_patch(model, method="downsample", policy="auto", measure=service)

        def stop(*_: Any, **__: Any) -> None:
            raise _DecidedError

        report = tome.patch_report(model)
        handle = model.register_forward_pre_hook(stop, with_kwargs=True)
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                model(**inputs(model, family, size, dtype, quick))
        except _DecidedError:
            pass
        finally:
            handle.remove()
            tome.remove_patch(model)
    decisions = list(report.decisions.values())
    measured = service.last
    return {"pooled": any(d.merged for d in decisions) if decisions else None,
            "reason": "; ".join(d.reason for d in decisions) or "; ".join(lines),
            "measured_speedup": measured.rows[0].speedup if measured and measured.rows else None,
            "seconds": time.perf_counter() - t0, "rounds": rounds, "warmup": warmup,
            "lines": lines}


def break_even(rows: list[dict[str, Any]], variant: str = "x2",
               margin: float = policy.MARGIN) -> dict[str, str]:
    """Per model: from which size on ``variant`` is faster than unpooled (by ``margin``, the
    policy's) at that size and every larger one measured, in one line."""
    out: dict[str, str] = {}
    for family in dict.fromkeys(r["family"] for r in rows):
        mine = sorted((r for r in rows if r["family"] == family and variant in r.get(
            "speedup", {})), key=lambda r: r["image_tokens"])
        if not mine:
            continue
        pays = [r["speedup"][variant] >= 1 + margin for r in mine]
        first = next((i for i in range(len(mine)) if all(pays[i:])), None)

        def at(r: dict[str, Any]) -> str:
            return f"{r['px']} px ({r['image_tokens']} image tokens, {r['speedup'][variant]:.2f}x)"
        if first is None:
            out[family] = f"{variant} never {1 + margin:.2f}x faster up to {at(mine[-1])}"
        elif first == 0:
            out[family] = f"{variant} pays already at the smallest size, {at(mine[0])}"
        else:
            out[family] = (f"{variant} pays from {at(mine[first])}; not at "
                           f"{at(mine[first - 1])}")
    return out


def _auto_text(auto: dict[str, Any] | None) -> str:
    if auto is None:
        return "-"
    if auto["pooled"] is None:
        return "undecided"
    text = "pooled x2" if auto["pooled"] else "unpooled"
    if auto["measured_speedup"]:
        return text + f" ({auto['measured_speedup']:.2f}x measured)"
    video = any("video" in line for line in auto.get("lines", ()))
    return text + (" (token threshold; video grids not timed)" if video
                   else " (token threshold)")


def table(rows: list[dict[str, Any]]) -> str:
    video = any(r.get("frames", 1) > 1 for r in rows)
    lines = ["| model | px | image tokens | unpooled | x2 | x4 | x2 before | "
             + ("x2 2x2x2 | " if video else "") + "ceiling | attention share | auto |",
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if video else "")]
    names = ["x2", "x4", "x2 before"] + (["x2 2x2x2"] if video else []) + ["ceiling"]
    blank = " |" * (len(names) + 2)
    for r in rows:
        head = f"| {r['family']} | {r['px']} | {r['image_tokens']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']}{blank[2:]}")
            continue
        auto_text = _auto_text(r.get("auto"))
        if "ms" not in r:  # --auto-only
            lines.append(f"{head}{blank[:-2]} {auto_text} |")
            continue
        s = r["speedup"]

        def cell(n: str, r: dict[str, Any] = r, s: dict[str, float] = s) -> str:
            return f"{r['ms'][n] / 1e3:.2f} s, {s[n]:.2f}x" if n in s else "-"
        lines.append(f"{head} {r['ms']['none'] / 1e3:.2f} s | "
                     + " | ".join(cell(n) for n in names)
                     + f" | {r['attention_share']['none']:.0%} | {auto_text} |")
    return "\n".join(lines)


def memory_table(rows: list[dict[str, Any]]) -> str:
    """The library's memory check per size: one unpooled block, its own kernel and the math
    path."""
    lines = ["| model | px | image tokens | kernel | one block needs | fits | with the score "
             "matrix (math path) | fits | available |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r.get("memory")
        if not m:
            continue
        lines.append(f"| {r['family']} | {r['px']} | {r['image_tokens']} | {m['backend']} | "
                     f"{memory.gib(m['own']['need'])} | {'yes' if m['own']['fits'] else 'no'} | "
                     f"{memory.gib(m['math']['need'])} | {'yes' if m['math']['fits'] else 'no'} "
                     f"| {memory.gib(m['available'] or 0)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_lab.dit_bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="flux,sd3",
                    help=f"from {','.join(FAMILIES + tuple(dit_calls.SHAPES))}")
    ap.add_argument("--call-sizes", default="1024,2048",
                    help="px of the one-call families' images (dit_calls)")
    ap.add_argument("--call-video-sizes", default="832x480x33,832x480x81",
                    help="WxHxF of the one-call families' videos (dit_calls)")
    ap.add_argument("--sizes", default="512,768,1024,2048",
                    help="image families' px (square), comma-separated")
    ap.add_argument("--video-sizes", default="832x480x33",
                    help="video families' WxHxF (px and frames), comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds below 2048 px")
    ap.add_argument("--rounds-large", type=int, default=1, help="rounds at 2048 px and above")
    ap.add_argument("--flux-blocks", default="1,1", help="Flux double,single-stream blocks")
    ap.add_argument("--sd3-blocks", type=int, default=2,
                    help="SD3 joint blocks (the first half with dual attention)")
    ap.add_argument("--qwen-blocks", type=int, default=2, help="Qwen-Image blocks")
    ap.add_argument("--wan-blocks", type=int, default=2, help="Wan blocks")
    ap.add_argument("--wan-width", choices=("1.3b", "14b"), default="1.3b",
                    help="Wan 2.1 1.3B's width (1536, 12 heads) or 14B's (5120, 40 heads)")
    ap.add_argument("--before-large", action="store_true",
                    help="also time 'x2 before' at 2048 px and above")
    ap.add_argument("--no-auto", action="store_true", help="skip the auto policy's decisions")
    ap.add_argument("--auto-only", action="store_true",
                    help="only the auto policy's decisions (no variants timed)")
    ap.add_argument("--auto-rounds-large", type=int, default=1,
                    help="the auto policy's measuring rounds at 2048 px and above (no warm-up; "
                         "below: the library's 5 after 1 warm-up)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny widths at small sizes, one round (seconds: a smoke test)")
    ap.add_argument("--compile", action="store_true",
                    help="the shipped tiny DiT eager vs compiled by blocks (fullgraph), "
                         "unpatched vs pooled x2, interleaved, graphs per size (dit_compile)")
    ap.add_argument("--compile-sizes", default="32,48,64,96", help="pixels, for --compile")
    ap.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)
    ap.add_argument("--compile-schedule", default="",
                    help="the patched variant's DiT schedule for --compile (default: x2 in "
                         "every block; e.g. all:2@0.2-1: a window, every variant in one graph)")
    ap.add_argument("--device", choices=DEVICES, default="auto")
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                    help="auto: bf16 where native on a CPU (AMX, AVX512-BF16), fp16 on GPUs")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this thread's CPU time (with --threads 1 on a shared machine)")
    ap.add_argument("--out", default="out/dit_bench")
    args = ap.parse_args(argv)
    if args.compile:
        from tome_lab import dit_compile
        if args.threads:
            torch.set_num_threads(args.threads)
        device = pick_device(args.device)
        config = tome.ToMeConfig(method="downsample", downsample_factor=2,
                                 schedule=args.compile_schedule)
        rows = dit_compile.run([int(v) for v in args.compile_sizes.split(",")],
                               1 if args.quick else args.rounds, args.compile_backend,
                               config=config, device=device,
                               sync=lambda: timing.synchronize(device))
        print(dit_compile.table(rows), flush=True)
        return 0
    images = [Size.parse(v) for v in ("256,512" if args.quick else args.sizes).split(",")]
    videos = [Size.parse(v) for v in ("64x48x5" if args.quick else args.video_sizes).split(",")]
    rounds = 1 if args.quick else args.rounds
    double, single = (int(v) for v in args.flux_blocks.split(","))
    blocks = {"flux": (double, single), "sd3": (args.sd3_blocks, 0),
              "qwen": (args.qwen_blocks, 0), "wan": (args.wan_blocks, 0)}
    wide = args.wan_width == "14b"
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    name, why = pick_dtype(device, args.dtype)
    dtype = DTYPES[name]

    def say(msg: str) -> None:
        print(msg, flush=True)

    from diffusers.utils import logging as diffusers_logging
    diffusers_logging.set_verbosity_error()  # its dtype advice is not for random-weight models
    say(f"DiT bench on {machine(device)}; {why}; {args.clock} clock")
    rows: list[dict[str, Any]] = []
    call_rows: list[dict[str, Any]] = []
    call_images = [Size.parse(v) for v in ("256" if args.quick else args.call_sizes).split(",")]
    call_videos = [Size.parse(v) for v in
                   ("64x48x5" if args.quick else args.call_video_sizes).split(",")]
    for family in args.models.split(","):
        if family in dit_calls.SHAPES:
            for size in (call_images if family in dit_calls.IMAGE_CALLS else []) \
                    + (call_videos if family in dit_calls.VIDEO_CALLS else []):
                row = dit_calls.run(family, size, rounds, dtype, device, args.quick,
                                    timing.synchronize)
                call_rows.append(row)
                say(f"{family} {size.label}, one self-attention call ({row['sequence']} "
                    f"tokens): unpooled {row['call_ms']['none']:.1f} ms, " + ", ".join(
                        f"{v} {x:.2f}x" for v, x in row["speedup"].items() if v != "none"))
            continue
        n = parameters(family, blocks[family], args.quick, wide)
        ok, free = fits(n * 4 * 2, device)  # built in fp32, then cast: both alive at once
        if not ok:
            say(f"{family}: skipped: {n / 1e6:.0f}M parameters need about "
                f"{memory.gib(n * 8)} to build, {memory.gib(free or 0)} available")
            continue
        t0 = time.perf_counter()
        model = build(family, blocks[family], args.quick, dtype, device, wide)
        ops = probe_kernel(model, dtype)
        d, s = blocks[family]
        kinds = {"flux": f" + {s} single-stream", "sd3": f" ({len(sd3_dual(d))} with dual "
                 "attention)", "wan": f" ({width(model)} wide)"}
        kind = {"flux": "double-stream ", "qwen": "double-stream ", "sd3": "joint "}.get(
            family, "")
        say(f"{family}: {d} {kind}block(s){kinds.get(family, '')}, {n / 1e6:.0f}M parameters, "
            f"built in {time.perf_counter() - t0:.0f} s; attention kernel: {kernel_name(ops)}")
        for size in videos if family in VIDEO else images:
            large = size.side >= LARGE
            head = {"family": family, "px": size.label, "frames": size.frames,
                    "image_tokens": size.tokens}
            need = need_bytes(model, family, size, args.quick, full_scores(ops))
            ok, free = fits(need, device)
            if not ok:
                row = dict(head, skipped=f"needs about {memory.gib(need)}, "
                                         f"{memory.gib(free or 0)} available")
                rows.append(row)
                say(f"{family} {size.label}: skipped: a forward {row['skipped']}")
                continue
            mem = library_memory(model, size)
            say(f"  {family} {size.label}, memory check of one unpooled block: "
                f"{memory.gib(mem['own']['need'])} with {mem['backend']} "
                f"({'fits' if mem['own']['fits'] else 'does not fit'}), "
                f"{memory.gib(mem['math']['need'])} with the score matrix "
                f"({'fits' if mem['math']['fits'] else 'does not fit'}), "
                f"{memory.gib(mem['available'] or 0)} available")
            auto = None
            if not args.no_auto:
                auto = auto_decision(model, family, size, dtype, args.quick,
                                     *((args.auto_rounds_large, 0) if large else (5, 1)))
                say(f"  {family} {size.label}, auto ({auto['seconds']:.0f} s): {auto['reason']}")
                if args.auto_only:
                    rows.append(dict(head, auto=auto, memory=mem))
                    continue
            row = run_size(model, family, size, args.rounds_large if large else rounds, dtype,
                           args.quick, say, args.before_large, args.clock)
            row["auto"], row["memory"] = auto, mem
            rows.append(row)
            say(f"{family} {size.label} ({row['image_tokens']} image tokens): unpooled "
                f"{row['ms']['none'] / 1e3:.2f} s, " + ", ".join(
                    f"{v} {x:.2f}x" for v, x in row["speedup"].items() if v != "none")
                + f"; attention {row['attention_share']['none']:.0%} of the forward ("
                f"{row['kernel']})")
        del model
    even = break_even(rows)
    for family, line in even.items():
        say(f"break-even, {family}: {line}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dit_bench.json").write_text(json.dumps(
        {"machine": machine(device), "dtype": name, "dtype_reason": why,
         "blocks": {f: list(b) for f, b in blocks.items()}, "wan_width": args.wan_width,
         "break_even": even, "rows": rows, "call_rows": call_rows}, indent=1))
    text = "\n\n".join(t for t in (table(rows) + "\n\n" + memory_table(rows) if rows else "",
                                    dit_calls.table(call_rows) if call_rows else "") if t)
    (out / "dit_bench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
