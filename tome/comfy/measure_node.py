"""The measure node's work: time a ComfyUI model at the given sizes with each method (through
the measuring service, so the auto policy's cache fills), and show it as a text table and a
plot image (PIL, which ComfyUI requires; ComfyUI's IMAGE is a ``[1, H, W, 3]`` float tensor in
[0, 1])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import methods, patcher, policy
from ..layout import UnsupportedModelError, read
from ..measure import Measurement
from ..measurements import Measurer
from .inputs import DEFAULT

SIZES = "512,768,1024"
BATCH = 2  # one image with classifier-free guidance: cond and uncond in one UNet call
COLOURS = {"merge": (228, 87, 46), "downsample": (31, 119, 180)}


def parse_sizes(text: str) -> list[int]:
    """``"512, 768"`` -> ``[512, 768]``; a clear ``ValueError`` otherwise."""
    sizes = []
    for part in str(text).replace(";", ",").split(","):
        part = part.strip().lower().removesuffix("px").strip()
        if not part:
            continue
        try:
            px = int(part)
        except ValueError:
            raise ValueError(f"ToMe: invalid size {part!r}: expected square sizes in px, e.g. "
                             f"{SIZES!r}") from None
        if px < 64 or px > 8192 or px % 8:
            raise ValueError(f"ToMe: invalid size {px}: must be a multiple of 8 in [64, 8192]")
        sizes.append(px)
    if not sizes:
        raise ValueError(f"ToMe: no size to measure: give sizes in px, e.g. {SIZES!r}")
    return sizes


def run(model: Any, sizes: list[int], service: Measurer,
        load: Callable[[Any], Any] = lambda m: None) -> tuple[str, torch.Tensor]:
    """``(table, plot)`` of ``model`` (a ModelPatcher) at ``sizes`` with each method. A model
    without UNet transformer blocks, or a size not measured, is a line in the table."""
    try:
        layout = read(getattr(model, "model", None))
    except UnsupportedModelError as e:
        line = f"{e}; nothing to measure"
        service.say(line)
        return line, plot([])
    runner = patcher.block_runner(layout)
    device = load(model) if runner is not None else None
    found: list[Measurement] = []
    missed: list[tuple[str, int, str]] = []
    for name in methods.names():  # each with its defaults (ToDo: x2)
        cfg = DEFAULT.replace(method=name)
        for px in sizes:
            if runner is None:
                missed.append((name, px, f"not measured: {patcher.NOT_TIMED}"))
                continue
            m = service.get(layout, (px // 8, px // 8), BATCH, cfg, device=device,
                            runner=runner)
            if m is None:
                missed.append((name, px, service.reason or "not measured"))
            else:
                found.append(m)
    return table(found, missed), plot(found)


def table(found: list[Measurement], missed: list[tuple[str, int, str]] = ()) -> str:
    """A fixed-width text table, one row per method, size and level."""
    head = ("method", "image", "level", "tokens", "unmerged ms", "merged ms", "speed-up", "auto")
    rows = [[m.method, f"{m.latent[1] * 8}x{m.latent[0] * 8}", f"ds{r.level}", str(r.tokens),
             f"{r.unmerged_ms:.1f}", f"{r.merged_ms:.1f}", f"{r.speedup:.2f}x",
             "merge" if policy.pays(r.speedup) else "no"] for m in found for r in m.rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in (head, *rows)]
    lines += [f"{method}  {px}x{px}  skipped: {why.removeprefix('ToMe: ')}"
              for method, px, why in missed]
    where = (f"Measured on {found[0].device} ({found[0].dtype}), batch {found[0].batch}"
             if found else "Nothing measured")
    return "\n".join([f"{where}; the auto policy merges a level from "
                      f"{1 + policy.MARGIN:.2f}x", *lines])


def plot(found: list[Measurement], width: int = 640, height: int = 320) -> torch.Tensor:
    """Speed-up of the first level against image size, one line per method, with the line
    above which the auto policy merges: ``[1, height, width, 3]`` floats in [0, 1]."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    points: dict[str, list[tuple[int, float]]] = {}
    for m in found:
        if m.rows:
            points.setdefault(m.method, []).append((m.latent[1] * 8, m.rows[0].speedup))
    if not points:
        draw.text((20, height // 2), "nothing measured", fill=(0, 0, 0))
        return _tensor(img)
    xs = [x for pts in points.values() for x, _ in pts]
    ys = [y for pts in points.values() for _, y in pts] + [1.0, 1.0 + policy.MARGIN]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(0.8, min(ys)), max(ys) * 1.1
    pad = 48

    def at(x: float, y: float) -> tuple[float, float]:
        return (pad + (x - x0) / (x1 - x0) * (width - 2 * pad),
                height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad))

    draw.line([(pad, height - pad), (width - pad, height - pad)], fill=(0, 0, 0))
    draw.line([(pad, pad), (pad, height - pad)], fill=(0, 0, 0))
    line_y = at(x0, 1 + policy.MARGIN)[1]
    for x in range(pad, width - pad, 8):
        draw.line([(x, line_y), (x + 4, line_y)], fill=(136, 136, 136))
    draw.text((width - pad - 150, line_y - 14), f"merged above {1 + policy.MARGIN:.2f}x",
              fill=(85, 85, 85))
    for i, (method, pts) in enumerate(points.items()):
        colour = COLOURS.get(method, (44, 160, 44))
        xy = [at(x, y) for x, y in sorted(pts)]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for px, py in xy:
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
        draw.text((width - pad - 80, 8 + 14 * i), method, fill=colour)
    for x in sorted(set(xs)):
        px, _ = at(x, y0)
        draw.text((px - 16, height - pad + 6), f"{x} px", fill=(0, 0, 0))
    for y in sorted({1.0, round(max(ys), 1)}):
        _, py = at(x0, y)
        draw.text((4, py - 6), f"{y:g}x", fill=(0, 0, 0))
    draw.text((8, 8), "speed-up (first level)", fill=(0, 0, 0))
    return _tensor(img)


def _tensor(img: Any) -> torch.Tensor:
    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return (data.view(img.height, img.width, 3).float() / 255.0).unsqueeze(0)
