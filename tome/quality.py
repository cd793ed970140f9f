"""What a ToMe setting costs in image quality, measured on the small trained model.

Every setting samples the same seeds as the unmerged model, so the final images can be
compared pixel by pixel (MSE, PSNR, SSIM against the unmerged image), and the model's
denoising loss on held-out photos shows whether merging makes it a worse denoiser, not
only a different one. Sampling is timed per image, with the settings' order alternating
from image to image, so slow phases of a shared machine hit every setting alike.

    rows = evaluate(model, default_settings(), images=[(0, 0), (1, 1), (2, 2), (3, 3)])
    print(markdown_table(rows)); grid_image(rows).save("grid.png"); plot(rows, "plot.png")
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import tome

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


# ----------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Setting:
    """One way of running the model: ``tome.apply_patch`` keywords (none = unmerged)."""

    label: str
    options: dict[str, Any] = field(default_factory=dict)
    group: str = ""  # one line per group in the plot
    value: str = ""  # its point's tag in the plot

    @property
    def unmerged(self) -> bool:
        return not self.options

    @classmethod
    def parse(cls, spec: str) -> Setting:
        """``unmerged``, ``merge:0.5``, ``merge:0.5:matching=local``, ``downsample:2``...

        The syntax of ``python -m tome.bench --variant`` (``baseline`` = ``unmerged``).
        """
        from .bench import Variant

        if spec.strip() in ("unmerged", "baseline"):
            return UNMERGED
        v = Variant.parse(spec)
        if v.method == "tomesd":
            raise ValueError("tomesd is not a setting of this library; use merge")
        extra = {k: x for k, x in v.options.items() if k != "matching"}
        if v.method == "downsample":
            opts = {"method": "downsample", "downsample_factor": int(v.value), **v.options}
            name, value = "downsample", f"x{int(v.value)}"
        else:
            opts = {"ratio": v.value, **v.options}
            name, value = "merge", f"{v.value:g}"
        if v.options.get("matching") == "local":
            name += " local"
        group = " ".join([name] + [f"{k}={x}" for k, x in extra.items()])
        label = f"{name} {value}" + "".join(f" {k}={x}" for k, x in extra.items())
        return cls(label, opts, group, value)

    def variant(self):
        """The same setting as a ``tome.bench.Variant`` (for the SD-shaped UNets)."""
        from .bench import Variant

        if self.unmerged:
            return Variant("baseline")
        opts = dict(self.options)
        if opts.pop("method", "merge") == "downsample":
            return Variant("downsample", opts.pop("downsample_factor", 2), opts)
        return Variant("merge", opts.pop("ratio", 0.5), opts)


UNMERGED = Setting("unmerged")

#: The showcase's settings: each method at increasing strength, plus a timestep window.
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


def settings_from(specs: Sequence[str]) -> list[Setting]:
    """Parse specs; the unmerged reference is always first."""
    out = [Setting.parse(s) for s in specs]
    return [UNMERGED] + [s for s in out if not s.unmerged]


def default_settings() -> list[Setting]:
    return settings_from(DEFAULT_SETTINGS)


# ----------------------------------------------------------------------------- evaluation


def _patched(model, setting: Setting, seed: int):
    """Apply ``setting`` (ToMe's random cells seeded like the WebUI: with the image seed)."""
    if not setting.unmerged:
        tome.apply_patch(model, **{"seed": seed, **setting.options})


def evaluate(
    model,
    settings: Sequence[Setting],
    images: Sequence[tuple[int, int]],
    steps: int = 20,
    size: int = 64,
    bf16: bool = False,
    heldout: tuple[torch.Tensor, torch.Tensor] | None = None,
    timesteps: Sequence[int] = (100, 300, 500, 700, 900),
    loss_seed: int = 0,
    clock: str = "auto",
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """One row per setting: times, speed-up, MSE/PSNR/SSIM vs unmerged, held-out loss.

    ``images``: (class id, seed) of each image. Each is sampled alone under every setting,
    in alternating order (forward for even images, backward for odd), after a one-step
    warm-up of each setting.
    ``heldout`` = (images in [0, 1], class ids): the denoising loss is measured at each of
    ``timesteps`` with fixed noise (``loss_seed``); rows get the loss and its relative
    increase over the unmerged model. Rows also carry the images, for ``grid_image``.

    ``clock``: "wall", "cpu" (this thread's CPU time: other processes on a shared machine do
    not inflate it; equals wall time on an idle one) or "auto" (cpu when torch runs on one
    thread, else wall). Rows record which was used.
    """
    from .tinyldm import denoising_loss, sample

    settings = list(settings)
    if clock == "auto":
        clock = "cpu" if torch.get_num_threads() == 1 else "wall"
    now = time.thread_time if clock == "cpu" else time.perf_counter
    if not settings or not settings[0].unmerged:
        raise ValueError("the first setting must be the unmerged reference")
    jobs = [(int(c), int(s)) for c, s in images]
    n = len(settings)
    times: list[list[float]] = [[] for _ in range(n)]
    out: list[list[torch.Tensor]] = [[None] * len(jobs) for _ in range(n)]
    say = progress or (lambda _msg: None)

    for st in settings:  # warm-up: first-call costs are not timed
        _patched(model, st, 0)
        try:
            sample(model, [jobs[0][0]], seed=0, steps=1, size=size, bf16=bf16)
        finally:
            tome.remove_patch(model)
    for j, (c, s) in enumerate(jobs):
        order = range(n) if j % 2 == 0 else reversed(range(n))
        for i in order:
            say(f"image {j + 1}/{len(jobs)}: {settings[i].label}")
            _patched(model, settings[i], s)
            try:
                t0 = now()
                img = sample(model, [c], seed=s, steps=steps, size=size, bf16=bf16)
                times[i].append(now() - t0)
            finally:
                tome.remove_patch(model)
            out[i][j] = img[0]

    ref = torch.stack(out[0])
    base_time = statistics.median(times[0])
    rows = []
    for i, st in enumerate(settings):
        imgs = torch.stack(out[i])
        p = psnr(imgs, ref)
        finite = p[torch.isfinite(p)]
        med = statistics.median(times[i])
        rows.append({
            "setting": st.label, "group": st.group, "value": st.value,
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
            _patched(model, st, loss_seed)
            try:
                with torch.no_grad():
                    rows[i]["loss"] = {
                        int(t): float(denoising_loss(model, hx, hy, int(t), loss_seed, bf16))
                        for t in timesteps}
            finally:
                tome.remove_patch(model)
        base = rows[0]["loss"]
        for r in rows:
            r["loss_increase"] = {t: r["loss"][t] / base[t] - 1 for t in base}
    return rows


def sd_deviation(settings: Sequence[Setting], model: str = "sd15", size: int = 512,
                 dtype: str = "bf16", repeats: int = 0, progress: bool = False):
    """The same settings on an SD-shaped UNet (random weights) with ``tome.bench``.

    Returns bench rows: ``deviation`` is ||out - unmerged|| / ||unmerged|| of one UNet call
    (at t=500, so a timestep window ending before the middle leaves it unchanged). Speed is
    only timed with ``repeats`` > 0; ``python -m tome.bench`` measures it properly.
    """
    from . import bench

    case = bench.build_case(model, size, dtype)
    return bench.run_benchmark([case], [s.variant() for s in settings], repeats=repeats,
                               measure=False, progress=progress)


# ----------------------------------------------------------------------------- reporting


def _num(v: float, fmt: str) -> str:
    return "∞" if math.isinf(v) else format(v, fmt)


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (images and raw times left out).

    Loss columns appear when the rows have held-out losses, an SD1.5 column when
    ``sd_deviation`` was added to them (see ``python -m tome.showcase --sd``).
    """
    ts = list(rows[0].get("loss", {}))
    head = ["setting", "s / image", "speed-up", "MSE", "PSNR (dB)", "SSIM"]
    head += [f"loss Δ t={t}" for t in ts]
    sd = "sd_deviation" in rows[0]
    if sd:
        head.append("SD1.5 deviation")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["setting"], f"{r['time']:.2f}", f"{r['speedup']:.2f}x",
                 f"{r['mse']:.1e}", _num(r["psnr"], ".1f"), f"{r['ssim']:.4f}"]
        cells += [f"{100 * r['loss_increase'][t]:+.1f}%" for t in ts]
        if sd:
            cells.append(f"{r['sd_deviation']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


def equal_speed_table(rows: Sequence[dict[str, Any]], speedups: Sequence[float] = (1.5, 2.0)
                      ) -> str:
    """Markdown: one line per method, PSNR / SSIM (/ loss increase) at each speed-up."""
    pts = at_equal_speed(rows, speedups)
    loss = any("loss" in p for p in pts)
    head = ["method"] + [f"at {x:g}x" for x in speedups]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(p["group"] for p in pts):
        cells = [name]
        for p in (p for p in pts if p["group"] == name):
            if "mse" not in p:
                cells.append("– (not that fast)")
                continue
            text = f"{_num(p['psnr'], '.1f')} dB, SSIM {p['ssim']:.4f}"
            cells.append(text + (f", loss Δ {100 * p['loss']:+.2f}%" if loss else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # scalable font: Pillow >= 10.1 + FreeType
    except (TypeError, OSError):
        return ImageFont.load_default()


def caption(row: dict[str, Any], j: int) -> list[str]:
    """Caption lines of image ``j`` of a row: setting, time, distance to the unmerged image."""
    t = row["per_image"]["time"][j]
    if row["unmerged"]:
        return [row["setting"], f"{t:.1f} s", "reference"]
    p, s = row["per_image"]["psnr"][j], row["per_image"]["ssim"][j]
    return [row["setting"], f"{t:.1f} s ({row['speedup']:.2f}x)",
            f"PSNR {_num(p, '.1f')}  SSIM {s:.3f}"]


def _tile(x: torch.Tensor, size: tuple[int, int]):
    from PIL import Image

    t = (x.float().clamp(0, 1) * 255).round().byte()
    t = t.expand(3, *t.shape[-2:]) if t.dim() == 2 or t.shape[0] == 1 else t
    return Image.fromarray(t.permute(1, 2, 0).numpy()).resize(size, Image.NEAREST)


def grid_image(rows: Sequence[dict[str, Any]], scale: int = 3, row_labels=None,
               diff_gain: float = 0):
    """A PIL image: one column per setting, one row per (class, seed), captions under each.

    ``diff_gain`` > 0 adds under each row its differences from the unmerged image,
    |image - unmerged| (mean of the channels) times the gain, dark on white: changes far
    too small to see in the images themselves show where merging acted.
    """
    from PIL import Image, ImageDraw

    ncol, nrow = len(rows), len(rows[0]["jobs"])
    h, w = rows[0]["images"].shape[-2:]
    tw, th = w * scale, h * scale
    texts = [t for r in rows for j in range(nrow) for t in caption(r, j)]
    fs = max(9, min(16, tw // 12))
    while fs > 9 and max(_font(fs).getlength(t) for t in texts) > tw:
        fs -= 1  # the widest caption fits under its image
    font = _font(fs)
    line = fs + 4
    pad = 8
    block = th + 3 * line + 6 + pad + (th + line + 6 + pad if diff_gain else 0)
    left = 0 if row_labels is None else int(max(font.getlength(t) for t in row_labels)) + pad
    img = Image.new("RGB", (left + pad + ncol * (tw + pad), pad + nrow * block), "white")
    draw = ImageDraw.Draw(img)
    ref = next(r for r in rows if r["unmerged"])["images"]
    for j in range(nrow):
        y = pad + j * block
        if row_labels is not None:
            draw.text((pad, y + th // 2 - fs), row_labels[j], fill="black", font=font)
        for i, r in enumerate(rows):
            x = left + pad + i * (tw + pad)
            img.paste(_tile(r["images"][j], (tw, th)), (x, y))
            for k, text in enumerate(caption(r, j)):
                draw.text((x, y + th + 3 + k * line), text, fill="black", font=font)
            if not diff_gain:
                continue
            yd = y + th + 3 * line + 6 + pad
            if r["unmerged"]:
                draw.text((x, yd + th // 2 - line), f"differences x{diff_gain:g}",
                          fill="black", font=font)
                draw.text((x, yd + th // 2), "(white = same)", fill="black", font=font)
                continue
            d = (r["images"][j].float() - ref[j].float()).abs().mean(0) * diff_gain
            img.paste(_tile(1 - d, (tw, th)), (x, yd))
            draw.rectangle((x, yd, x + tw - 1, yd + th - 1), outline=(200, 200, 200))
            mx = (r["images"][j].float() - ref[j].float()).abs().max().item()
            draw.text((x, yd + th + 3), f"max diff {255 * mx:.0f}/255", fill="black", font=font)
    return img


def plot(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> str:
    """Quality against speed-up, one line per method: PSNR, SSIM and held-out loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("psnr", "PSNR vs unmerged (dB, higher = closer)"),
              ("ssim", "SSIM vs unmerged (higher = closer)")]
    if "loss_increase" in rows[0]:
        t = loss_at(rows[0])[0]
        panels.append(("loss", f"held-out loss increase at t={t} (%, lower = better)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.3))
    groups: dict[str, list] = {}
    for r in rows:
        if not r["unmerged"]:
            groups.setdefault(r["group"], []).append(r)

    def y_of(r, key):
        return 100 * loss_at(r)[1] if key == "loss" else r[key]

    for ax, (key, label) in zip(axes, panels):
        for (name, g), marker in zip(groups.items(), itertools.cycle("osD^v<>p*hX")):
            g = sorted(g, key=lambda r: r["speedup"])
            xs, ys = [r["speedup"] for r in g], [y_of(r, key) for r in g]
            ax.plot(xs, ys, marker=marker, ls="-" if len(g) > 1 else "", label=name)
            for r, x, y in zip(g, xs, ys):
                ax.annotate(r["value"], (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
        if key == "loss":
            ax.axhline(0, color="grey", lw=0.8, ls="--")
        ax.set(xlabel="speed-up vs unmerged (sampling time)", ylabel=label)
        ax.grid(alpha=0.3)
    if len(groups) <= 5:
        axes[0].legend(fontsize=8)
    else:  # many settings: keep the points visible
        axes[-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
