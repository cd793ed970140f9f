"""What a ToMe setting costs in image quality, measured on the small trained model.

Every setting samples the same seeds as the unmerged model, so the final images can be
compared pixel by pixel (MSE, PSNR, SSIM against the unmerged image), and the model's
denoising loss on held-out photos shows whether merging makes it a worse denoiser, not
only a different one. Sampling is timed per image, with the settings' order alternating
from image to image, so slow phases of a shared machine hit every setting alike.

    rows = evaluate(model, parse_settings(["merge:0.5", "downsample:2"]),
                    images=[(0, 0), (1, 1), (2, 2), (3, 3)])
    print(report.quality_table(rows)); report.grid_image(rows).save("grid.png")
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .settings import Setting
from .timing import Timer

# ----------------------------------------------------------------------------- metrics


def mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean squared error per image: (B, C, H, W) x2 -> (B,)."""
    return (a.float() - b.float()).pow(2).flatten(1).mean(1)


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB per image; ``inf`` for identical images."""
    return 10 * torch.log10(data_range**2 / mse(a, b))


def _gaussian(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-(x**2) / (2 * sigma**2))
    return g / g.sum()


def ssim(
    a: torch.Tensor,
    b: torch.Tensor,
    data_range: float = 1.0,
    window: int = 11,
    sigma: float = 1.5,
    k1: float = 0.01,
    k2: float = 0.03,
) -> torch.Tensor:
    """Structural similarity per image (Wang et al. 2004): (B, C, H, W) x2 -> (B,).

    The standard form: an 11x11 Gaussian window (sigma 1.5) over each channel, constants
    (0.01 L)^2 and (0.03 L)^2, statistics over "valid" windows only (no padding), and the
    map averaged over pixels and channels. Computed in float64, so it is exactly 1 for
    identical images.
    """
    a, b = a.double(), b.double()
    c = a.shape[1]
    g = _gaussian(window, sigma)
    kernel = (g[:, None] * g[None, :]).expand(c, 1, window, window)

    def blur(x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, kernel, groups=c)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a**2
    var_b = blur(b * b) - mu_b**2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    num = (2 * mu_a * mu_b + c1) * (2 * cov + c2)
    den = (mu_a**2 + mu_b**2 + c1) * (var_a + var_b + c2)
    return (num / den).flatten(1).mean(1).float()


# ----------------------------------------------------------------------------- evaluation


def heldout_batch(n: int, size: int, cache: str | None = None
                  ) -> tuple[torch.Tensor | None, str | None]:
    """The fixed held-out photo batch, or None and the reason if the photos are unavailable."""
    from .tinyldm import data

    try:
        return data.heldout_batch(n, size, seed=0, cache_dir=cache), None
    except (RuntimeError, OSError, FileNotFoundError) as e:
        return None, str(e).splitlines()[0][:200]


def evaluate(
    model,
    settings: Sequence[Setting],
    images: Sequence[tuple[int, int]],
    steps: int = 20,
    size: int = 64,
    dtype: torch.dtype | str | None = None,
    heldout: tuple[torch.Tensor, torch.Tensor] | None = None,
    timesteps: Sequence[int] = (100, 300, 500, 700, 900),
    loss_seed: int = 0,
    clock: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per setting: times, speed-up, MSE/PSNR/SSIM vs unmerged, held-out loss.

    ``images``: (class id, seed) of each image. Each is sampled alone under every setting,
    in alternating order (forward for even images, backward for odd), after a one-step
    warm-up of each setting. ``dtype``: the compute dtype of sampling (see
    ``tinyldm.sample``; None = fp32). ToMe's random cells are seeded with the image seed, as
    the WebUI does.
    ``heldout`` = (images in [0, 1], class ids): the denoising loss is measured at each of
    ``timesteps`` with fixed noise (``loss_seed``); rows get the loss and its relative
    increase over the unmerged model. Rows also carry the images, for ``grid_image``.

    ``clock``: "wall", "cpu" (this thread's CPU time: other processes on a shared machine do
    not inflate it; equals wall time on an idle one) or "auto" (cpu when torch runs on one
    thread on the CPU, else wall). Rows record which was used.
    """
    from .tinyldm import denoising_loss, sample

    settings = list(settings)
    device = next(model.parameters()).device
    if clock == "auto":
        clock = "cpu" if torch.get_num_threads() == 1 and device.type == "cpu" else "wall"
    timer = Timer(device, clock)
    if not settings or not settings[0].unmerged:
        raise ValueError("the first setting must be the unmerged reference")
    jobs = [(int(c), int(s)) for c, s in images]
    n = len(settings)
    times: list[list[float]] = [[] for _ in range(n)]
    out: list[list[torch.Tensor]] = [[None] * len(jobs) for _ in range(n)]
    say = progress or (lambda _msg: None)

    for st in settings:  # warm-up: first-call costs are not timed
        st.apply(model, seed=0)
        try:
            sample(model, [jobs[0][0]], seed=0, steps=1, size=size, dtype=dtype)
        finally:
            st.remove(model)
    for j, (c, s) in enumerate(jobs):
        order = range(n) if j % 2 == 0 else reversed(range(n))
        for i in order:
            say(f"image {j + 1}/{len(jobs)}: {settings[i].label}")
            settings[i].apply(model, seed=s)
            try:
                dt, img = timer(lambda c=c, s=s: sample(model, [c], seed=s, steps=steps,
                                                        size=size, dtype=dtype))
                times[i].append(dt)
            finally:
                settings[i].remove(model)
            out[i][j] = img[0].cpu()

    ref = torch.stack(out[0])
    base_time = statistics.median(times[0])
    rows = []
    for i, st in enumerate(settings):
        imgs = torch.stack(out[i])
        p = psnr(imgs, ref)
        finite = p[torch.isfinite(p)]
        med = statistics.median(times[i])
        rows.append({
            "setting": st.label, "group": st.group, "value": st.value_text, "spec": st.spec,
            "options": dict(st.options),
            "unmerged": st.unmerged, "times": times[i], "time": med, "clock": clock,
            "speedup": base_time / med,
            "mse": float(mse(imgs, ref).mean()),
            "psnr": float(finite.mean()) if len(finite) else math.inf,
            "ssim": float(ssim(imgs, ref).mean()),
            "per_image": {"time": times[i], "psnr": p.tolist(),
                          "ssim": ssim(imgs, ref).tolist()},
            "images": imgs, "jobs": jobs,
        })
    if heldout is not None:
        hx, hy = heldout
        for i, st in enumerate(settings):
            say(f"held-out loss: {st.label}")
            st.apply(model, seed=loss_seed)
            try:
                with torch.no_grad():
                    rows[i]["loss"] = {
                        int(t): float(denoising_loss(model, hx, hy, int(t), loss_seed,
                                                     dtype=dtype))
                        for t in timesteps}
            finally:
                st.remove(model)
        base = rows[0]["loss"]
        for r in rows:
            r["loss_increase"] = {t: r["loss"][t] / base[t] - 1 for t in base}
    return rows


def sd_deviation(settings: Sequence[Setting], model: str = "sd15", size: int = 512,
                 dtype: str | None = None, progress: bool = False) -> list[dict[str, Any]]:
    """The same settings on an SD-shaped UNet (random weights), one call each on the CPU.

    Returns benchmark rows: ``deviation`` is ||out - unmerged|| / ||unmerged|| of one UNet
    call (at t=500, so a timestep window ending before the middle leaves it unchanged). Speed
    is not timed; ``python -m tome.bench`` measures it. ``dtype``: None picks it for the CPU.
    """
    from .device import pick_dtype
    from .models import build_case
    from .run import run_benchmark

    dtype = dtype or pick_dtype("cpu")[0]
    case = build_case(model, size, dtype)
    return run_benchmark([case], settings, repeats=0, measure=False, progress=progress,
                         warmup=1)


# ----------------------------------------------------------------------------- analysis


def loss_at(row: dict[str, Any]) -> tuple[int, float]:
    """(t, relative loss increase) at the row's lowest timestep: the one the plot and the
    equal-speed table use. Near the end of sampling the model refines detail with
    full-resolution attention, so merging costs most there; at high noise the loss moves
    by less than the spread between crops.
    """
    t = min(row["loss_increase"])
    return t, row["loss_increase"][t]


def at_equal_speed(rows: Sequence[dict[str, Any]], speedups: Sequence[float] = (1.5, 2.0)
                   ) -> list[dict[str, Any]]:
    """Each method's quality at the same speed-ups, interpolated along its points.

    Every method's curve starts at the unmerged point (speed-up 1, MSE 0, SSIM 1: ratio 0
    is bit-exact), then follows its settings by speed-up; MSE, SSIM and the held-out loss
    increase at the lowest timestep (see ``loss_at``) are interpolated linearly, never
    extrapolated (left out past the method's fastest setting).
    """
    base = next(r for r in rows if r["unmerged"])
    groups: dict[str, list] = {}
    for r in rows:
        if not r["unmerged"]:
            groups.setdefault(r["group"], []).append(r)
    keys = ["mse", "ssim"] + (["loss"] if "loss_increase" in base else [])

    def val(r, k):
        return loss_at(r)[1] if k == "loss" else r[k]

    out = []
    for name, g in groups.items():
        pts = [(1.0, {k: val(base, k) for k in keys})]
        pts += sorted(((r["speedup"], {k: val(r, k) for k in keys}) for r in g),
                      key=lambda p: p[0])
        for x in speedups:
            row: dict[str, Any] = {"group": name, "speedup": x}
            for (x0, v0), (x1, v1) in zip(pts, pts[1:]):
                if x0 <= x <= x1 and x1 > x0:
                    w = (x - x0) / (x1 - x0)
                    row.update({k: v0[k] + w * (v1[k] - v0[k]) for k in keys})
                    break
            if "mse" in row:
                row["psnr"] = 10 * math.log10(1 / row["mse"]) if row["mse"] > 0 else math.inf
            out.append(row)
    return out
