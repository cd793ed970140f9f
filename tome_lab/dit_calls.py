"""One self-attention call of ComfyUI's DiT families that the library pools only through
ComfyUI's attention override (Lumina 2, Z-Image, LTX-Video, Cosmos predict2, Kandinsky 5,
CogVideoX): no diffusers family of the library runs them, so ``dit_bench`` times the call the
override changes, at the released models' head counts and widths and the token counts their VAEs and
patches give: unpooled, the image keys/values pooled x2 and x4 (the pooling and the
``log(cell size)`` mask counted in, as the override runs it), and the ceiling (no image
keys: a joint call keeps its text's, an image-only call one key). Speed-ups are of that one
call, not of a whole forward.

Shapes (each model's config as ComfyUI's detection reads it): Lumina-Image 2.0 2304 wide, 24
heads, Gemma-2 text (256 tokens), joint [text, image]; Z-Image 3840 wide, 30 heads, Qwen3 text
(256 tokens), caption and image padded to 32, joint; LTX-Video 2048 wide, 32 heads, VAE 32x
in space and 8x in time, patch 1, video-only self-attention; Cosmos predict2 2B 2048 wide, 16
heads, Wan VAE (8x, 4x), patch 2, image/video-only; Kandinsky 5 video lite 1792 wide, 28 heads
of 64, and Kandinsky 5 image 2560 wide, 20 heads of 128, VAE 8x (video: 4x in time), patch 2,
visual-only; CogVideoX 5B 3072 wide, 48 heads of 64, T5 text (226 tokens), joint [text,
video], VAE (8x, 4x), patch 2.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tome import dit


@dataclass(frozen=True)
class Shape:
    """One family's self-attention call: heads x head dim, the text in it (0: image only),
    latent px per token side, video frames per latent frame, the padding multiple."""

    heads: int
    head_dim: int
    text: int
    px_per_token: int
    frames_per_latent: int = 4
    pad: int = 0

    def grid(self, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
        t = (frames - 1) // self.frames_per_latent + 1
        return (t, math.ceil(height / self.px_per_token), math.ceil(width / self.px_per_token))


SHAPES = {
    "lumina2": Shape(24, 96, 256, 16),
    "z-image": Shape(30, 128, 256, 16, pad=32),
    "ltxv": Shape(32, 64, 0, 32, 8),
    "cosmos2": Shape(16, 128, 0, 16),
    "kandinsky5": Shape(28, 64, 0, 16),
    "kandinsky5-image": Shape(20, 128, 0, 16),
    "cogvideox": Shape(48, 64, 226, 16),
}
IMAGE_CALLS = ("lumina2", "z-image", "cosmos2", "kandinsky5-image")
VIDEO_CALLS = ("ltxv", "cosmos2", "kandinsky5", "cogvideox")


def tiny(shape: Shape) -> Shape:
    """The shape at a tiny width (two heads of 16), text and padding of 8 where it has them."""
    return replace(shape, heads=2, head_dim=16, text=8 if shape.text else 0,
                   pad=8 if shape.pad else 0)


def _padded(n: int, multiple: int) -> int:
    return n + (-n) % multiple if multiple else n


def tensors(shape: Shape, grid: tuple[int, int, int], dtype: torch.dtype,
            device: torch.device | str) -> tuple[torch.Tensor, int, int]:
    """Random ``[1, heads, S, D]`` queries (keys and values alike), the image's start and the
    sequence length: ``[text (padded), image (padded)]`` or the image alone."""
    image = math.prod(grid)
    text = _padded(shape.text, shape.pad)
    n = text + _padded(image, shape.pad)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, shape.heads, n, shape.head_dim, generator=g).to(device, dtype)
    return q, text, n


def variants(q: torch.Tensor, start: int, grid: tuple[int, int, int]) -> dict[str, Any]:
    """Name -> a call: unpooled, pooled x2 / x4 (with the bias mask), the ceiling."""
    frames, h, w = grid
    image = frames * h * w

    def pooled(f: int):
        plan = dit.DitPlan(h, w, f, "before", True, frames)

        def call():
            k = plan.pool(q, start, 2)
            v = plan.pool(q, start, 2)
            mask = plan.bias(start, q.shape[2], q.device).to(q.dtype).view(1, 1, 1, -1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return call

    keep = q[:, :, :start] if start else q[:, :, :1]
    tail = q[:, :, start + image:]
    ceiling = torch.cat([keep, tail], 2)
    return {"none": lambda: F.scaled_dot_product_attention(q, q, q),
            "x2": pooled(2), "x4": pooled(4),
            "ceiling": lambda: F.scaled_dot_product_attention(q, ceiling, ceiling)}


def run(family: str, size: Any, rounds: int, dtype: torch.dtype, device: torch.device,
        quick: bool, synchronize) -> dict[str, Any]:
    """One size's row: every variant ``rounds`` times, interleaved, medians; ``of_ceiling``:
    the share of the ceiling's saving each pooled variant gets."""
    shape = tiny(SHAPES[family]) if quick else SHAPES[family]
    grid = shape.grid(size.width, size.height, size.frames)
    q, start, n = tensors(shape, grid, dtype, device)
    calls = variants(q, start, grid)
    times: dict[str, list[float]] = {k: [] for k in calls}
    with torch.no_grad():
        for fn in calls.values():  # warm-up
            fn()
        for r in range(rounds):
            for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
                synchronize(device)
                t0 = time.perf_counter()
                out = calls[name]()
                synchronize(device)
                times[name].append(time.perf_counter() - t0)
                if not torch.isfinite(out).all():
                    raise RuntimeError(f"{family} {size.label} {name}: non-finite output")
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    save = ms["none"] - ms["ceiling"]
    return {"family": family, "px": size.label, "frames": size.frames,
            "image_tokens": math.prod(grid), "text_tokens": start, "sequence": n,
            "heads": shape.heads, "head_dim": shape.head_dim, "rounds": rounds, "call_ms": ms,
            "speedup": {k: ms["none"] / v for k, v in ms.items()},
            "of_ceiling": {k: (ms["none"] - ms[k]) / save if save > 0 else None
                           for k in ("x2", "x4")}}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model (one self-attention call) | px | image tokens | sequence | unpooled | "
             "x2 | x4 | ceiling | x2 of the ceiling's saving |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, ms, of = r["speedup"], r["call_ms"], r["of_ceiling"]["x2"]
        lines.append(f"| {r['family']} | {r['px']} | {r['image_tokens']} | {r['sequence']} | "
                     f"{ms['none']:.1f} ms | " + " | ".join(
                         f"{ms[k]:.1f} ms, {s[k]:.2f}x" for k in ("x2", "x4", "ceiling"))
                     + f" | {'-' if of is None else f'{of:.0%}'} |")
    return "\n".join(lines)
