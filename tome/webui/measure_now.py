"""Settings > ToMe > "Measure now": time the loaded model at its usual sizes, per method.

The button (``javascript/tome_measure.js``) posts to ``/tome/measure``; the answer is an HTML
table per method and an SVG plot of the speed-up against image size, with the line above which
the auto policy merges. Measuring holds the WebUI's queue lock, so it never runs beside a
generation; the results go into the same cache the generations read.
"""

from __future__ import annotations

import html
from typing import Any

from .. import methods, policy
from ..layout import UnsupportedModelError, read
from ..measure import Measurement
from ..measurements import Measurer
from . import host, narrate
from . import script_args as A

ROUTE = "/tome/measure"
HELP = ("<p>Times the loaded model on this device at its usual first-pass and hires sizes, "
        "merged and unmerged, per method (SD1/SD2: 512 to 1024 px; SDXL: 1024 and 1536 px; a "
        "minute or more on a CPU). The generations then read these results.</p>")
BATCH = 2  # one image with classifier-free guidance: cond and uncond in one UNet call
# Image sizes (px, square) of a first pass and the usual hires-fix passes.
SIZES = {"SDXL": (1024, 1536), "": (512, 768, 1024)}
COLOURS = {"merge": "#e4572e", "downsample": "#1f77b4"}


def sizes_for(model: Any) -> tuple[int, ...]:
    return SIZES["SDXL"] if host.model_kind(model) == "SDXL" else SIZES[""]


def run(model: Any, measurer: Measurer, device: Any) -> tuple[str, list[Measurement]]:
    """Measure ``model`` at its sizes with each method: (HTML, measurements). A size that is
    not measured (too large for the memory available, or measuring failed) gets a row saying
    why, and the others are still measured."""
    try:
        unet, run_block = host.measurable(model)
    except UnsupportedModelError as e:
        narrate.console(f"ToMe: Measure now: {str(e).removeprefix('ToMe: ')}")
        return f"<p>{html.escape(str(e))}; nothing to measure.</p>", []
    found: list[Measurement] = []
    missed: list[tuple[str, int, str]] = []
    for name in methods.names():  # each with its defaults (ToDo: x2)
        cfg = A.DEFAULT.replace(method=name)
        for px in sizes_for(model):
            m = measurer.get(unet, (px // 8, px // 8), BATCH, cfg, device=device,
                             runner=run_block)
            if m is None:
                missed.append((name, px, measurer.reason or "not measured"))
            elif not m.rows:  # e.g. merge on a DiT: no block this method reaches
                missed.append((name, px, _why_empty(unet, cfg)))
            else:
                found.append(m)
    return render(found, missed), found


def _why_empty(model: Any, cfg: Any) -> str:
    """Why a measurement has no row: the report of patching with ``cfg`` says it (a method
    without a DiT form, settings that reach no block)."""
    if read(model).dit is not None and cfg.method != "downsample":
        return f"{cfg.method} has no DiT form; downsample pools this model's image keys/values"
    return f"no block of this model is merged by {cfg.method}"


def render(found: list[Measurement], missed: list[tuple[str, int, str]] = ()) -> str:
    """One table of every measurement (and a row per size not measured, saying why), and the
    plot."""
    if not found and not missed:
        return "<p>ToMe: nothing to measure.</p>"
    head = ("<tr><th>method</th><th>image</th><th>level</th><th>tokens</th><th>unmerged ms</th>"
            "<th>merged ms</th><th>speed-up</th><th>auto</th></tr>")
    rows = []
    for m in found:
        h, w = m.latent
        for r in m.rows:
            rows.append(f"<tr><td>{m.method}</td><td>{w * 8}x{h * 8}</td><td>ds{r.level}</td>"
                        f"<td>{r.tokens}</td><td>{r.unmerged_ms:.1f}</td>"
                        f"<td>{r.merged_ms:.1f}</td><td>{r.speedup:.2f}x</td>"
                        f"<td>{'merge' if policy.pays(r.speedup) else 'no'}</td></tr>")
    for method, px, why in missed:
        rows.append(f"<tr><td>{html.escape(method)}</td><td>{px}x{px}</td>"
                    f"<td colspan='6'>skipped: {html.escape(why.removeprefix('ToMe: '))}"
                    "</td></tr>")
    where = (f"Measured on {html.escape(found[0].device)} ({found[0].dtype}), batch "
             f"{found[0].batch}" if found else "Nothing measured")
    title = f"{where}; the auto policy merges a level from {1 + policy.MARGIN:.2f}x"
    return (f"<p>{title}</p><table class='tome-measure'>{head}{''.join(rows)}</table>"
            f"{plot(found) if found else ''}")


def plot(found: list[Measurement], width: int = 520, height: int = 260) -> str:
    """Speed-up of the first level against image size, one line per method (inline SVG)."""
    points: dict[str, list[tuple[int, float]]] = {}
    for m in found:
        if m.rows:
            points.setdefault(m.method, []).append((m.latent[1] * 8, m.rows[0].speedup))
    if not points:
        return ""
    xs = [x for pts in points.values() for x, _ in pts]
    ys = [y for pts in points.values() for _, y in pts] + [1.0, 1.0 + policy.MARGIN]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(0.8, min(ys)), max(ys) * 1.1
    pad = 40

    def sx(x: float) -> float:
        return pad + (x - x0) / (x1 - x0) * (width - 2 * pad)

    def sy(y: float) -> float:
        return height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad)

    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             "style='background:#fff'>",
             f"<line x1='{pad}' x2='{width - pad}' y1='{sy(1 + policy.MARGIN):.1f}' "
             f"y2='{sy(1 + policy.MARGIN):.1f}' stroke='#888' stroke-dasharray='4 3'/>",
             f"<text x='{width - pad}' y='{sy(1 + policy.MARGIN) - 4:.1f}' font-size='11' "
             f"text-anchor='end' fill='#555'>merged above {1 + policy.MARGIN:.2f}x</text>"]
    for i, (method, pts) in enumerate(points.items()):
        colour = COLOURS.get(method, "#2ca02c")
        line = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in sorted(pts))
        parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='2' "
                     f"points='{line}'/>")
        parts += [f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3' fill='{colour}'/>"
                  for x, y in pts]
        parts.append(f"<text x='{width - pad}' y='{pad - 20 + 14 * i}' font-size='12' "
                     f"text-anchor='end' fill='{colour}'>{html.escape(method)}</text>")
    for x in sorted(set(xs)):
        parts.append(f"<text x='{sx(x):.1f}' y='{height - pad + 16}' font-size='11' "
                     f"text-anchor='middle'>{x} px</text>")
    parts.append(f"<text x='8' y='{pad - 20}' font-size='11'>speed-up (first level)</text>")
    for y in sorted({1.0, round(max(ys), 1)}):
        parts.append(f"<text x='{pad - 4}' y='{sy(y) + 4:.1f}' font-size='11' "
                     f"text-anchor='end'>{y:g}x</text>")
    parts.append("</svg>")
    return "".join(parts)


def register_api(demo: Any, app: Any) -> None:
    """``on_app_started``: ``POST /tome/measure`` measures the loaded model."""
    app.add_api_route(ROUTE, measure_loaded, methods=["POST"])


def measure_loaded() -> dict[str, str]:
    """Measure ``shared.sd_model`` under the queue lock; ``{"html": ...}``."""
    from modules.call_queue import queue_lock

    with queue_lock:
        model, why = host.loaded_model()
        if model is None:
            narrate.console(f"ToMe: Measure now: {why}")
            return {"html": f"<p>ToMe: {html.escape(why)}.</p>"}
        text, _ = run(model, host.measuring_service(), host.compute_device(model))
    return {"html": text}
