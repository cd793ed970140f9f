"""Patching UNets: forward hooks around each transformer block's sub-layers.

One mechanism serves ldm (SD1/SD2), sgm (SDXL) and diffusers: the block's input is caught by
a pre-hook on the block, and the sub-layers (``attn1``, ``attn2``, ``ff``) get pre-hooks that
merge their input and hooks that unmerge their output. Nothing about the block's own forward
is copied or replaced, so new block features in diffusers, attention-kernel swaps in the
WebUI (which replace ``CrossAttention.forward`` at class level) and ``_forward`` overrides all
keep working, and removal is exact: the hooks go, one attribute on the UNet goes, and no
class or weight was ever touched.

Per UNet call a pre-hook on the UNet starts a ``plan.Step`` (latent size, timestep); the
block pre-hook asks the shared ``plan.Planner`` for the block's plan, and the sub-layer hooks
apply it. Which blocks merge, how destinations are drawn and when matching runs are decided
in ``plan.py``, shared with the Forge adapter.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import plan as _plan
from .config import ToMeConfig

STATE_ATTR = "_tome_sd_state"  # tomesd uses ``_tome_info`` and the class name ``ToMeBlock``.
BLOCK_CLASS = "BasicTransformerBlock"


class UnsupportedModelError(TypeError):
    """The object is not a model this library can patch."""


@dataclass
class PatchReport:
    """What a patch did: a short, printable account for users and tests."""

    family: str
    config: ToMeConfig
    max_downsample: int
    levels: dict[int, int] = field(default_factory=dict)   # downsample -> blocks patched
    total_blocks: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (block name, reason)
    replaced_tomesd: bool = False
    # Filled in while running: downsample -> (tokens, tokens removed) of the latest call.
    tokens: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Filled in while running: the auto policy's decision per (level, tokens, device kind).
    decisions: dict[tuple[int, int, str], Any] = field(default_factory=dict)

    @property
    def patched_blocks(self) -> int:
        return sum(self.levels.values())

    def summary(self) -> str:
        c = self.config
        what = (f"merge ratio {c.ratio:g}" if c.method == "merge"
                else f"downsample x{c.downsample_factor}")
        levels = ", ".join(f"ds{d}: {n}" for d, n in sorted(self.levels.items())) or "none"
        text = (f"ToMe: {self.family} UNet, {what} at downsample <= {self.max_downsample}: "
                f"{self.patched_blocks}/{self.total_blocks} blocks patched ({levels})")
        if c.start > 0 or c.end < 1:
            text += f", steps {c.start:g}-{c.end:g}"
        if self.skipped:
            text += f"; {len(self.skipped)} skipped ({self.skipped[0][1]})"
        return text


class _State:
    def __init__(self, config: ToMeConfig, report: PatchReport, decoder: set[nn.Module]):
        self.config, self.report = config, report
        self.decoder = decoder  # blocks on the UNet's upsampling side
        self.planner = _plan.Planner(config, report.max_downsample)
        # The report shows the planner's live figures.
        report.tokens, report.decisions = self.planner.tokens, self.planner.decisions
        self.handles: list[Any] = []
        self.step: _plan.Step | None = None
        self.warned: set[str] = set()
        # id(block) -> the plan for the block's current call. Kept here, not on the blocks, so
        # removal leaves nothing behind.
        self.plans: dict[int, Any] = {}

    def warn_once(self, msg: str) -> None:
        if msg not in self.warned:
            self.warned.add(msg)
            warnings.warn(msg, stacklevel=3)


# ----------------------------------------------------------------------------- finding things

def find_unet(model: Any) -> nn.Module:
    """The UNet of an ldm/sgm model, a diffusers pipeline, or a bare UNet."""
    for path in ("unet", "model.diffusion_model", "diffusion_model"):
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, nn.Module):
            return obj
    if isinstance(model, nn.Module) and (hasattr(model, "input_blocks")
                                         or hasattr(model, "down_blocks")):
        return model
    raise UnsupportedModelError(
        f"ToMe: cannot find a UNet in {type(model).__module__}.{type(model).__name__}; expected "
        "an ldm/sgm model (with .model.diffusion_model), a UNet (ldm UNetModel or diffusers "
        "UNet2DConditionModel) or a diffusers pipeline (with .unet)")


def _is_block(module: nn.Module) -> bool:
    return any(cls.__name__ == BLOCK_CLASS for cls in type(module).__mro__)


def _family(module: nn.Module) -> str:
    root = type(module).__module__.split(".")[0]
    return root if root in ("ldm", "sgm", "diffusers") else root or "unknown"


def block_levels(unet: nn.Module) -> dict[nn.Module, int]:
    """The downsample level of every transformer block, read from the UNet's structure.

    ldm/sgm: walk ``input_blocks`` / ``middle_block`` / ``output_blocks`` counting Downsample
    and Upsample layers. diffusers: level ``2**i`` for ``down_blocks[i]``, mirrored for
    ``up_blocks``. Anything else: level unknown (0); the runtime still decides per token count.
    """
    levels: dict[nn.Module, int] = {}

    def mark(part: nn.Module, ds: int) -> None:
        for m in part.modules():
            if _is_block(m):
                levels.setdefault(m, ds)

    def has(part: nn.Module, name: str) -> bool:
        return any(type(m).__name__ == name for m in part.modules())

    if hasattr(unet, "input_blocks") and hasattr(unet, "output_blocks"):
        ds = 1
        for part in unet.input_blocks:
            if has(part, "Downsample"):
                ds *= 2
            mark(part, ds)
        mark(unet.middle_block, ds)
        for part in unet.output_blocks:
            mark(part, ds)
            if has(part, "Upsample"):
                ds //= 2
    elif hasattr(unet, "down_blocks") and hasattr(unet, "up_blocks"):
        n = len(unet.down_blocks)
        for i, part in enumerate(unet.down_blocks):
            mark(part, 2 ** i)
        if getattr(unet, "mid_block", None) is not None:
            mark(unet.mid_block, 2 ** (n - 1))
        for i, part in enumerate(unet.up_blocks):
            mark(part, 2 ** (n - 1 - i))
    for m in unet.modules():
        if _is_block(m):
            levels.setdefault(m, 0)
    return levels


def decoder_blocks(unet: nn.Module) -> set[nn.Module]:
    """The transformer blocks on the upsampling side (ldm/sgm ``output_blocks``, diffusers
    ``up_blocks``)."""
    side = getattr(unet, "output_blocks", None) or getattr(unet, "up_blocks", None) or []
    return {m for part in side for m in part.modules() if _is_block(m)}


def _sub_layers(config: ToMeConfig) -> tuple[str, ...]:
    """The block's sub-layers that get hooks: ``attn1`` for the downsample method (its keys and
    values are pooled), otherwise every sub-layer that runs on merged tokens."""
    if config.method == "downsample":
        return ("attn1",)
    merged = {"attn1": config.merge_attn, "attn2": config.merge_crossattn, "ff": config.merge_mlp}
    return tuple(name for name, on in merged.items() if on)


def _block_problem(block: nn.Module, config: ToMeConfig) -> str | None:
    """Why a block cannot be patched safely, or None."""
    if "_forward" in vars(block) or "forward" in vars(block):
        return "forward shadowed on the instance by another extension (e.g. ControlNet reference)"
    if type(block).__name__ == "ToMeBlock":
        return "patched by tomesd"
    missing = [n for n in _sub_layers(config)
               if not isinstance(getattr(block, n, None), nn.Module)]
    if missing:
        return f"unsupported block variant {type(block).__qualname__}: no {', '.join(missing)}"
    for name in _sub_layers(config):
        sub = getattr(block, name)
        # Another patch reads or replaces this sub-layer's full token sequence (Self-Attention
        # Guidance records attn1's attention map in the middle block): merging would change
        # the shapes it expects.
        if "forward" in vars(sub):
            return (f"{name} forward replaced on the instance by another extension (e.g. "
                    "Self-Attention Guidance)")
        if sub._forward_hooks or sub._forward_pre_hooks:
            return f"{name} is observed by another patch's hooks"
    if config.method == "downsample" and (getattr(block, "disable_self_attn", False)
                                          or getattr(block, "only_cross_attention", False)):
        return "attn1 is a cross-attention; downsampling its keys would drop the context"
    if config.merge_mlp and getattr(block, "_chunk_size", None):
        return "feed-forward chunking is on; merging the MLP input would mix chunks"
    return None


# ----------------------------------------------------------------------------- tomesd

def remove_tomesd(model: Any) -> bool:
    """Undo a tomesd patch in place (what ``tomesd.remove_patch`` does), without importing it."""
    root = model if isinstance(model, nn.Module) else find_unet(model)
    found = False
    for m in root.modules():
        info = vars(m).get("_tome_info")
        if info is not None:
            for h in info.get("hooks", []):
                h.remove()
            info["hooks"] = []
            found = True
        if type(m).__name__ == "ToMeBlock" and hasattr(m, "_parent"):
            m.__class__ = m._parent
            found = True
    return found


def _tomesd_patched(unet: nn.Module) -> bool:
    """tomesd swaps block classes and adds a hook; its remove_patch leaves ``_tome_info`` behind,
    so only a live class swap or live hooks count."""
    return any(type(m).__name__ == "ToMeBlock" or vars(m).get("_tome_info", {}).get("hooks")
               for m in unet.modules())


# ----------------------------------------------------------------------------- hooks

def _first(args: tuple, kwargs: dict, names: tuple[str, ...], pos: int) -> Any:
    if len(args) > pos:
        return args[pos]
    for n in names:
        if n in kwargs:
            return kwargs[n]
    return None


def _set_first(args: tuple, kwargs: dict, names: tuple[str, ...], value: Any):
    if args:
        return (value, *args[1:]), kwargs
    for n in names:
        if n in kwargs:
            return args, {**kwargs, n: value}
    raise RuntimeError("ToMe: could not find the hidden states argument")


_X_NAMES = ("x", "hidden_states", "sample")
_T_NAMES = ("timesteps", "timestep", "t")


class _Hooks:
    """The hook functions for one patched UNet, closing over its state. Each hook does one
    thing whatever the method: the method chose which hooks were registered."""

    def __init__(self, state: _State):
        self.state = state

    # UNet ---------------------------------------------------------------
    def unet_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = _first(args, kwargs, _X_NAMES, 0)
        t = _first(args, kwargs, _T_NAMES, 1)
        self.state.step = self.state.planner.step(tuple(x.shape[-2:]), x.device, t) \
            if isinstance(x, torch.Tensor) else None

    def unet_post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self.state.step = None

    # Block --------------------------------------------------------------
    def block_pre(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        st = self.state
        st.plans.pop(id(block), None)
        if st.step is None:
            return
        if type(block).__name__ == "ToMeBlock":  # tomesd re-patched it behind our back
            st.warn_once("ToMe: a block was patched by tomesd after ours; skipping it so it is "
                         "never merged twice")
            return
        x = _first(args, kwargs, _X_NAMES, 0)
        if isinstance(x, torch.Tensor) and x.dim() == 3:
            plan = st.planner.plan(st.step, x, block in st.decoder)
            if plan is not None:
                st.plans[id(block)] = plan

    def block_post(self, block: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self.state.plans.pop(id(block), None)

    # Sub-layers ---------------------------------------------------------
    def merge_pre(self, block: nn.Module):
        """Merge the sub-layer's input."""
        plans, key = self.state.plans, id(block)

        def hook(module: nn.Module, args: tuple, kwargs: dict):
            plan = plans.get(key)
            if plan is None:
                return None
            if "forward" in module.__dict__:  # replaced after patching (SAG's dynamic target)
                plans.pop(key)                  # this block runs unmerged this time
                self.state.warn_once(f"ToMe: skipped a block whose {type(module).__name__} "
                                     "forward another extension replaced (e.g. Self-Attention "
                                     "Guidance); it needs every token")
                return None
            hidden = _first(args, kwargs, _X_NAMES, 0)
            return _set_first(args, kwargs, _X_NAMES, plan.merge(hidden))
        return hook

    def unmerge_post(self, block: nn.Module):
        """Unmerge the sub-layer's output."""
        plans, key = self.state.plans, id(block)

        def hook(module: nn.Module, args: tuple, kwargs: dict, out: Any):
            plan = plans.get(key)
            if plan is None:
                return None
            if isinstance(out, tuple):  # some attention processors return (hidden, extra)
                return (plan.unmerge(out[0]), *out[1:])
            return plan.unmerge(out)
        return hook

    def downsample_pre(self, block: nn.Module):
        """Give ``attn1`` pooled keys and values. The keyword that carries them: ldm/sgm
        ``context``, diffusers ``encoder_hidden_states``."""
        plans, key = self.state.plans, id(block)
        kv_name = "context" if _family(block) in ("ldm", "sgm") else "encoder_hidden_states"

        def hook(module: nn.Module, args: tuple, kwargs: dict):
            plan = plans.get(key)
            if plan is None:
                return None
            return args, {**kwargs, kv_name: plan.kv(_first(args, kwargs, _X_NAMES, 0))}
        return hook


# ----------------------------------------------------------------------------- public API

def apply(model: Any, config: ToMeConfig) -> Any:
    """Patch ``model`` with ``config``. Atomic: on any error the model is left as it was."""
    unet = find_unet(model)
    named = [(n, m) for n, m in unet.named_modules() if _is_block(m)]
    blocks = [m for _, m in named]
    if not blocks:
        raise UnsupportedModelError(
            f"ToMe: {type(unet).__name__} has no {BLOCK_CLASS}; SD3/MMDiT, Flux and compiled or "
            "replaced UNets (e.g. TensorRT) are not supported")
    remove(unet)
    replaced = False
    if _tomesd_patched(unet):
        remove_tomesd(unet)
        replaced = True
        warnings.warn("ToMe: the model was patched by tomesd (e.g. the WebUI's built-in token "
                      "merging); that patch was removed so tokens are never merged twice",
                      stacklevel=3)
    levels = block_levels(unet)
    known = sorted({d for d in levels.values() if d > 0})
    max_ds = _plan.auto_max_downsample(config, known)
    report = PatchReport(family=_family(blocks[0]), config=config, max_downsample=max_ds,
                         total_blocks=len(blocks), replaced_tomesd=replaced)
    targets = []
    for name, b in named:
        ds = levels.get(b, 0)
        if ds > max_ds:  # never merged: whatever else patches it is no concern of ours
            continue
        problem = _block_problem(b, config)
        if problem:
            report.skipped.append((name, problem))
            continue
        targets.append(b)
        if ds:
            report.levels[ds] = report.levels.get(ds, 0) + 1
    if report.skipped:
        # warnings shows an identical message once, so hosts re-applying per pass do not spam.
        warnings.warn(f"ToMe: skipped {len(report.skipped)} of {len(blocks)} block(s): "
                      f"{report.skipped[0][1]}", stacklevel=3)
    if config.max_downsample is not None and known and not report.levels:
        warnings.warn(f"ToMe: max_downsample={config.max_downsample} merges nothing on this "
                      f"model (its transformer blocks are at downsample {known}); use "
                      f"max_downsample=None (auto) or >= {known[0]}", stacklevel=3)

    state = _State(config, report, decoder_blocks(unet))
    hooks = _Hooks(state)
    try:
        h = state.handles
        h.append(unet.register_forward_pre_hook(hooks.unet_pre, with_kwargs=True))
        h.append(unet.register_forward_hook(hooks.unet_post, with_kwargs=True))
        for b in targets:
            h.append(b.register_forward_pre_hook(hooks.block_pre, with_kwargs=True))
            h.append(b.register_forward_hook(hooks.block_post, with_kwargs=True))
            for name in _sub_layers(config):
                sub = getattr(b, name)
                if config.method == "downsample":  # downsampled keys need no unmerge
                    h.append(sub.register_forward_pre_hook(hooks.downsample_pre(b),
                                                           with_kwargs=True))
                    continue
                h.append(sub.register_forward_pre_hook(hooks.merge_pre(b), with_kwargs=True))
                h.append(sub.register_forward_hook(hooks.unmerge_post(b), with_kwargs=True))
        setattr(unet, STATE_ATTR, state)
    except BaseException:
        for handle in state.handles:
            handle.remove()
        vars(unet).pop(STATE_ATTR, None)
        raise
    return model


def remove(model: Any) -> Any:
    """Remove our patch: hooks and attributes go; a tomesd patch, if any, is left alone."""
    unet = _patched_unet(model)
    state = vars(unet).pop(STATE_ATTR, None)
    if state is not None:
        for handle in state.handles:
            handle.remove()
    return model


def _patched_unet(model: Any) -> nn.Module:
    """The module that carries our state: ``model`` itself if it does, else its UNet."""
    return model if hasattr(model, STATE_ATTR) else find_unet(model)


def state_of(model: Any) -> _State | None:
    try:
        return getattr(_patched_unet(model), STATE_ATTR, None)
    except UnsupportedModelError:
        return None
