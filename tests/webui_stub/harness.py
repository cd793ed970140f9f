"""Drives the real ``scripts/token_merging.py`` through the WebUI stand-in (see README.md)."""

from __future__ import annotations

import contextlib
import copy
import os
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import gradio as gr  # noqa: E402
import neo  # noqa: E402 (Forge Neo's engine and its backend stand-in)
import torch  # noqa: E402
import xyz_grid  # noqa: E402
from modules import (  # noqa: E402
    call_queue,
    errors,
    processing,
    script_callbacks,
    scripts,
    sd_models,
    sd_unet,
    shared,
    ui_settings,
)
from modules.api.api import Api  # noqa: E402
from modules.infotext_utils import PAIR, parse_generation_parameters  # noqa: E402

EXT_ROOT = os.path.dirname(os.path.dirname(HERE))
# Re-exported for the tests, which cannot import the stand-in before this module set sys.path.
__all__ = [
    "EXT_ROOT",
    "PAIR",
    "WebUI",
    "api_error",
    "call_queue",
    "errors",
    "launch",
    "neo",
    "parse_generation_parameters",
    "press",
    "processing",
    "script_callbacks",
    "scripts",
    "sd_models",
    "sd_unet",
    "shared",
    "tiny_model",
    "xyz_grid",
]


@dataclass
class Call:
    """What one UNet call ran with."""

    hr: bool
    model: object
    config: object   # the ToMe config of the patch, or None
    tomesd: bool     # the built-in token merging (tomesd) was active


_unets: dict = {}


def tiny_model(kind: str = "sd1", seed: int = 0) -> torch.nn.Module:
    """An ldm-style model object around a tiny random-weight UNet, flagged like the WebUI's."""
    from models import TINY_SD15, TINY_SDXL, ldm_unet

    if (kind, seed) not in _unets:
        _unets[kind, seed] = ldm_unet(TINY_SDXL if kind == "sdxl" else TINY_SD15, seed)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.diffusion_model = copy.deepcopy(_unets[kind, seed])
    model.context_dim = 32
    for flag in ("is_sd1", "is_sd2", "is_sdxl", "is_sd3"):
        setattr(model, flag, flag == f"is_{kind}")
    return model


class WebUI:
    """One WebUI process: scripts loaded, both tabs' UIs built with real gradio."""

    def __init__(self, model: torch.nn.Module | None = None, **cmd_opts):
        shared.reset()
        sd_unet.current_unet = None
        errors.reported.clear()
        processing.unet_call_observers.clear()
        processing.sampling_mode = torch.no_grad
        processing.unet_call_observers.append(self._observe)
        self.calls: list[Call] = []
        for k, v in cmd_opts.items():
            setattr(shared.cmd_opts, k, v)
        self.start()
        sd_models.load_model(model if model is not None else tiny_model())

    def start(self) -> None:
        xyz_grid.axis_options[1:] = []
        xyz = scripts.ScriptClassData(xyz_grid.XYZScript, "xyz_grid.py", HERE, xyz_grid)
        scripts.load_scripts([EXT_ROOT], extra=[xyz])
        script_callbacks.ui_settings_callback()
        script_callbacks.before_ui_callback()
        self.runners = {}
        with gr.Blocks() as self.blocks:
            for tab in ("txt2img", "img2img"):
                runner = scripts.ScriptRunner()
                runner.initialize_scripts(tab == "img2img")
                runner.setup_ui()
                self.runners[tab] = runner
            self.settings = ui_settings.create_ui()
        shared.demo = self.blocks
        with gr.Blocks():
            self.api_defaults = {tab: self.default_args(tab) for tab in self.runners}

    def _observe(self, p, model) -> None:
        import tome

        report = tome.patch_report(model)
        modules = getattr(model, "modules", None)  # Forge Neo's engine is no torch module
        tomesd = callable(modules) and any(type(m).__name__ == "ToMeBlock" for m in modules())
        self.calls.append(Call(bool(getattr(p, "is_hr_pass", False)), model,
                               report.config if report else None, tomesd))

    def reload_ui(self) -> None:
        """Settings > Reload UI: unload callbacks, re-run the script files, rebuild."""
        script_callbacks.script_unloaded_callback()
        self.start()

    def script(self, tab: str = "txt2img") -> scripts.Script:
        return next(s for s in self.runners[tab].scripts if s.title() == "ToMe")

    def default_args(self, tab: str) -> list:
        """What the API does: call ui() again in a throwaway Blocks and read ``.value``s."""
        runner = self.runners[tab]
        args = [0] + [None] * (len(runner.inputs) - 1)
        for s in runner.scripts:  # inside the caller's throwaway gr.Blocks
            args[s.args_from:s.args_to] = [c.value for c in s.ui(s.is_img2img)]
        return args

    # --- generations ------------------------------------------------------------------------
    def baseline(self, tab: str = "txt2img", **fields):
        """The same generation in a WebUI without the extension (no scripts at all)."""
        cls = (processing.StableDiffusionProcessingImg2Img if tab == "img2img"
               else processing.StableDiffusionProcessingTxt2Img)
        return processing.process_images(cls(**fields))

    def make_p(self, tab: str, tome: list | dict | None = None, **fields):
        cls = (processing.StableDiffusionProcessingImg2Img if tab == "img2img"
               else processing.StableDiffusionProcessingTxt2Img)
        p = cls(**fields)
        args = list(self.api_defaults[tab])
        if tome is not None:
            s = self.script(tab)
            values = [tome] if isinstance(tome, dict) else list(tome)
            args[s.args_from:s.args_from + len(values)] = values
        p.scripts = self.runners[tab]
        p.script_args = args
        return p

    def generate(self, tab: str = "txt2img", tome=None, *, close: bool = True, **fields):
        p = self.make_p(tab, tome, **fields)
        ctx = contextlib.closing(p) if close else contextlib.nullcontext()
        with ctx:
            res = processing.process_images(p)
        res.p = p
        return res

    def api(self, tab: str, payload: dict, host: str = "a1111") -> dict:
        """``POST /sdapi/v1/{tab}``: infotext, then alwayson_scripts, then process_images.

        ``host``: whose API exception handling answers a failed request, "a1111" or "forge"
        (see ``api_error``).
        """
        runner = self.runners[tab]
        args = list(self.api_defaults[tab])
        fields = {k: v for k, v in payload.items()
                  if k not in ("alwayson_scripts", "infotext")}
        if payload.get("infotext"):
            params = parse_generation_parameters(payload["infotext"])
            index = {id(c): i for i, c in enumerate(runner.inputs)}
            for comp, key in runner.infotext_fields:
                value = key(params) if callable(key) else params.get(key)
                if value is None or id(comp) not in index:
                    continue
                if not isinstance(value, type(comp.value)):
                    value = type(comp.value)(value)
                args[index[id(comp)]] = value
        for title, spec in (payload.get("alwayson_scripts") or {}).items():
            script = next((s for s in runner.scripts if s.title().lower() == title.lower()), None)
            if script is None or not script.alwayson:
                return {"status": 422, "detail": f"always on script {title} not found"}
            values = spec.get("args", [])
            for i in range(min(script.args_to - script.args_from, len(values))):
                args[script.args_from + i] = values[i]
        cls = (processing.StableDiffusionProcessingImg2Img if tab == "img2img"
               else processing.StableDiffusionProcessingTxt2Img)
        p = cls(**fields)
        p.is_api = True
        p.scripts = runner
        p.script_args = args
        try:
            with contextlib.closing(p):
                res = processing.process_images(p)
        except Exception as e:  # noqa: BLE001 (the host's API exception handlers)
            return api_error(e, host)
        return {"status": 200, "images": res.images, "info": res.info,
                "infotexts": res.infotexts, "p": p}

    def ui_generate(self, tab: str = "txt2img", tome=None, **fields) -> str:
        """The Generate button: the UI's call wrapper turns an error into an HTML message."""
        return call_queue.wrap_gradio_call(
            lambda: self.generate(tab, tome, **fields).info)()

    def paste(self, tab: str, text: str, current: list | None = None) -> list:
        """Paste ``text`` into the prompt box (or PNG Info > Send to): the new script args."""
        runner = self.runners[tab]
        script = self.script(tab)
        args = list(current or self.api_defaults[tab])
        params = parse_generation_parameters(text)
        index = {id(c): i for i, c in enumerate(runner.inputs)}
        for comp, key in runner.infotext_fields:
            v = key(params) if callable(key) else params.get(key)
            if v is None or id(comp) not in index:
                continue
            if isinstance(v, dict) and v.get("__type__") == "update":
                v = v.get("value")
                if v is None:
                    continue
            valtype = type(comp.value)
            v = False if valtype is bool and v == "False" else (
                float(v) if valtype is int else valtype(v))
            args[index[id(comp)]] = v
        return args[script.args_from:script.args_to]

    def xyz(self, tab: str, label: str, values: list, tome=None, **fields):
        p = self.make_p(tab, tome, **fields)
        with contextlib.closing(p):
            return xyz_grid.run(p, label, values)


def launch():
    """What ``webui.py`` does once the UI is built: gradio's app around ``shared.demo``
    (behind ``--gradio-auth user:pass[,...]``, which guards gradio's own routes: the page,
    ``/config``, ``/run/predict``, the queue), the HTTP API (``Api``) only with ``--api``,
    then the ``on_app_started`` callbacks with the UI and the app. ``--nowebui``: a bare
    FastAPI app with the API and no UI (``demo`` None). Returns the app, for a
    ``TestClient``."""
    from fastapi import FastAPI

    cmd = shared.cmd_opts
    if getattr(cmd, "nowebui", False):
        app = FastAPI()
        Api(app, call_queue.queue_lock)
        script_callbacks.app_started_callback(None, app)
        return app
    demo = shared.demo
    logins = [tuple(x.strip().split(":")) for x in (getattr(cmd, "gradio_auth", None) or "")
              .split(",") if x.strip()]
    demo.auth, demo.auth_message = logins or None, None
    demo.config = demo.get_config_file()
    app = gr.routes.App.create_app(demo)
    if getattr(cmd, "api", False):
        Api(app, call_queue.queue_lock)
    script_callbacks.app_started_callback(demo, app)
    return app


def press(client, key: str, *data):
    """A click on the component ``key`` (its elem_id, or a button's text) as the page sends
    it: ``POST /run/predict`` with the index of the event that component triggers (read from
    ``/config``, as the page does) and the session's cookies; the response. ``client``: a
    ``TestClient`` on ``launch()``'s app, logged in (``POST /login``) where the UI has one."""
    config = client.get("/config")
    if config.status_code != 200:
        return config
    config = config.json()
    ids = {c["id"] for c in config["components"] if c["props"].get("elem_id") == key
           or (c.get("type") == "button" and c["props"].get("value") == key)}
    index = next(i for i, dep in enumerate(config["dependencies"]) if ids & set(dep["targets"]))
    return client.post("/run/predict", json={"fn_index": index, "data": list(data),
                                             "session_hash": "stand-in"})


def api_error(e: Exception, host: str) -> dict:
    """A failed request as each host answers it: {"status": HTTP status, **JSON body}.

    A1111 1.10 (one handler for every exception): the status is the exception's own
    ``status_code`` instance attribute, else 500; the body has ``error`` (class name),
    ``detail`` and ``body`` (instance attributes, else ""), and ``errors`` (``str(e)``); the
    traceback is printed unless the exception is a fastapi ``HTTPException``.
    Forge (the WebUI's app-level handler, its API middleware being off): a starlette
    ``HTTPException`` goes to fastapi's default handler, ``{"detail": e.detail}`` with its
    status and nothing printed; anything else gets the instance ``status_code`` or 500, a body
    with ``error``, ``detail``, ``body`` and ``message`` (``str(e)``), and the ASGI server
    prints the traceback.
    """
    from fastapi.exceptions import HTTPException
    from starlette.exceptions import HTTPException as StarletteHTTPException

    attrs = vars(e)
    status = int(attrs.get("status_code", 500))
    common = {"error": type(e).__name__, "detail": attrs.get("detail", ""),
              "body": attrs.get("body", "")}
    if host == "forge":
        if isinstance(e, StarletteHTTPException):
            return {"status": e.status_code, "detail": e.detail}
        errors.report("Exception in ASGI application", exc_info=True)
        return {"status": status, **common, "message": str(e)}
    if not isinstance(e, HTTPException):
        errors.report(f"API error: POST: {common}", exc_info=True)
    return {"status": status, **common, "errors": str(e)}


def tome_args(**named) -> dict:
    return {"enabled": True, **named}
