"""Patching DiTs (diffusers Flux and SD3, A1111's SD3): the image tokens' keys and values
pooled inside each chosen block's attention.

A DiT's attention projects, normalises, concatenates text and image, applies rotary
positions and calls the kernel, all inside one processor call, so pooling has to happen
there. Each chosen attention module's processor is wrapped: a call with no pooling plan (the
step is outside the window, the auto policy says no, another patch's state) goes to the
original processor untouched, so those calls and, after removal, every call are bit-identical
to the unpatched model. A call with a plan runs ``_flux`` or ``_joint``: the same projections,
norms and output layers as diffusers' ``FluxAttnProcessor`` / ``JointAttnProcessor2_0`` (the
only processors wrapped; any other, e.g. IP-Adapter's, leaves its block unpooled and
reported), with the image keys and values pooled (``dit.py``) before the kernel, which is
diffusers' own dispatcher with the original processor's backend for Flux.

Per transformer call a pre-hook reads the latent grid (SD3: the latent's shape; Flux: the
``img_ids`` rows and columns, read once per ids tensor, i.e. once per generation) and the
text length, and the shared ``plan.Planner`` says whether this call pools (window, auto
policy) and with which plan. Removal puts the original processor objects back.

A1111 1.10 runs SD3 on Stability's reference MMDiT, whose blocks have no processors: there the
image block's ``attn.pre_attention`` is shadowed on the instance (``PreAttention``), which
pools the image keys/values before the block joins them to the text's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import dit
from . import plan as _plan
from .config import ToMeConfig
from .layout import Block, Layout
from .report import PROCESSORS, PatchReport

# The processors whose maths ``_flux`` / ``_joint`` reproduce (class names, any diffusers
# version that has them); pooling any other one would drop what it adds.
FLUX_PROCESSORS = ("FluxAttnProcessor", "FluxAttnProcessor2_0")
JOINT_PROCESSORS = ("JointAttnProcessor2_0",)


class _State:
    """One patched DiT: the planner, the current call's plan and text length."""

    def __init__(self, config: ToMeConfig, report: PatchReport, layout: Layout):
        self.config, self.report, self.layout = config, report, layout
        self.planner: _plan.Planner = report.planner
        self.handles: list[Any] = []   # hook handles on the transformer
        self.wrapped: list[tuple[nn.Module, Any]] = []  # (attention module, original processor)
        self.plan: dit.DitPlan | None = None
        self.text = 0                  # text tokens in this call (single blocks' span start)
        self._ids: tuple[Any, Any] = (None, None)  # (img_ids tensor, its grid)

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

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        st = self.state
        st.plan = None
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
        c = st.config
        if isinstance(t, torch.Tensor) and (c.start > 0 or c.end < 1):
            t = t * st.layout.dit.timestep_scale
        call = st.planner.begin(size, x.device, t, x.shape[0])
        if call is not None:
            h, w = math.ceil(size[0] / p), math.ceil(size[1] / p)
            st.plan = st.planner.plan(call, x.new_zeros(()).expand(x.shape[0], h * w, 1))

    def post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self.state.plan = None


# ----------------------------------------------------------------------------- processors

class PoolingProcessor:
    """Wraps one attention module's processor (not an ``nn.Module``: the model's modules and
    state dict stay as they were). ``source`` has ``plan`` and ``text`` (a patch's state, or
    a fixed pair when measuring)."""

    def __init__(self, original: Any, source: Any, flux: bool):
        self.original, self.source, self.flux = original, source, flux

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: Any = None, **kwargs: Any) -> Any:
        plan = self.source.plan
        if plan is None or attention_mask is not None or kwargs:
            if image_rotary_emb is not None or self.flux:
                return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                     image_rotary_emb, **kwargs)
            return self.original(attn, hidden_states, encoder_hidden_states, attention_mask,
                                 **kwargs)
        if self.flux:
            return _flux(self.original, attn, plan, hidden_states, encoder_hidden_states,
                         image_rotary_emb, self.source.text)
        return _joint(attn, plan, hidden_states, encoder_hidden_states)


def _pool_kv(plan: dit.DitPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             start: int, dim: int, emb: Any, rotate: Any) -> tuple[torch.Tensor, ...]:
    """Queries (rotated) and pooled keys/values; ``rotate(x, emb)`` applies the embedding."""
    if emb is None:
        return q, plan.pool(k, start, dim), plan.pool(v, start, dim)
    q = rotate(q, emb)
    if plan.rope == "before":
        k = plan.pool(rotate(k, emb), start, dim)
    else:
        pooled = plan.positions(emb, start, lambda e: dit.pool_cos_sin(
            e[0], e[1], start, plan.h, plan.w, plan.factor))
        k = rotate(plan.pool(k, start, dim), pooled)
    return q, k, plan.pool(v, start, dim)


def _flux(original: Any, attn: nn.Module, plan: dit.DitPlan, hs: torch.Tensor,
          ehs: torch.Tensor | None, emb: Any, text: int) -> Any:
    """diffusers' ``FluxAttnProcessor`` with the image keys/values pooled. Sequence dim 1,
    [B, S, heads, head_dim]; joint sequence [text, image]."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.embeddings import apply_rotary_emb

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
    start = text
    if joint:
        eq, ek, ev = (t.unflatten(-1, (-1, attn.head_dim)) for t in (eq, ek, ev))
        eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
        q, k, v = torch.cat([eq, q], 1), torch.cat([ek, k], 1), torch.cat([ev, v], 1)
        start = ehs.shape[1]
    if start + plan.h * plan.w > k.shape[1]:  # not the sequence the plan was made for
        return original(attn, hs, ehs, None, emb)
    q, k, v = _pool_kv(plan, q, k, v, start, 1, emb,
                       lambda x, e: apply_rotary_emb(x, e, sequence_dim=1))
    out = dispatch_attention_fn(q, k, v, attn_mask=None,
                                backend=getattr(original, "_attention_backend", None),
                                parallel_config=getattr(original, "_parallel_config", None))
    out = out.flatten(2, 3).to(q.dtype)
    if ehs is None:
        return out
    ehs_out, out = out.split_with_sizes([ehs.shape[1], out.shape[1] - ehs.shape[1]], dim=1)
    out = attn.to_out[1](attn.to_out[0](out.contiguous()))
    return out, attn.to_add_out(ehs_out.contiguous())


def _joint(attn: nn.Module, plan: dit.DitPlan, hs: torch.Tensor, ehs: torch.Tensor | None
           ) -> Any:
    """diffusers' ``JointAttnProcessor2_0`` (SD3, SD3.5) with the image keys/values pooled.
    [B, heads, S, head_dim]; joint sequence [image, text]; no rotary positions."""
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
    k, v = plan.pool(k, 0, 2), plan.pool(v, 0, 2)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
    out = out.transpose(1, 2).reshape(b, -1, attn.heads * hd).to(q.dtype)
    ehs_out = None
    if ehs is not None:
        out, ehs_out = out[:, :n], out[:, n:]
        if not attn.context_pre_only:
            ehs_out = attn.to_add_out(ehs_out)
    out = attn.to_out[1](attn.to_out[0](out))
    return out if ehs is None else (out, ehs_out)


class PreAttention:
    """A1111's MMDiT (SD3): the image block's ``attn.pre_attention`` shadowed on the instance.
    It returns the image tokens' q, k, v ([B, S, heads * D]) before the block joins them to
    the text's; pooling k and v there is pooling the joint keys' image part (no RoPE in
    SD3). Removal deletes the instance attribute: the class's method is back."""

    def __init__(self, original: Any, source: Any):
        self.original, self.source = original, source

    def __call__(self, x: torch.Tensor) -> Any:
        q, k, v = self.original(x)
        plan = self.source.plan
        if plan is None or k.shape[1] != plan.h * plan.w:
            return q, k, v
        return q, plan.pool(k, 0, 1), plan.pool(v, 0, 1)


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
    return None


def _wrap(block: nn.Module, source: Any, into: list) -> None:
    for a in attentions(block):
        if _mmdit(a):
            current = vars(a).get("pre_attention")
            original = current.original if isinstance(current, PreAttention) else a.pre_attention
            a.pre_attention = PreAttention(original, source)
            into.append((a, current))
            continue
        current = original = a.processor
        if isinstance(original, PoolingProcessor):  # measuring a patched block: one wrapper
            original = original.original
        flux = type(original).__name__ in FLUX_PROCESSORS
        a.processor = PoolingProcessor(original, source, flux)
        into.append((a, current))


def _unwrap(wrapped: list[tuple[nn.Module, Any]]) -> None:
    """Put the original processors back, where ours is still in place."""
    for a, original in reversed(wrapped):
        if _mmdit(a):
            if isinstance(vars(a).get("pre_attention"), PreAttention):
                del vars(a)["pre_attention"]
                if original is not None:
                    a.pre_attention = original
        elif isinstance(vars(a).get("processor"), PoolingProcessor):
            a.processor = original
    wrapped.clear()


# ----------------------------------------------------------------------------- one block

class _Fixed:
    """A plan source for one measured run."""

    def __init__(self, plan: Any, text: int):
        self.plan, self.text = plan, text


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
    targets: list[Block] = []
    for i, b in enumerate(layout.blocks):
        if method is None or not dit.selects(config.blocks, i, b.kind):
            continue
        problem = block_problem(b.module)
        if problem:
            report.skipped.append((b.name, problem))
            continue
        targets.append(b)
        report.levels[d.patch] = report.levels.get(d.patch, 0) + 1
    if method is not None and not targets and not report.skipped:
        report.unmergeable = (f"ToMe: blocks={config.blocks!r} names no block of this DiT (it "
                              f"has {len(layout.blocks)}, double-stream first)")
    measured = measurer.for_model(model, config, runner(layout)) if measurer is not None \
        else None
    report.planner = _plan.Planner(config, d.patch, measured, sorted(report.levels),
                                   method=method)
    state = _State(config, report, layout)
    hooks = _Hooks(state)
    try:
        state.handles.append(root.register_forward_pre_hook(hooks.pre, with_kwargs=True))
        state.handles.append(root.register_forward_hook(hooks.post, with_kwargs=True))
        for b in targets:
            _wrap(b.module, state, state.wrapped)
        setattr(root, STATE_ATTR, state)
    except BaseException:
        _remove(state)
        vars(root).pop(STATE_ATTR, None)
        raise
    return report


STATE_ATTR = "_tome_sd_state"  # the same attribute as the hook adapter's: one patch per model


def _remove(state: _State) -> None:
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
