"""The host kit: a host's measuring service and its "measure now", once for every host.

The WebUI's Settings button and ComfyUI's measure node (and a third host's) ask the same
question: how much faster does each level run merged, per method and image size, on this
device. ``survey`` answers it through the host's measuring service (so the auto policy's cache
fills), with a reason for every size not measured (too large for the memory free, a method
with no form for the model, a contract that cannot time its blocks); ``Survey`` holds the
table rows and the plot's points and scale. A host layer renders these: HTML and SVG in the
WebUI, text and a PIL image in ComfyUI. ``service`` makes the measuring service a host keeps
one of per process: its cache file in the host's own folder (``$TOME_CACHE_DIR`` wins), its
one voice and its progress display.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import methods, policy
from .config import ToMeConfig
from .layout import read
from .measure import Measurement
from .measurements import MeasurementCache, Measurer, default_cache_path

BATCH = 2  # one image with classifier-free guidance: cond and uncond in one UNet call
HEAD = ("method", "image", "level", "tokens", "unmerged ms", "merged ms", "speed-up", "auto")


def image(latent: tuple[int, ...]) -> str:
    """A table's image column: ``512x512``, a video's ``832x480, 33 frames``."""
    return policy.size_text(latent).replace(" px", "")


@dataclass
class Survey:
    """What was measured (``found``) and what was not, as ``(method, px, why)`` (``missed``)."""

    found: list[Measurement] = field(default_factory=list)
    missed: list[tuple[str, int, str]] = field(default_factory=list)

    def rows(self) -> list[tuple[str, ...]]:
        """One row per method, size and level, as ``HEAD`` names the columns; a level whose
        rounds disagreed (``policy.uncertain``) shows their spread and ``uncertain``."""
        return [(m.method, image(m.latent), f"ds{r.level}",
                 str(r.tokens), f"{r.unmerged_ms:.1f}", f"{r.merged_ms:.1f}",
                 f"{r.speedup:.2f}x" + (f" ({r.low:.2f}-{r.high:.2f}x)" if r.uncertain() else ""),
                 "uncertain" if r.uncertain() else "merge" if policy.pays(r.speedup) else "no")
                for m in self.found for r in m.rows]

    def skipped(self) -> list[tuple[str, str, str]]:
        """``(method, image, why)`` per size not measured."""
        return [(method, f"{px}x{px}", why.removeprefix("ToMe: "))
                for method, px, why in self.missed]

    def title(self) -> str:
        first = self.found[0] if self.found else None
        where = (f"Measured on {first.device} ({first.dtype}), batch {first.batch}" if first
                 else "Nothing measured")
        return f"{where}; the auto policy merges a level from {1 + policy.MARGIN:.2f}x"

    def points(self) -> dict[str, list[tuple[int, float]]]:
        """The first level's speed-up against image width in px, per method, by size."""
        points: dict[str, list[tuple[int, float]]] = {}
        for m in self.found:
            if m.rows:
                width = policy.pixels(m.latent)[0]
                points.setdefault(m.method, []).append((width, m.rows[0].speedup))
        return {k: sorted(v) for k, v in points.items()}

    def scale(self, width: int, height: int, pad: int) -> Scale | None:
        """Where the plot's values land in a ``width x height`` picture; None: no point."""
        points = self.points()
        if not points:
            return None
        xs = [x for pts in points.values() for x, _ in pts]
        ys = [y for pts in points.values() for _, y in pts] + [1.0, 1.0 + policy.MARGIN]
        x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
        return Scale(width, height, pad, x0, x1, min(0.8, min(ys)), max(ys) * 1.1,
                     sorted(set(xs)), sorted({1.0, round(max(ys), 1)}))


@dataclass(frozen=True)
class Scale:
    """A plot's axes: ``at(x, y)`` is the pixel of image width ``x`` at speed-up ``y``."""

    width: int
    height: int
    pad: int
    x0: float
    x1: float
    y0: float
    y1: float
    x_ticks: list[int]
    y_ticks: list[float]

    def at(self, x: float, y: float) -> tuple[float, float]:
        w, h, p = self.width, self.height, self.pad
        return (p + (x - self.x0) / (self.x1 - self.x0) * (w - 2 * p),
                h - p - (y - self.y0) / (self.y1 - self.y0) * (h - 2 * p))

    @property
    def merge_line(self) -> float:
        """The height of the speed-up above which the auto policy merges."""
        return self.at(self.x0, 1 + policy.MARGIN)[1]


def survey(model: Any, sizes: Iterable[int], service: Any, runner: Callable | None,
           device: Any = None, base: ToMeConfig | None = None,
           not_timed: str = "not measured", *, remeasure: bool = False) -> Survey:
    """Measure ``model`` (anything ``layout.read`` reads) at each square size in px with each
    registered method (its defaults over ``base``), through ``service`` (a
    ``measurements.Measurer``) and ``runner`` (how the host's adapter runs a block merged;
    None where its contract cannot time this model: every size is then ``not_timed``).
    ``remeasure``: first drop the readings it would show (``Measurer.forget``: memory and
    the cache file), so every size is measured again; other sizes' readings stay."""
    out = Survey()
    base = base or ToMeConfig(policy="auto")
    layout = read(model)
    for name in methods.names():
        cfg = base.replace(method=name)
        # nothing to time (merge has no DiT form; a contract that cannot time the model)
        skip = not_timed if runner is None else layout.unmergeable(cfg)
        for px in sizes:
            if skip:
                out.missed.append((name, px, skip))
                continue
            if remeasure:
                service.forget(model, (px // 8, px // 8), BATCH, cfg)
            m = service.get(model, (px // 8, px // 8), BATCH, cfg, device=device, runner=runner)
            if m is None:
                out.missed.append((name, px, service.reason or "not measured"))
            elif not m.rows:
                out.missed.append((name, px, f"no block of this model is merged by {name}"))
            else:
                out.found.append(m)
    return out


def cache_file(folder: str | os.PathLike | None) -> Path:
    """``$TOME_CACHE_DIR/measurements.json`` if set, else ``<folder>/measurements.json`` (the
    host's own folder, made absolute), else the library's default."""
    if os.environ.get("TOME_CACHE_DIR") or not folder:
        return default_cache_path()
    return Path(folder).resolve() / "measurements.json"


def service(folder: str | os.PathLike | None, say: Callable[[str], Any],
            progress: Callable[[str | None], Any] | None = None) -> Measurer:
    """A measuring service with its cache in ``folder`` (``cache_file``), one line per event
    through ``say``, and ``progress`` shown while a size is measured."""
    return Measurer(MeasurementCache(cache_file(folder), say=say), say=say, progress=progress)
