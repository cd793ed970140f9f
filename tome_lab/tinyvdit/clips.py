"""Short clips made from the tiny UNet's photos (``tome_lab.tinyldm.data``): a camera pans,
zooms or rotates over a photo, so each clip's motion is real (the same content moving) and
smooth, and a model has to learn it rather than nine unrelated frames.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

MOTIONS = ("pan", "zoom", "rotate")


def clips(photos, n: int, size: int, frames: int, generator: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` clips -> (videos (n, 3, frames, size, size) in [0, 1], class ids (n,)).

    Class-balanced, as ``data.random_crops``. Each clip: a window of ``size`` times a
    log-uniform factor in [1, 3] of a photo, the photo scaled once (antialiased) so the window
    is ``size`` px, then one motion over ``frames`` frames: a pan of 0.5-2 px per frame in a
    random direction, a zoom in or out by 15-40% over the clip, or a rotation of 2-6 degrees
    per frame; flipped left-right half the time. Only ``generator`` is used for randomness."""
    by_class: dict[int, list] = {}
    for img, c in photos:
        by_class.setdefault(c, []).append(img)
    classes = sorted(by_class)
    u = torch.rand((n, 10), generator=generator)
    out, ids = [], []
    for r in u.tolist():
        c = classes[min(int(r[0] * len(classes)), len(classes) - 1)]
        imgs = by_class[c]
        img = imgs[min(int(r[1] * len(imgs)), len(imgs) - 1)].float()[None] / 255
        _, _, h, w = img.shape
        win = min(size * math.exp(r[2] * math.log(3)), min(h, w) / 1.6)
        scale = size / win
        img = F.interpolate(img, size=(round(h * scale), round(w * scale)), mode="bilinear",
                            antialias=True)
        out.append(_move(img, size, frames, MOTIONS[min(int(r[3] * 3), 2)], r[4:]))
        if r[9] < 0.5:
            out[-1] = out[-1].flip(-1)
        ids.append(c)
    return torch.stack(out).clamp(0, 1), torch.tensor(ids, dtype=torch.long)


def _move(img: torch.Tensor, size: int, frames: int, motion: str, r: list[float]
          ) -> torch.Tensor:
    """(3, frames, size, size): ``frames`` views of ``img`` (1, 3, H, W) along ``motion``."""
    _, _, h, w = img.shape
    margin = size * 0.9  # room for the whole motion inside the photo
    cx = margin + r[0] * max(w - 2 * margin, 0)
    cy = margin + r[1] * max(h - 2 * margin, 0)
    step = torch.arange(frames, dtype=torch.float32) - (frames - 1) / 2
    angle, zoom = torch.zeros(frames), torch.ones(frames)
    dx, dy = torch.zeros(frames), torch.zeros(frames)
    if motion == "pan":
        speed, theta = 0.5 + 1.5 * r[2], 2 * math.pi * r[3]
        dx, dy = step * speed * math.cos(theta), step * speed * math.sin(theta)
    elif motion == "zoom":
        amount = (0.15 + 0.25 * r[2]) * (1 if r[3] < 0.5 else -1)
        zoom = (1 + amount) ** (step / max(frames - 1, 1))
    else:
        angle = step * math.radians(2 + 4 * r[2]) * (1 if r[3] < 0.5 else -1)
    # affine_grid: output coordinates in [-1, 1] -> input coordinates in [-1, 1]
    sx, sy = size / w, size / h
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.zeros(frames, 2, 3)
    theta[:, 0, 0], theta[:, 0, 1] = cos * sx, -sin * sy * h / w
    theta[:, 1, 0], theta[:, 1, 1] = sin * sx * w / h, cos * sy
    theta[:, 0, 2] = (cx + dx) / w * 2 - 1
    theta[:, 1, 2] = (cy + dy) / h * 2 - 1
    grid = F.affine_grid(theta, [frames, 3, size, size], align_corners=False)
    views = F.grid_sample(img.expand(frames, -1, -1, -1), grid, mode="bilinear",
                          padding_mode="reflection", align_corners=False)
    return views.transpose(0, 1)
