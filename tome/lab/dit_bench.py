"""DiT speed: Flux- and SD3-shaped transformers, unpooled against pooled image keys/values.

    python -m tome.lab.dit_bench            # Flux and SD3 at 512, 768, 1024 and 2048 px
    python -m tome.lab.dit_bench --quick    # tiny widths at 256 and 512 px, one round (a test)

The models are diffusers' ``FluxTransformer2DModel`` with FLUX.1-dev's config (24 heads x 128
= 3072 wide, T5 width 4096, pooled CLIP 768, RoPE axes 16/56/56, guidance embedding) and
``SD3Transformer2DModel`` with SD3.5-medium's (24 heads x 64 = 1536 wide, patch 2, qk RMS
norm, pos_embed_max_size 384, dual attention -- an image-only second attention -- in its first
blocks), each with random weights (std 0.02) and only a few blocks (``--flux-blocks``,
``--sd3-blocks``; SD3's first half dual, like SD3.5-medium's 13 of 24): a block is what pooling
changes, and a few of each kind show its cost against the rest of the model. Text as the
pipelines use it: Flux 512 T5 tokens, SD3 333 (77 CLIP + 256 T5). Image tokens: (px / 16)^2
for both (latent px/8; Flux packs 2x2, SD3 patches 2x2). Batch 1.

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
from tome import memory, policy
from tome.measurements import MeasurementCache, Measurer

from . import timing
from .device import DEVICES, machine, pick_device, pick_dtype
from .models import DTYPES

# black-forest-labs/FLUX.1-dev transformer/config.json, less its depth (19 double, 38 single).
FLUX = dict(patch_size=1, in_channels=64, attention_head_dim=128, num_attention_heads=24,
            joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
# stabilityai/stable-diffusion-3.5-medium transformer/config.json, less its depth (24 joint
# blocks, dual attention in 0-12).
SD3 = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
           num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
           pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm")
TINY_FLUX = dict(FLUX, attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                 pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))
TINY_SD3 = dict(SD3, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                caption_projection_dim=16, pooled_projection_dim=16, pos_embed_max_size=64)
TEXT = {"flux": 512, "sd3": 333}
QUICK_TEXT = 8
LARGE = 2048  # px from which rounds are --rounds-large and "x2 before" is left out
# Activations alive at once in one block, as copies of its [tokens, width] input: Flux's single
# block holds q, k, v, their rotations, the 4x MLP before and after its GELU and the 5x concat.
ACTIVATION_COPIES = 24


def sd3_dual(blocks: int) -> tuple[int, ...]:
    """SD3.5-medium's dual-attention blocks scaled to ``blocks``: the first half, rounded up
    (13 of its 24). With 2 blocks: one dual block and the last one (``context_pre_only``)."""
    return tuple(range((blocks + 1) // 2))


def _config(family: str, double: int, single: int, quick: bool) -> tuple[type, dict[str, Any]]:
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel
    if family == "flux":
        return FluxTransformer2DModel, dict(TINY_FLUX if quick else FLUX, num_layers=double,
                                            num_single_layers=single)
    if family == "sd3":
        return SD3Transformer2DModel, dict(TINY_SD3 if quick else SD3, num_layers=double,
                                           dual_attention_layers=sd3_dual(double))
    raise ValueError(f"unknown model {family!r}; choose flux or sd3")


def parameters(family: str, double: int, single: int, quick: bool = False) -> int:
    """The model's parameter count, from a build on the meta device (nothing allocated)."""
    cls, cfg = _config(family, double, single, quick)
    with torch.device("meta"):
        return sum(p.numel() for p in cls(**cfg).parameters())


def build(family: str, double: int, single: int, quick: bool, dtype: torch.dtype,
          device: torch.device | str = "cpu"):
    """The transformer with random weights (std 0.02: activations stay finite). ``double``:
    Flux's double-stream blocks or SD3's joint blocks; ``single``: Flux's single-stream."""
    cls, cfg = _config(family, double, single, quick)
    model = cls(**cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval().to(device, dtype)


def text_tokens(family: str, quick: bool) -> int:
    return QUICK_TEXT if quick else TEXT[family]


def image_tokens(px: int) -> int:
    return (px // 16) ** 2


def inputs(model, family: str, px: int, dtype: torch.dtype, quick: bool) -> dict[str, Any]:
    """One call's arguments at ``px`` (latent px/8; Flux packs 2x2, SD3 patches 2x2), on the
    model's device."""
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    dev = next(model.parameters()).device
    text = text_tokens(family, quick)
    lat = px // 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dev, dtype)

    ctx, pooled = rand(1, text, cfg.joint_attention_dim), rand(1, cfg.pooled_projection_dim)
    if family == "flux":
        h = w = lat // 2
        ids = torch.zeros(h * w, 3)
        ids[:, 1] = torch.arange(h).repeat_interleave(w)
        ids[:, 2] = torch.arange(w).repeat(h)
        return dict(hidden_states=rand(1, h * w, cfg.in_channels), encoder_hidden_states=ctx,
                    pooled_projections=pooled, timestep=torch.tensor([0.5], device=dev),
                    img_ids=ids.to(dev), txt_ids=torch.zeros(text, 3, device=dev),
                    guidance=torch.tensor([3.5], device=dev) if cfg.guidance_embeds else None)
    return dict(hidden_states=rand(1, cfg.in_channels, lat, lat), encoder_hidden_states=ctx,
                pooled_projections=pooled, timestep=torch.tensor([500.0], device=dev))


def variants(family: str, px: int = 0, before_large: bool = False
             ) -> dict[str, dict[str, Any] | None]:
    """Name -> ``apply_patch`` settings (None: unpatched; the ceiling is the kernel's)."""
    out: dict[str, dict[str, Any] | None] = {"none": None, "x2": {"downsample_factor": 2},
                                             "x4": {"downsample_factor": 4}}
    if family == "flux" and (px < LARGE or before_large):
        out["x2 before"] = {"downsample_factor": 2, "rope": "before"}
    out["ceiling"] = None
    return out


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

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.real: Any = None
        self.ops: set[str] = set()
        self.reset()

    def reset(self, drop: tuple[str, int, int] | None = None) -> None:
        self.drop, self.calls, self._seconds, self._events = drop, 0, 0.0, []

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        family, text, image = self.drop
        s = t.shape[-2]
        if s == text + image:  # joint attention: Flux [text, image], SD3 [image, text]
            return t[..., :text, :] if family == "flux" else t[..., image:, :]
        if s == image:         # SD3.5's image-only attn2: one key left
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
        t0 = time.perf_counter()
        with _Ops(self.ops):
            out = self.real(query, key, value, *args, **kwargs)
        timing.synchronize(self.device)
        self._seconds += time.perf_counter() - t0
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


def need_bytes(model, family: str, px: int, quick: bool, scores: bool) -> int:
    """Peak bytes of one unpooled forward above the weights: the activations of one block
    (``ACTIVATION_COPIES``), plus, where SDPA takes its math path, two fp32 score matrices."""
    cfg = model.config
    heads, width = cfg.num_attention_heads, cfg.num_attention_heads * cfg.attention_head_dim
    n = image_tokens(px) + text_tokens(family, quick)
    elem = next(model.parameters()).element_size()
    return ACTIVATION_COPIES * n * width * elem + (2 * 4 * heads * n * n if scores else 0)


def fits(need: int, device: torch.device) -> tuple[bool, int | None]:
    free = memory.available(device)
    return free is None or need * memory.MARGIN + memory.HEADROOM <= free, free


# ----------------------------------------------------------------------------- running

def run_size(model, family: str, px: int, rounds: int, dtype: torch.dtype, quick: bool,
             say, before_large: bool = False) -> dict[str, Any]:
    """One size's row: every variant ``rounds`` times, interleaved, medians."""
    device = next(model.parameters()).device
    args = inputs(model, family, px, dtype, quick)
    specs = variants(family, px, before_large)
    names = list(specs)
    text, image = text_tokens(family, quick), image_tokens(px)
    times: dict[str, list[float]] = {n: [] for n in names}
    kernel_s: dict[str, list[float]] = {n: [] for n in names}
    kernel, timer = Kernel(device), timing.Timer(device)
    calls = 0
    with torch.no_grad():
        if px < LARGE:  # one untimed forward: first-call allocations out of round 1
            model(**args)
            say(f"  {family} {px} px: warmed up")
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                if specs[name] is not None:
                    tome.apply_patch(model, method="downsample", **specs[name])
                kernel.reset(drop=(family, text, image) if name == "ceiling" else None)
                try:
                    with swapped(kernel):
                        took, out = timer(lambda: model(**args).sample)
                finally:
                    tome.remove_patch(model)
                if not torch.isfinite(out).all():
                    raise RuntimeError(f"{family} {px} px {name}: non-finite output")
                del out
                calls = kernel.calls
                times[name].append(took)
                kernel_s[name].append(kernel.seconds())
            say(f"  {family} {px} px, round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {times[n][-1]:.2f} s ({kernel_s[n][-1] / times[n][-1]:.0%} attention)"
                for n in names))
    med = {n: statistics.median(v) for n, v in times.items()}
    return {"family": family, "px": px, "image_tokens": image, "text_tokens": text,
            "rounds": rounds, "kernel_calls": calls, "kernel": kernel_name(kernel.ops),
            "ms": {n: med[n] * 1e3 for n in names},
            "range_ms": {n: [min(v) * 1e3, max(v) * 1e3] for n, v in times.items()},
            "attention_ms": {n: statistics.median(v) * 1e3 for n, v in kernel_s.items()},
            "attention_share": {n: statistics.median(k / t for k, t in zip(kernel_s[n], times[n]))
                                for n in names},
            "speedup": {n: med["none"] / med[n] for n in names}}


class _DecidedError(Exception):
    """Stops the forward once the transformer's pre-hook has decided."""


def auto_decision(model, family: str, px: int, dtype: torch.dtype, quick: bool,
                  rounds: int = 5, warmup: int = 1) -> dict[str, Any]:
    """What the auto policy decides at ``px`` on this machine: ``apply_patch(policy="auto")``
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
                model(**inputs(model, family, px, dtype, quick))
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
            "speedup", {})), key=lambda r: r["px"])
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


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | px | image tokens | unpooled | x2 | x4 | x2 before | ceiling | "
             "attention share | auto |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['family']} | {r['px']} | {r['image_tokens']} |"
        if "skipped" in r:
            lines.append(f"{head} skipped: {r['skipped']} | | | | | | |")
            continue
        auto = r.get("auto")
        auto_text = "-" if auto is None else (
            ("pooled x2" if auto["pooled"] else "unpooled") if auto["pooled"] is not None
            else "undecided") + (f" ({auto['measured_speedup']:.2f}x measured)"
                                 if auto["measured_speedup"] else " (token threshold)")
        if "ms" not in r:  # --auto-only
            lines.append(f"{head} | | | | | | {auto_text} |")
            continue
        s = r["speedup"]

        def cell(n: str, r: dict[str, Any] = r, s: dict[str, float] = s) -> str:
            return f"{r['ms'][n] / 1e3:.2f} s, {s[n]:.2f}x" if n in s else "-"
        lines.append(f"{head} {r['ms']['none'] / 1e3:.2f} s | {cell('x2')} | {cell('x4')} | "
                     f"{cell('x2 before')} | {cell('ceiling')} | "
                     f"{r['attention_share']['none']:.0%} | {auto_text} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome.lab.dit_bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="flux,sd3")
    ap.add_argument("--sizes", default="512,768,1024,2048", help="px, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds below 2048 px")
    ap.add_argument("--rounds-large", type=int, default=1, help="rounds at 2048 px and above")
    ap.add_argument("--flux-blocks", default="1,1", help="Flux double,single-stream blocks")
    ap.add_argument("--sd3-blocks", type=int, default=2,
                    help="SD3 joint blocks (the first half with dual attention)")
    ap.add_argument("--before-large", action="store_true",
                    help="also time 'x2 before' at 2048 px and above")
    ap.add_argument("--no-auto", action="store_true", help="skip the auto policy's decisions")
    ap.add_argument("--auto-only", action="store_true",
                    help="only the auto policy's decisions (no variants timed)")
    ap.add_argument("--auto-rounds-large", type=int, default=1,
                    help="the auto policy's measuring rounds at 2048 px and above (no warm-up; "
                         "below: the library's 5 after 1 warm-up)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny widths at 256 and 512 px, one round (seconds: a smoke test)")
    ap.add_argument("--device", choices=DEVICES, default="auto")
    ap.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                    help="auto: bf16 where native on a CPU (AMX, AVX512-BF16), fp16 on GPUs")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    ap.add_argument("--out", default="out/dit_bench")
    args = ap.parse_args(argv)
    sizes = [256, 512] if args.quick else [int(s) for s in args.sizes.split(",")]
    rounds = 1 if args.quick else args.rounds
    double, single = (int(v) for v in args.flux_blocks.split(","))
    blocks = {"flux": (double, single), "sd3": (args.sd3_blocks, 0)}
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    name, why = pick_dtype(device, args.dtype)
    dtype = DTYPES[name]

    def say(msg: str) -> None:
        print(msg, flush=True)

    from diffusers.utils import logging as diffusers_logging
    diffusers_logging.set_verbosity_error()  # its dtype advice is not for random-weight models
    say(f"DiT bench on {machine(device)}; {why}")
    rows: list[dict[str, Any]] = []
    for family in args.models.split(","):
        d, s = blocks[family]
        n = parameters(family, d, s, args.quick)
        ok, free = fits(n * 4 * 2, device)  # built in fp32, then cast: both alive at once
        if not ok:
            say(f"{family}: skipped: {n / 1e6:.0f}M parameters need about "
                f"{memory.gib(n * 8)} to build, {memory.gib(free or 0)} available")
            continue
        t0 = time.perf_counter()
        model = build(family, d, s, args.quick, dtype, device)
        ops = probe_kernel(model, dtype)
        say(f"{family}: {d} {'double-stream' if family == 'flux' else 'joint'}"
            + (f" + {s} single-stream" if family == "flux" else
               f" ({len(sd3_dual(d))} with dual attention)")
            + f" block(s), {n / 1e6:.0f}M parameters, built in {time.perf_counter() - t0:.0f} s; "
            f"attention kernel: {kernel_name(ops)}")
        for px in sizes:
            large = px >= LARGE
            need = need_bytes(model, family, px, args.quick, full_scores(ops))
            ok, free = fits(need, device)
            if not ok:
                row = {"family": family, "px": px, "image_tokens": image_tokens(px),
                       "skipped": f"needs about {memory.gib(need)}, "
                                  f"{memory.gib(free or 0)} available"}
                rows.append(row)
                say(f"{family} {px} px: skipped: a forward {row['skipped']}")
                continue
            auto = None
            if not args.no_auto:
                auto = auto_decision(model, family, px, dtype, args.quick,
                                     *((args.auto_rounds_large, 0) if large else (5, 1)))
                say(f"  {family} {px} px, auto ({auto['seconds']:.0f} s): {auto['reason']}")
                if args.auto_only:
                    rows.append({"family": family, "px": px, "image_tokens": image_tokens(px),
                                 "auto": auto})
                    continue
            row = run_size(model, family, px, args.rounds_large if large else rounds, dtype,
                           args.quick, say, args.before_large)
            row["auto"] = auto
            rows.append(row)
            say(f"{family} {px} px ({row['image_tokens']} image tokens): unpooled "
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
         "blocks": {f: list(b) for f, b in blocks.items()}, "break_even": even, "rows": rows},
        indent=1))
    text = table(rows)
    (out / "dit_bench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
