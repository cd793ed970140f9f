"""Settings > ToMe > "Measure now": time the loaded model at its usual sizes, per method.

The button (``javascript/tome_measure.js``) posts to ``/tome/measure``; the answer is an HTML
table per method and an SVG plot of the speed-up against image size, with the line above which
the auto policy merges. Measuring holds the WebUI's queue lock, so it never runs beside a
generation; the results go into the same cache the generations read.
"""

from __future__ import annotations

import html
from typing import Any

from .. import policy
from ..layout import UnsupportedModelError
from ..measure import Measurement
from ..measurements import Measurer
from ..survey import HEAD, Survey, survey
from . import host, narrate
from . import script_args as A

ROUTE = "/tome/measure"
HELP = ("<p>Times the loaded model on this device at its usual first-pass and hires sizes, "
        "merged and unmerged, per method (SD1, SD2, SD3: 512 to 1024 px; SDXL: 1024 and 1536 px; "
        "a minute or more on a CPU). The generations then read these results.</p>")
# Image sizes (px, square) of a first pass and the usual hires-fix passes.
SIZES = {"SDXL": (1024, 1536), "": (512, 768, 1024)}
COLOURS = {"merge": "#e4572e", "downsample": "#1f77b4"}


def sizes_for(model: Any) -> tuple[int, ...]:
    return SIZES["SDXL"] if host.model_kind(model) == "SDXL" else SIZES[""]


def run(model: Any, measurer: Measurer, device: Any) -> tuple[str, list[Measurement]]:
    """Measure ``model`` at its sizes with each method: (HTML, measurements). A size that is
    not measured (too large for the memory available, a method with no form for the model,
    or measuring failed) gets a row saying why, and the others are still measured."""
    try:
        unet, run_block = host.measurable(model)
    except UnsupportedModelError as e:
        narrate.console(f"ToMe: Measure now: {str(e).removeprefix('ToMe: ')}")
        return f"<p>{html.escape(str(e))}; nothing to measure.</p>", []
    found = survey(unet, sizes_for(model), measurer, run_block, device, A.DEFAULT)
    return render(found), found.found


def render(found: Survey) -> str:
    """One table of every measurement (and a row per size not measured, saying why), and the
    plot."""
    if not found.found and not found.missed:
        return "<p>ToMe: nothing to measure.</p>"
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in HEAD) + "</tr>"
    rows = ["<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in found.rows()]
    rows += [f"<tr><td>{html.escape(method)}</td><td>{image}</td>"
             f"<td colspan='6'>skipped: {html.escape(why)}</td></tr>"
             for method, image, why in found.skipped()]
    return (f"<p>{html.escape(found.title())}</p><table class='tome-measure'>{head}"
            f"{''.join(rows)}</table>{plot(found)}")


def plot(found: Survey, width: int = 520, height: int = 260) -> str:
    """Speed-up of the first level against image size, one line per method (inline SVG); empty
    where nothing was measured."""
    scale = found.scale(width, height, 40)
    if scale is None:
        return ""
    pad, line = scale.pad, scale.merge_line
    parts = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
             "style='background:#fff'>",
             f"<line x1='{pad}' x2='{width - pad}' y1='{line:.1f}' y2='{line:.1f}' "
             "stroke='#888' stroke-dasharray='4 3'/>",
             f"<text x='{width - pad}' y='{line - 4:.1f}' font-size='11' text-anchor='end' "
             f"fill='#555'>merged above {1 + policy.MARGIN:.2f}x</text>"]
    for i, (method, pts) in enumerate(found.points().items()):
        colour = COLOURS.get(method, "#2ca02c")
        xy = [scale.at(x, y) for x, y in pts]
        parts.append(f"<polyline fill='none' stroke='{colour}' stroke-width='2' points='"
                     + " ".join(f"{px:.1f},{py:.1f}" for px, py in xy) + "'/>")
        parts += [f"<circle cx='{px:.1f}' cy='{py:.1f}' r='3' fill='{colour}'/>"
                  for px, py in xy]
        parts.append(f"<text x='{width - pad}' y='{pad - 20 + 14 * i}' font-size='12' "
                     f"text-anchor='end' fill='{colour}'>{html.escape(method)}</text>")
    for x in scale.x_ticks:
        parts.append(f"<text x='{scale.at(x, scale.y0)[0]:.1f}' y='{height - pad + 16}' "
                     f"font-size='11' text-anchor='middle'>{x} px</text>")
    parts.append(f"<text x='8' y='{pad - 20}' font-size='11'>speed-up (first level)</text>")
    for y in scale.y_ticks:
        parts.append(f"<text x='{pad - 4}' y='{scale.at(scale.x0, y)[1] + 4:.1f}' "
                     f"font-size='11' text-anchor='end'>{y:g}x</text>")
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
