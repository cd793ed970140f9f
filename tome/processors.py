"""Patching DiTs (diffusers Flux and SD3, A1111's SD3): the image tokens' keys and values
pooled inside each chosen block's attention.

Pooling happens inside the attention processor call (projections, norms, text+image, RoPE,
kernel). Each chosen module's processor is wrapped: a call with no plan for its block (the
schedule's window, the auto policy, another patch's state) goes to the original untouched,
so those calls and, after removal, every call are bit-identical to the unpatched model. A
call with a plan runs ``_flux`` or ``_joint``: diffusers' ``FluxAttnProcessor`` /
``JointAttnProcessor2_0`` maths (the only processors wrapped; any other, e.g. IP-Adapter's,
leaves its block unpooled and reported) with the image keys/values pooled, the
proportional-attention bias and residual reuse (``attend.py``) around the original's kernel.

Per transformer call a pre-hook reads the latent grid (SD3: the latent's shape; Flux: the
``img_ids``, once per ids tensor) and the text length; the shared ``plan.Planner`` says
whether this call pools, the schedule which factor each block gets. A1111 1.10 runs SD3 on
Stability's reference MMDiT (no processors): its blocks' ``attn.pre_attention`` and
``post_attention`` are shadowed on the instance (``attend.PreAttention``,
``attend.PostAttention``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from . import attend as _attend
from . import dit
from . import plan as _plan
from .attend import PostAttention, PreAttention
from .config import ToMeConfig
from .layout import Block, Layout
from .report import PROCESSORS, STATE_ATTR, PatchReport

# The processors whose maths ``_flux`` / ``_joint`` reproduce (class names, any diffusers
# version that has them); pooling any other one would drop what it adds.
FLUX_PROCESSORS = ("FluxAttnProcessor", "FluxAttnProcessor2_0")
JOINT_PROCESSORS = ("JointAttnProcessor2_0",)


class _State:
    """One patched DiT: the planner, the current call's plan, progress and text length, and
    the kept residuals of ``reuse``."""

    def __init__(self, config: ToMeConfig, report: PatchReport, layout: Layout):
        self.config, self.report, self.layout = config, report, layout
        self.planner: _plan.Planner = report.planner
        self.schedule = dit.schedule_of(config)
        self.count = len(layout.blocks)
        self.handles: list[Any] = []   # hook handles on the transformer
        self.wrapped: list[tuple[nn.Module, str, Any]] = []  # (module, attribute, original)
        self.plan: dit.DitPlan | None = None
        self.plans: dict[int, dit.DitPlan] = {}  # this call's plan per scheduled factor
        self.p: float | None = None    # this call's sampling progress, where read
        self.text = 0                  # text tokens in this call (single blocks' span start)
        self._ids: tuple[Any, Any] = (None, None)  # (img_ids tensor, its grid)
        self.reuse = _attend.Reuse(config.reuse)
        self.hooks: _Hooks | None = None
        self.removed = False           # removed while torch held its call hook

    def plan_for(self, index: int, kind: str) -> dit.DitPlan | None:
        """Block ``index``'s plan in this call: the schedule's factor for it now, or None."""
        base = self.plan
        if base is None:
            return None
        f = self.schedule.factor(index, kind, self.count, self.p)
        if f == 0:
            return None
        if f == base.factor:
            return base
        if f not in self.plans:
            self.plans[f] = base.with_factor(f)
        return self.plans[f]

    def grid(self, img_ids: torch.Tensor) -> tuple[int, int] | None:
        """The generated image's token grid from Flux's ``img_ids`` (rows, columns), once per
        ids tensor: pipelines pass the same one at every step. Reference images (Kontext) are
        appended with another first id and are left unpooled."""
        if self._ids[0] is img_ids:
            return self._ids[1]
        ids = img_ids[0] if img_ids.dim() == 3 else img_ids  # older pipelines: [B, S, 3]
        gen = ids[ids[:, 0] == ids[0, 0]]
        lo, hi = gen[:, 1:3].amin(0), gen[:, 1:3].amax(0)
        h, w = (int(v) + 1 for v in (hi - lo).tolist())
        grid = (h, w) if h * w == gen.shape[0] else None
        self._ids = (img_ids, grid)
        return grid


def _arg(args: tuple, kwargs: dict, name: str, pos: int) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name)


class _Hooks:
    """The transformer's pre- and post-hook: start and end a call."""

    def __init__(self, state: _State):
        self.state = state

    def call_pre(self, module: nn.Module | None, args: tuple, kwargs: dict) -> None:
        st = self.state
        st.plan = None
        if st.removed:  # removed while torch held this call's hooks (adapters.remove)
            return
        x, text, t = (_arg(args, kwargs, name, pos) for name, pos in st.layout.dit.call)
        if not isinstance(x, torch.Tensor):
            return
        p = st.layout.dit.patch
        if x.dim() == 4:      # SD3: the latent itself
            size = tuple(x.shape[-2:])
        else:                 # Flux: packed tokens; the grid is in img_ids
            ids = _arg(args, kwargs, "img_ids", 4)
            grid = st.grid(ids) if isinstance(ids, torch.Tensor) else None
            if grid is None:
                return
            size = (grid[0] * p, grid[1] * p)
        st.text = text.shape[1] if isinstance(text, torch.Tensor) and text.dim() == 3 else 0
        c = st.planner.config  # its window is the schedule's
        read = st.schedule.varies() or st.reuse.every > 0
        if isinstance(t, torch.Tensor) and (c.start > 0 or c.end < 1 or read):
            t = t * st.layout.dit.timestep_scale
        st.plans, st.p = {}, None
        call = st.planner.begin(size, x.device, t, x.shape[0])
        if call is not None:
            h, w = math.ceil(size[0] / p), math.ceil(size[1] / p)
            st.plan = st.planner.plan(call, x.new_zeros(()).expand(x.shape[0], h * w, 1))
            if st.plan is not None and read and t is not None:
                # The one host read of a call (as the planner's window), only where needed.
                tv = float(t.reshape(-1)[0]) if isinstance(t, torch.Tensor) else float(t)
                st.p = 1.0 - tv / _plan.NUM_TRAIN_TIMESTEPS
                st.reuse.begin(st.p)

    def post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self.state.plan = None


# ----------------------------------------------------------------------------- processors

class PoolingProcessor:
    """Wraps one attention module's processor (not an ``nn.Module``: the model's modules and
    state dict stay as they were). ``source`` gives block ``index``'s plan (``plan_for``), the
    text length and the reuse state (a patch's state, or a fixed plan when measuring)."""

    def __init__(self, original: Any, source: Any, flux: bool, index: int = 0,
                 kind: str = "double"):
        self.original, self.source, self.flux = original, source, flux
        self.index, self.kind = index, kind

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: Any = None, **kwargs: Any) -> Any:
        plan = self.source.plan_for(self.index, self.kind)
        if plan is None or attention_mask is not None or kwargs:
            if image_rotary_emb is not None or self.flux:
                return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                     image_rotary_emb, **kwargs)
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 **kwargs)
        if self.flux:
            return _flux(self, attn, plan, hidden_states, encoder_hidden_states,
                         image_rotary_emb)
        return _joint(attn, plan, hidden_states, encoder_hidden_states, self)


def _flux(wrapper: PoolingProcessor, attn: nn.Module, plan: dit.DitPlan, hs: torch.Tensor,
          ehs: torch.Tensor | None, emb: Any) -> Any:
    """diffusers' ``FluxAttnProcessor`` with the image keys/values pooled. Sequence dim 1,
    [B, S, heads, head_dim]; joint sequence [text, image]."""
    from diffusers.models.embeddings import apply_rotary_emb

    original = wrapper.original
    joint = ehs is not None and attn.added_kv_proj_dim is not None
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(hs).chunk(3, dim=-1)
        if joint:
            eq, ek, ev = attn.to_added_qkv(ehs).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)
        if joint:
            eq, ek, ev = attn.add_q_proj(ehs), attn.add_k_proj(ehs), attn.add_v_proj(ehs)
    q, k, v = (t.unflatten(-1, (-1, attn.head_dim)) for t in (q, k, v))
    q, k = attn.norm_q(q), attn.norm_k(k)
    start = wrapper.source.text
    if joint:
        eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
        eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
        q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
        start = ehs.shape[1]
    if start + plan.h * plan.w > k.shape[1]:  # not the sequence the plan was made for
        return original(attn, hs, ehs, None, emb)
    out = _attend.attend(wrapper, _attend.dispatch(original), plan, q, k, v, start, 1, emb,
                  lambda x, e: apply_rotary_emb(x, e, sequence_dim=1))
    out = out.flatten(2, 3).to(q.dtype)
    if ehs is None:
        return out
    ehs_out, out = out.split_with_sizes([ehs.shape[1], out.shape[1] - ehs.shape[1]], dim=1)
    out = attn.to_out[1](attn.to_out[0](out.contiguous()))
    return out, attn.to_add_out(ehs_out.contiguous())


def _joint(attn: nn.Module, plan: dit.DitPlan, hs: torch.Tensor, ehs: torch.Tensor | None,
           wrapper: PoolingProcessor | None = None) -> Any:
    """diffusers' ``JointAttnProcessor2_0`` (SD3, SD3.5) with the image keys/values pooled.
    [B, heads, S, head_dim]; joint sequence [image, text]; no rotary positions; PyTorch's SDPA
    (what the processor calls), the bias as its mask."""
    b, n = hs.shape[0], hs.shape[1]
    q, k, v = attn.to_q(hs), attn.to_k(hs), attn.to_v(hs)
    hd = k.shape[-1] // attn.heads
    q, k, v = (t.view(b, -1, attn.heads, hd).transpose(1, 2) for t in (q, k, v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    if ehs is not None:
        eq, ek, ev = (p(ehs).view(b, -1, attn.heads, hd).transpose(1, 2)
                      for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        if attn.norm_added_q is not None:
            eq = attn.norm_added_q(eq)
        if attn.norm_added_k is not None:
            ek = attn.norm_added_k(ek)
        q, k, v = torch.cat([q, eq], 2), torch.cat([k, ek], 2), torch.cat([v, ev], 2)
    out = _attend.attend(wrapper, _attend.sdpa, plan, q, k, v, 0, 2)
    out = out.transpose(1, 2).reshape(b, -1, attn.heads * hd).to(q.dtype)
    ehs_out = None
    if ehs is not None:
        out, ehs_out = out[:, :n], out[:, n:]
        if not attn.context_pre_only:
            ehs_out = attn.to_add_out(ehs_out)
    out = attn.to_out[1](attn.to_out[0](out))
    return out if ehs is None else (out, ehs_out)


# ----------------------------------------------------------------------------- blocks

def attentions(block: nn.Module) -> list[nn.Module]:
    """The attention modules of a DiT block that pool: ``attn``, and SD3.5's image-only
    ``attn2``; in A1111's MMDiT, the image block's ``attn``."""
    if hasattr(block, "x_block"):
        return [block.x_block.attn]
    return [a for a in (getattr(block, "attn", None), getattr(block, "attn2", None))
            if isinstance(a, nn.Module)]


def _mmdit(attn: nn.Module) -> bool:
    return hasattr(type(attn), "pre_attention") and not hasattr(attn, "processor")


def block_problem(block: nn.Module) -> str | None:
    """Why a DiT block stays unpooled, or None: a processor this adapter does not reproduce
    (another extension's or library's, e.g. IP-Adapter), or one wrapped by a patch of ours."""
    attns = attentions(block)
    if not attns:
        return f"unsupported block variant {type(block).__qualname__}: no attn"
    for a in attns:
        if _mmdit(a):
            shadow = vars(a).get("pre_attention")
            if isinstance(shadow, PreAttention):
                return "already pooled by another ToMe patch"
            if shadow is not None:
                return "pre_attention replaced on the instance by another extension"
            continue
        name = type(getattr(a, "processor", None)).__name__
        if name == PoolingProcessor.__name__:
            return "already pooled by another ToMe patch"
        if name not in FLUX_PROCESSORS + JOINT_PROCESSORS:
            return f"attention processor {name} is not one ToMe reproduces (e.g. IP-Adapter's)"
        if name in FLUX_PROCESSORS and not _flux_maths_match(a):
            import diffusers
            return (f"diffusers {diffusers.__version__}'s Flux attention predates the one ToMe "
                    "reproduces (diffusers 0.35 or later)")
    return None


def _flux_maths_match(attn: nn.Module) -> bool:
    """``_flux`` reproduces diffusers' Flux attention from 0.35 on ([B, S, heads, head_dim],
    ``attn.head_dim``, ``apply_rotary_emb(..., sequence_dim=1)``); older releases (SD.Next
    pins 0.33) lay it out otherwise: their blocks stay unpooled, never fail a generation."""
    import inspect

    from diffusers.models.embeddings import apply_rotary_emb
    return hasattr(attn, "head_dim") and \
        "sequence_dim" in inspect.signature(apply_rotary_emb).parameters


def _shadow(module: nn.Module, name: str, cls: type, into: list, *args: Any) -> None:
    """Shadow ``module.name`` on the instance with ``cls(original, *args)`` (one of ours)."""
    current = vars(module).get(name)
    original = current.original if isinstance(current, (PreAttention, PostAttention)) \
        else getattr(module, name)
    setattr(module, name, cls(original, *args))
    into.append((module, name, current))


def _wrap(block: nn.Module, source: Any, into: list, index: int = 0, kind: str = "double"
          ) -> None:
    if hasattr(block, "x_block"):  # A1111's MMDiT
        shared: dict = {}  # one block call's head dim and (with reuse) q, k, v
        heads = block.x_block.attn.num_heads  # the joint kernel's (block_mixing's)
        for part, image in ((block.context_block, False), (block.x_block, True)):
            for name, cls in (("pre_attention", PreAttention), ("post_attention", PostAttention)):
                _shadow(part.attn, name, cls, into, source, index, kind, image, heads, shared)
        return
    for a in attentions(block):
        current = original = a.processor
        if isinstance(original, PoolingProcessor):  # measuring a patched block: one wrapper
            original = original.original
        flux = type(original).__name__ in FLUX_PROCESSORS
        a.processor = PoolingProcessor(original, source, flux, index, kind)
        into.append((a, "processor", current))


def _unwrap(wrapped: list[tuple[nn.Module, str, Any]]) -> None:
    """Put the originals back, where ours is still in place."""
    for a, name, original in reversed(wrapped):
        if name == "processor":
            if isinstance(vars(a).get("processor"), PoolingProcessor):
                a.processor = original
        elif isinstance(vars(a).get(name), (PreAttention, PostAttention)):
            del vars(a)[name]
            if original is not None:
                setattr(a, name, original)
    wrapped.clear()


# ----------------------------------------------------------------------------- one block

class _Fixed:
    """A plan source for one measured run: ``plan`` for every block, no reuse."""

    def __init__(self, plan: Any, text: int):
        self.plan, self.text, self.p, self.reuse = plan, text, None, _attend.Reuse(0)

    def plan_for(self, index: int, kind: str) -> Any:
        return self.plan


def runner(layout: Layout):
    """``run_block(block, x, context, planner, plan)`` for ``measure``: one DiT block on image
    tokens ``x`` with a text of the family's length, a time embedding and (Flux) the rotary
    embedding of the grid, pooled by ``plan`` (None: unpooled), through the same wrapper a
    patched block runs. Inputs come from a private generator; the processors are restored."""
    d = layout.dit

    def run_block(block: nn.Module, x: torch.Tensor, context: Any, planner: _plan.Planner,
                  plan: Any) -> Any:
        b, n, c = x.shape
        g = torch.Generator().manual_seed(n)
        text = torch.randn(b, d.text_tokens, c, generator=g).to(x.device, x.dtype)
        temb = torch.randn(b, c, generator=g).to(x.device, x.dtype)
        kw: dict[str, Any] = {"temb": temb}
        if d.rope:
            h, w = (math.ceil(s / d.patch) for s in planner.size)
            ids = torch.zeros(d.text_tokens + h * w, 3, device=x.device)
            ids[d.text_tokens:, 1] = torch.arange(h, device=x.device).repeat_interleave(w)
            ids[d.text_tokens:, 2] = torch.arange(w, device=x.device).repeat(h)
            kw["image_rotary_emb"] = layout.root.pos_embed(ids)
        wrapped: list = []
        try:
            _wrap(block, _Fixed(plan, d.text_tokens), wrapped)
            if hasattr(block, "x_block"):  # A1111's MMDiT: (context, x, c=)
                return block(text, x, c=temb)
            return block(hidden_states=x, encoder_hidden_states=text, **kw)
        finally:
            _unwrap(wrapped)
    return run_block


# ----------------------------------------------------------------------------- public API

def apply(model: Any, layout: Layout, config: ToMeConfig, measurer: Any = None) -> PatchReport:
    """Wrap the attention processors of the DiT blocks ``config.blocks`` names and say what
    was done; atomic (on any error the processors are back as they were). ``measurer``: the
    auto policy's measuring service, as for UNets."""
    root, d = layout.root, layout.dit
    method = dit.method_for(config)
    report = PatchReport(family=layout.family, config=config, max_downsample=d.patch,
                         total_blocks=len(layout.blocks), adapter=PROCESSORS, kind="DiT",
                         unmergeable=None if method else dit.no_form(config, layout.family))
    targets: list[tuple[int, Block]] = []
    schedule = dit.schedule_of(config)
    for i, b in enumerate(layout.blocks):
        if method is None or not schedule.factor(i, b.kind, len(layout.blocks), None):
            continue
        problem = block_problem(b.module)
        if problem:
            report.skipped.append((b.name, problem))
            continue
        targets.append((i, b))
        report.levels[d.patch] = report.levels.get(d.patch, 0) + 1
    if method is not None and not targets and not report.skipped:
        report.unmergeable = (f"ToMe: blocks={config.blocks!r} names no block of this DiT (it "
                              f"has {len(layout.blocks)}, double-stream first)")
    measured = measurer.for_model(model, config, runner(layout)) if measurer is not None \
        else None
    lo, hi = schedule.window()  # the planner lets in the steps where any block pools
    report.planner = _plan.Planner(config.replace(start=lo, end=hi), d.patch, measured,
                                   sorted(report.levels), method=method)
    state = _State(config, report, layout)
    hooks = state.hooks = _Hooks(state)
    try:
        state.handles.append(root.register_forward_pre_hook(hooks.call_pre, with_kwargs=True))
        state.handles.append(root.register_forward_hook(hooks.post, with_kwargs=True))
        for i, b in targets:
            _wrap(b.module, state, state.wrapped, i, b.kind)
        setattr(root, STATE_ATTR, state)
    except BaseException:
        _remove(state)
        vars(root).pop(STATE_ATTR, None)
        raise
    return report


def _remove(state: _State) -> None:
    state.removed, state.plan = True, None  # a hook torch still holds for a call: inert
    for h in state.handles:
        h.remove()
    state.handles.clear()
    _unwrap(state.wrapped)


def remove(root: nn.Module) -> bool:
    """Remove a DiT patch from ``root``; whether there was one."""
    state = vars(root).get(STATE_ATTR)
    if not isinstance(state, _State):
        return False
    _remove(state)
    del vars(root)[STATE_ATTR]
    return True
