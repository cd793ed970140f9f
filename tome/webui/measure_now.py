"""Settings > ToMe > "Measure now": time the loaded model at its usual sizes, per method.

The button is a gradio event (``settings_component`` in Settings; SD.Next, whose Settings shows
no button, carries it in the accordion): the host's login and queue apply to it as to its own
buttons, and its answer, built here with everything it quotes escaped, is an HTML table per
method and an SVG plot of the speed-up against image size, with the line above which the auto
policy merges. For API users ``POST /tome/measure`` (a JSON object body, ``{}``) answers
``{"html": ...}``; it is registered through the host's own API object, only where the host
serves its API, so the host's API login applies (``register_api``). Each press measures the
sizes it shows again (their cached readings dropped first: a bad reading is not kept
forever). Measuring holds the WebUI's queue lock, so it never runs beside a generation; the
results go into the same cache the generations read.
"""

from __future__ import annotations

import html
import sys
from typing import Any

from .. import policy
from ..layout import UnsupportedModelError
from ..measure import Measurement
from ..measurements import Measurer
from ..survey import HEAD, Survey, survey
from . import host, narrate
from . import script_args as A

try:  # the hosts' web framework (FastAPI on starlette): the route's request, by annotation
    from starlette.requests import Request
except ImportError:  # outside a WebUI
    Request = Any

ROUTE = "/tome/measure"
BUTTON_ID, RESULT_ID = "tome_measure_now_button", "tome_measure_result"
HELP = ("<p>Times the loaded model on this device at its usual first-pass and hires sizes, "
        "merged and unmerged, per method (SD1, SD2, SD3: 512 to 1024 px; SDXL: 1024 and 1536 px; "
        "a minute or more on a CPU). The generations then read these results.</p>")
# Image sizes (px, square) of a first pass and the usual hires-fix passes.
SIZES = {"SDXL": (1024, 1536), "": (512, 768, 1024)}
COLOURS = {"merge": "#e4572e", "downsample": "#1f77b4"}


def sizes_for(model: Any) -> tuple[int, ...]:
    return SIZES["SDXL"] if host.model_kind(model) == "SDXL" else SIZES[""]


def run(model: Any, measurer: Measurer, device: Any,
        remeasure: bool = True) -> tuple[str, list[Measurement]]:
    """Measure ``model`` at its sizes with each method: (HTML, measurements). A size that is
    not measured (too large for the memory available, a method with no form for the model,
    or measuring failed) gets a row saying why, and the others are still measured.
    ``remeasure``: the readings cached for these sizes are dropped and taken again (one bad
    reading is not kept forever); False: cached readings are shown as they are."""
    try:
        unet, run_block = host.measurable(model)
    except UnsupportedModelError as e:
        narrate.console(f"ToMe: Measure now: {str(e).removeprefix('ToMe: ')}")
        return f"<p>{html.escape(str(e))}; nothing to measure.</p>", []
    found = survey(unet, sizes_for(model), measurer, run_block, device, A.DEFAULT,
                   remeasure=remeasure)
    return render(found), found.found


def render(found: Survey) -> str:
    """One table of every measurement (and a row per size not measured, saying why), and the
    plot."""
    if not found.found and not found.missed:
        return "<p>ToMe: nothing to measure.</p>"
    head = "<tr>" + "".join(f"<th>{h}</th>" for h in HEAD) + "</tr>"
    rows = ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>"
            for row in found.rows()]
    rows += [f"<tr><td>{html.escape(method)}</td><td>{html.escape(image)}</td>"
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


def settings_component(**kwargs: Any) -> Any:
    """Settings > ToMe > Measure now as ``OptionInfo.component`` (the host calls it with the
    option's label, value and elem_id): the button, the help text (the option's own component,
    which the host reads back on "Apply settings" and never saves) and the answer below it.
    The click is a gradio event: the host's login and queue apply, no route of ours."""
    import gradio as gr

    button = gr.Button("Measure now", elem_id=BUTTON_ID)
    text = gr.HTML(elem_classes="settings-info", **kwargs)
    out = gr.HTML(elem_id=RESULT_ID)
    button.click(fn=lambda: page(), outputs=[out])
    return text


def page(remeasure: bool = True) -> str:
    """The button's answer: measure the loaded model (again) under the queue lock; the HTML
    says what went wrong where nothing was measured (one console line)."""
    from modules.call_queue import queue_lock

    with queue_lock:
        try:
            model, why = host.loaded_model()
            if model is None:
                narrate.console(f"ToMe: Measure now: {why}")
                return f"<p>ToMe: {html.escape(why)}.</p>"
            text, _ = run(model, host.measuring_service(), host.compute_device(model),
                          remeasure)
        except Exception as e:  # noqa: BLE001 (said to the user; the WebUI stays up)
            why = f"{type(e).__name__}: {e}"
            narrate.console(f"ToMe: Measure now failed: {why}")
            return f"<p>ToMe: Measure now failed: {html.escape(why)}</p>"
    return text


def measure_loaded(remeasure: bool = True) -> dict[str, str]:
    """``{"html": ...}``: what the button shows (the API route's answer)."""
    return {"html": page(remeasure)}


def host_api(app: Any) -> Any:
    """The host's API object, or None where the host does not serve its API: SD.Next keeps it
    as ``shared.api``; A1111 and Forge keep none, but their API's routes are its bound methods
    (created only with ``--api`` or ``--nowebui``)."""
    from modules import shared

    api = getattr(shared, "api", None)
    if api is not None:
        return api
    cls = getattr(sys.modules.get("modules.api.api"), "Api", None)
    if cls is None:
        return None
    for route in getattr(app, "routes", ()):
        owner = getattr(getattr(route, "endpoint", None), "__self__", None)
        if isinstance(owner, cls):
            return owner
    return None


def register_api(demo: Any, app: Any) -> None:
    """``on_app_started``: ``POST /tome/measure`` through the host's API object, so its login
    applies (A1111 and Forge: ``--api-auth``, which ``Api.add_api_route`` adds); nothing where
    the host serves no API. SD.Next's ``add_api_route`` adds its ``--auth`` check only with
    ``--api-only`` (gradio checks its own routes, not the API's): the route asks for those
    users itself there."""
    api = host_api(app)
    if api is None:
        return
    extra: dict[str, Any] = {}
    if host.sdnext() and getattr(api, "credentials", None):
        from fastapi import Depends
        extra["dependencies"] = [Depends(api.auth)]
    api.add_api_route(ROUTE, measure_api, methods=["POST"], **extra)


async def measure_api(request: Request) -> dict[str, str]:
    """``POST /tome/measure``: a JSON object (``{}``, or ``{"remeasure": false}`` to show the
    cached readings as they are), so a cross-site form or ``text/plain`` post, which a browser
    sends without asking, is refused (415) before anything runs; the measuring runs in a
    worker thread."""
    from fastapi import HTTPException
    from starlette.concurrency import run_in_threadpool

    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise HTTPException(415, f"ToMe: {ROUTE} takes a JSON object (Content-Type: "
                                 f"application/json), got {kind or 'no content type'}")
    try:
        body = await request.json()
    except ValueError as e:
        raise HTTPException(400, f"ToMe: {ROUTE}: the body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise HTTPException(422, f"ToMe: {ROUTE} takes a JSON object, e.g. {{}}")
    unknown = sorted(set(body) - {"remeasure"})
    if unknown:
        raise HTTPException(422, f"ToMe: {ROUTE}: unknown setting(s) {unknown}; known: "
                                 "['remeasure']")
    remeasure = body.get("remeasure", True)
    if not isinstance(remeasure, bool):
        raise HTTPException(422, f"ToMe: {ROUTE}: remeasure={remeasure!r}: expected true or "
                                 "false")
    return await run_in_threadpool(measure_loaded, remeasure)
