"""A stand-in of SD.Next (vladmandic/automatic @431bcc36, its diffusers backend) for the parts
the ToMe script touches, written from the behaviour its public source shows (SD.Next is AGPL:
nothing is copied). ``enter()`` turns the WebUI stand-in into it, ``leave()`` back:

- ``scripts.Script`` has no ``process_before_every_sampling`` and no ``before_hr``: SD.Next's
  diffusers path calls no script hook between its passes;
- ``shared.log`` is SD.Next's logger (its ``sdnext.log`` and the UI's log panel); a ``print``
  does not reach it (``LOG`` holds what it got);
- ``shared.OptionHTML`` does not exist (Settings cannot show a button);
- its own token merging is in the options: ``token_merging_method`` ("None", "ToMe", "ToDo"),
  ``tome_ratio``, ``todo_ratio``; ``shared.sd_refiner`` is the refiner pipeline or None;
- ``process_images(p)`` runs SD.Next's order: ``before_process``; ``override_settings``
  applied (restored afterwards); its own token merging applied to ``p.sd_model`` (ToMe:
  tomesd; ToDo: a ``_tome_info`` dict with a pre-hook on the UNet and a
  ``TokenMergeAttentionProcessor`` on every attn1, keys and values downsampled); ``process``;
  per batch ``process_batch``, then the passes: base, hires (``p.is_hr_pass`` True around the
  pipeline call, on a new pipeline object around the same UNet: ``set_diffuser_pipe``), refiner
  (``p.is_refiner_pass``, ``shared.sd_refiner``); ``postprocess_batch``; ``postprocess`` only
  when not interrupted; finally its token merging removed, the ``after_process`` callbacks,
  the options restored. The infotext gets SD.Next's own ``ToMe: <tome_ratio>`` when its method
  is ToMe, else ``ToDo: <todo_ratio>`` whenever that ratio is not 0, merged or not;
- ``launch()`` starts it as ``webui.py`` does: gradio's app behind ``--auth`` (its own routes
  only), the HTTP API always (``Api``, kept as ``shared.api``), then ``on_app_started``;
  ``--api-only``: the API alone, its routes behind ``--auth``'s users.
"""

from __future__ import annotations

import logging
import os
import sys
from secrets import compare_digest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # the stand-in's ``modules`` package, as in ``harness.py``
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers.models.attention_processor import AttnProcessor2_0  # noqa: E402
from fastapi import Depends, HTTPException  # noqa: E402
from fastapi.security import HTTPBasic, HTTPBasicCredentials  # noqa: E402
from modules import processing, script_callbacks, scripts, shared  # noqa: E402

LOG: list[str] = []
BASIC = Depends(HTTPBasic())  # the Authorization header's user and password, or 401
_saved: dict = {}


class _Collect(logging.Handler):
    def emit(self, record):
        LOG.append(record.getMessage())


def enter() -> None:
    for name in ("process_before_every_sampling", "before_hr"):
        if name in vars(scripts.Script):
            _saved[name] = vars(scripts.Script)[name]
            delattr(scripts.Script, name)
    if hasattr(shared, "OptionHTML"):
        _saved["OptionHTML"] = shared.OptionHTML
        del shared.OptionHTML
    log = logging.getLogger("sdnext-stand-in")
    log.handlers[:] = [_Collect()]
    log.setLevel(logging.DEBUG)
    log.propagate = False
    shared.log = log
    shared.sd_refiner = None
    shared.api = None  # set at launch
    LOG.clear()
    script_callbacks.on_after_process = lambda fn, *, name=None: script_callbacks._add(
        "after_process", fn, name)


def leave() -> None:
    for name in ("process_before_every_sampling", "before_hr"):
        if name in _saved:
            setattr(scripts.Script, name, _saved.pop(name))
    if "OptionHTML" in _saved:
        shared.OptionHTML = _saved.pop("OptionHTML")
    for name in ("log", "sd_refiner", "api"):
        vars(shared).pop(name, None)
    vars(script_callbacks).pop("on_after_process", None)


def add_options() -> None:
    """SD.Next's own token merging options (after ``shared.reset``)."""
    section = ("optimizations", "Optimizations")
    shared.opts.add_option("token_merging_method", shared.OptionInfo("None", "Token merging",
                                                                     section=section))
    for key in ("tome_ratio", "todo_ratio"):
        shared.opts.add_option(key, shared.OptionInfo(0.0, key, section=section))


# ----------------------------------------------------------------------------- the app

def _users() -> dict[str, str]:
    """``--auth user:pass[,user:pass...]`` (quotes and spaces stripped)."""
    users = {}
    for pair in (getattr(shared.cmd_opts, "auth", None) or "").split(","):
        if pair.strip():
            user, password = pair.split(":")
            users[user.replace('"', "").strip()] = password.replace('"', "").strip()
    return users


class Api:
    """SD.Next's HTTP API object (``shared.api``): created at every start, its routes
    registered by ``register``. ``add_api_route`` puts the HTTP Basic check of ``--auth``'s
    users in front of a route only with ``--api-only``; otherwise SD.Next leaves the login to
    gradio, whose check covers gradio's own routes, not these."""

    def __init__(self, app, queue_lock):
        self.credentials = _users()
        self.app, self.queue_lock = app, queue_lock

    def register(self):
        self.add_api_route("/sdapi/v1/sd-models", self.get_sd_models, methods=["GET"])

    def add_api_route(self, path, endpoint, **kwargs):
        if getattr(shared.cmd_opts, "auth", None) and getattr(shared.cmd_opts, "api_only", False):
            kwargs["dependencies"] = [Depends(self.auth)]
        self.app.add_api_route(path, endpoint, **kwargs)

    def auth(self, credentials: HTTPBasicCredentials = BASIC):
        known = self.credentials.get(credentials.username)
        if known is not None and compare_digest(credentials.password, known):
            return True
        raise HTTPException(401, "Unauthorized", headers={"WWW-Authenticate": "Basic"})

    def get_sd_models(self):
        return [] if shared.sd_model is None else [{"title": type(shared.sd_model).__name__}]


def launch():
    """Start as ``webui.py`` does; the app, for a ``TestClient``."""
    import gradio as gr
    from fastapi import FastAPI
    from modules.call_queue import queue_lock

    demo = None
    if getattr(shared.cmd_opts, "api_only", False):
        app = FastAPI()
    else:
        demo = shared.demo
        demo.auth, demo.auth_message = list(_users().items()) or None, None
        demo.config = demo.get_config_file()
        app = gr.routes.App.create_app(demo)
    shared.api = Api(app, queue_lock)
    shared.api.register()
    script_callbacks.app_started_callback(demo, app)
    return app


# ----------------------------------------------------------------------------- the model

class Pipeline:
    """A diffusers pipeline: its ``unet`` (SD1.5) or ``transformer`` (SD3); SD.Next swaps
    pipeline objects between tasks."""

    def __init__(self, unet: torch.nn.Module | None = None,
                 transformer: torch.nn.Module | None = None):
        if unet is not None:
            self.unet, self.is_sd1 = unet, True
        else:
            self.transformer, self.is_sd3 = transformer, True
        self.sd_checkpoint_info = object()
        self.context_dim = 32

    @property
    def denoiser(self) -> torch.nn.Module:
        return getattr(self, "unet", None) or self.transformer

    def switch(self) -> Pipeline:
        """``set_diffuser_pipe``: a new pipeline object around the same modules."""
        return Pipeline(getattr(self, "unet", None), getattr(self, "transformer", None))

    def __call__(self, x, t, cond):
        """One denoiser call as the pipeline makes it (SD3: timesteps 0..1000)."""
        if hasattr(self, "unet"):
            return self.unet(x, t, encoder_hidden_states=cond).sample
        pooled = torch.zeros(x.shape[0], 24)
        return self.transformer(hidden_states=x, timestep=t.expand(x.shape[0]),
                                encoder_hidden_states=cond, pooled_projections=pooled).sample


class TokenMergeAttentionProcessor:
    """SD.Next's ToDo on attn1: at the top level, keys and values from the token grid
    downsampled by 2 (nearest), queries whole; deeper levels as without it. Shares the UNet's
    ``_tome_info``."""

    _tome_info: dict

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 temb=None, *args, **kwargs):
        b, n, c = hidden_states.shape
        h, w = self._tome_info["size"]
        if encoder_hidden_states is None and n == h * w:
            grid = hidden_states.transpose(1, 2).reshape(b, c, h, w)
            encoder_hidden_states = F.interpolate(grid, scale_factor=0.5, mode="nearest"
                                                  ).flatten(2).transpose(1, 2)
        return AttnProcessor2_0()(attn, hidden_states, encoder_hidden_states, attention_mask)


def apply_builtin(pipe: Pipeline) -> None:
    o = shared.opts
    if not hasattr(pipe, "unet"):  # its ToMe and ToDo reach UNets only
        return
    if o.token_merging_method == "ToMe" and o.tome_ratio > 0:
        import tomesd
        tomesd.apply_patch(pipe.unet, ratio=o.tome_ratio, use_rand=False)
        pipe.applied = "ToMe"
    elif o.token_merging_method == "ToDo" and o.todo_ratio > 0:
        unet = pipe.unet
        unet._tome_info = {"size": None, "timestep": None, "hooks": [], "args": {
            "ratio": o.todo_ratio, "merge_tokens": "keys/values",
            "merge_method": "downsample", "downsample_factor": 2}}

        def hook(module, args):
            module._tome_info["size"] = tuple(args[0].shape[2:])
            module._tome_info["timestep"] = args[1].reshape(-1)[0].item()

        unet._tome_info["hooks"].append(unet.register_forward_pre_hook(hook))
        for m in unet.modules():
            if type(m).__name__ == "BasicTransformerBlock":
                m.attn1.processor = TokenMergeAttentionProcessor()
                m.attn1.processor._tome_info = unet._tome_info
        pipe.applied = "ToDo"


def remove_builtin(pipe: Pipeline) -> None:
    applied = getattr(pipe, "applied", None)
    if applied == "ToMe":
        import tomesd
        tomesd.remove_patch(pipe.unet)
    elif applied == "ToDo":
        info = vars(pipe.unet).pop("_tome_info", {})
        for h in info.get("hooks", []):
            h.remove()
        for m in pipe.unet.modules():
            if hasattr(m, "processor"):
                m.processor = AttnProcessor2_0()
    pipe.applied = None


# ----------------------------------------------------------------------------- processing

calls: list[tuple[str, torch.nn.Module]] = []  # (pass, UNet) per UNet call


def _denoise(p, pipe, x, steps, t_from=999.0):
    cond, uncond = p.conds(x.shape[0])
    for t in torch.linspace(t_from, 0.0, steps):
        calls.append(("refiner" if getattr(p, "is_refiner_pass", False)
                      else "hires" if p.is_hr_pass else "base", pipe.denoiser))
        with torch.no_grad():
            out = pipe(torch.cat([x, x]), t, torch.cat([cond, uncond]))
        eps_c, eps_u = out.chunk(2)
        x = x - 0.1 * (eps_u + p.cfg_scale * (eps_c - eps_u))
    return x


def _process_diffusers(p):
    x = _denoise(p, shared.sd_model, p.noise((1, 4, p.height // 8, p.width // 8)), p.steps)
    if getattr(p, "interrupt_after_base", False):
        shared.state.interrupted = True
        return x
    if p.enable_hr:
        p.is_hr_pass = True
        shared.sd_model = shared.sd_model.switch()
        x = F.interpolate(x, scale_factor=p.hr_scale, mode="nearest")
        x = x + p.noise((1, *x.shape[1:])) * p.denoising_strength
        x = _denoise(p, shared.sd_model, x, p.hr_second_pass_steps or p.steps,
                     999.0 * p.denoising_strength)
        p.is_hr_pass = False
    if shared.sd_refiner is not None:
        p.is_refiner_pass = True
        x = _denoise(p, shared.sd_refiner, x, 2, 999.0 * 0.2)
        p.is_refiner_pass = False
    return x


def process_images(p):
    """SD.Next's ``process_images`` for one txt2img batch (see the module docstring)."""
    calls.clear()
    p.is_refiner_pass = False
    if p.scripts is not None:
        p.scripts.before_process(p)
    o = shared.opts
    for k, v in list(p.override_settings.items()):
        if getattr(o, k, None) == v:
            p.override_settings.pop(k)
    stored = {k: getattr(o, k) for k in p.override_settings}
    base = shared.sd_model
    try:
        for k, v in p.override_settings.items():
            setattr(o, k, v)
        apply_builtin(base)
        script_callbacks._run("before_process", p)
        if p.scripts is not None:
            p.scripts.process(p)
        p.all_seeds = p.all_seeds or [int(p.seed)]
        p.seeds = p.all_seeds
        p.init(None, p.seeds, p.seeds)
        if p.scripts is not None:
            p.scripts.process_batch(p, batch_number=0, prompts=[p.prompt], seeds=p.seeds,
                                    subseeds=p.seeds)
        samples = _process_diffusers(p)
        if p.scripts is not None:
            p.scripts.postprocess_batch(p, samples, batch_number=0)
        info = processing.create_infotext(p)
        # SD.Next's own key: ToMe's ratio when its method is ToMe, else ToDo's, merged or not
        key, ratio = ("ToMe", o.tome_ratio) if o.token_merging_method == "ToMe" \
            else ("ToDo", o.todo_ratio)
        if ratio:
            info += f", {key}: {ratio}"
        res = processing.Processed(p, [samples[0]], [info])
        if p.scripts is not None and not shared.state.interrupted:
            p.scripts.postprocess(p, res)
        return res
    finally:
        remove_builtin(base)
        script_callbacks._run("after_process", p)
        if p.override_settings_restore_afterwards:
            for k, v in stored.items():
                setattr(o, k, v)
        shared.sd_model = base
