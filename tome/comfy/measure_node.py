"""The measure node's work: time a ComfyUI model at the given sizes with each method (through
the measuring service, so the auto policy's cache fills), and show it as a text table and a
plot image (PIL, which ComfyUI requires; ComfyUI's IMAGE is a ``[1, H, W, 3]`` float tensor in
[0, 1])."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import adapters, policy
from ..layout import UnsupportedModelError, read
from ..measurements import Measurer
from ..survey import HEAD, Survey, survey
from .inputs import DEFAULT

SIZES = "512,768,1024"
# The node's ``remeasure`` input (optional: a workflow saved before it still loads).
REMEASURE = ("BOOLEAN", {"default": False, "tooltip": (
    "Drop the saved readings of these sizes and measure them again (a reading taken while "
    "the machine was busy, or marked uncertain). Off: sizes already measured are reused.")})
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
        load: Callable[[Any], Any] = lambda m: None, remeasure: bool = False
        ) -> tuple[str, torch.Tensor]:
    """``(table, plot)`` of ``model`` (a ModelPatcher) at ``sizes`` with each method. A model
    without UNet transformer blocks, or a size not measured, is a line in the table.
    ``remeasure``: the readings of these sizes are dropped first and taken again."""
    try:
        layout = read(getattr(model, "model", None))
    except UnsupportedModelError as e:
        line = f"{e}; nothing to measure"
        service.say(line)
        return line, plot(Survey())
    runner = adapters.runner(layout, adapters.MODEL_PATCHER)
    device = load(model) if runner is not None else None
    found = survey(layout, sizes, service, runner, device, DEFAULT,
                   not_timed=f"not measured: {adapters.NOT_TIMED}", remeasure=bool(remeasure))
    return table(found), plot(found)


def table(found: Survey) -> str:
    """A fixed-width text table, one row per method, size and level."""
    rows = found.rows()
    widths = [max(len(str(c)) for c in col) for col in zip(HEAD, *rows)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in (HEAD, *rows)]
    lines += [f"{method}  {image}  skipped: {why}" for method, image, why in found.skipped()]
    return "\n".join([found.title(), *lines])


def plot(found: Survey, width: int = 640, height: int = 320) -> torch.Tensor:
    """Speed-up of the first level against image size, one line per method, with the line
    above which the auto policy merges: ``[1, height, width, 3]`` floats in [0, 1]."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    scale = found.scale(width, height, 48)
    if scale is None:
        draw.text((20, height // 2), "nothing measured", fill=(0, 0, 0))
        return _tensor(img)
    pad, line = scale.pad, scale.merge_line
    draw.line([(pad, height - pad), (width - pad, height - pad)], fill=(0, 0, 0))
    draw.line([(pad, pad), (pad, height - pad)], fill=(0, 0, 0))
    for x in range(pad, width - pad, 8):
        draw.line([(x, line), (x + 4, line)], fill=(136, 136, 136))
    draw.text((width - pad - 150, line - 14), f"merged above {1 + policy.MARGIN:.2f}x",
              fill=(85, 85, 85))
    for i, (method, pts) in enumerate(found.points().items()):
        colour = COLOURS.get(method, (44, 160, 44))
        xy = [scale.at(x, y) for x, y in pts]
        if len(xy) > 1:
            draw.line(xy, fill=colour, width=2)
        for px, py in xy:
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
        draw.text((width - pad - 80, 8 + 14 * i), method, fill=colour)
    for x in scale.x_ticks:
        draw.text((scale.at(x, scale.y0)[0] - 16, height - pad + 6), f"{x} px", fill=(0, 0, 0))
    for y in scale.y_ticks:
        draw.text((4, scale.at(scale.x0, y)[1] - 6), f"{y:g}x", fill=(0, 0, 0))
    draw.text((8, 8), "speed-up (first level)", fill=(0, 0, 0))
    return _tensor(img)


def _tensor(img: Any) -> torch.Tensor:
    data = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8)
    return (data.view(img.height, img.width, 3).float() / 255.0).unsqueeze(0)
