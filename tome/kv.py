"""One attention step for every DiT host: the image keys/values of one attention call pooled
per cell of the call's grid, keys rotated where the host rotates inside, the proportional
bias as the kernel's mask or as an extra channel, the call's own mask pooled along with the
keys, the kernel (the host's, or an override chained), and residual reuse's guard around it.

``step`` is that step on a plan; ``pool_call`` is it for a per-call host (ComfyUI's
override, Forge Neo's swap: a ``CallState`` from ``Spans``, the plan cached per grid and
factor: ``dit.cached_plan``); ``attend_plan`` is it for a processor (diffusers, A1111's SD3:
the family's maths hand the plan, the rotation and diffusers' kernel). ``Spans`` and
``CallState`` say where one model call's tokens sit and what it pools; ``key_start`` reads
an attention call's lengths against them. The families' files call these; nothing here
names a family or a host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from . import attend, dit, graphs


class Spans(NamedTuple):
    """Where one model call's image tokens sit (plain ints, from the latent's shape)."""

    text: int          # text tokens in joint attention (0: the family has none)
    text_first: bool   # the joint order is [text, image] (else [image, text])
    before: int        # other tokens before the image (Wan's reference latent): unpooled
    frames: int        # the image grid in tokens, frame-major
    h: int
    w: int
    after: int = 0     # tokens after the image (Kontext / Qwen-Image edit references): unpooled
    cross: tuple = ()  # cross-attention's key lengths (text, image prompt): never extra keys

    @property
    def image(self) -> int:
        return self.frames * self.h * self.w

    def start(self, length: int, whole: bool = False) -> int | None:
        """Where the image starts in a self-attention call of ``length`` tokens (joint or
        image-only), or None where the call is not one of this model call's sequences;
        ``whole``: joint calls only where the family has text (Forge Neo's Lumina runs
        refiner blocks over the image alone, which stay unpooled); an image-only call as long
        as the text is not placed (ComfyUI's Lumina refines the caption alone, then the image)."""
        core = self.before + self.image + self.after
        if self.text and length == self.text + core:
            return self.before + (self.text if self.text_first else 0)
        alone = length == core and not (self.text and (whole or length == self.text))
        return self.before if alone else None


class CallState(NamedTuple):
    """What one model call pools: its spans, the factor of each block (in the model's order,
    double-stream blocks first; 0 or 1: unpooled), whether pooled keys get the bias, and
    residual reuse (``attend.Reuse``, decided for this call on the host; None: none) with
    each block's part (what its residuals are kept on)."""

    spans: Spans
    factors: tuple[int, ...]
    doubles: int
    proportional: bool
    reuse: Any = None
    parts: tuple = ()
    grid: Any = None  # ``graphs.grid_tensor`` of the spans' grid: its sizes symbolic in a graph
    temporal: int = 1  # frames per cell (``ToMeConfig.temporal``)
    seen: list | None = None  # the blocks this call's compiled attention calls named (``note``)

    def position(self, block_type: Any, index: Any) -> int | None:
        """The block the host names (``block_type`` "double" or "single", ``block_index``)
        in the model's order, or None (no block information, or not a block of the model)."""
        if not isinstance(index, int):
            return None
        pos = index + (self.doubles if block_type == "single" else 0)
        return pos if 0 <= pos < len(self.factors) else None

    def note(self, block: tuple) -> None:
        """While compiling, where the call's blocks differ (residuals of their own, or
        factors), count the named block on ``seen``: a graph then guards on how many came
        before it. TorchCompileModel drops every guard on ``transformer_options``, so a frame
        a graph break split off (ComfyUI's CPU attention breaks the graph) would run the
        graph traced for one block for every block, the block read from them baked in; the
        count makes it one graph per block there (inside one traced model call it is read
        once, at 0)."""
        if self.seen is not None and graphs.compiling() and (
                self.reuse is not None or len(set(self.factors)) > 1):
            self.seen.append(block)

    def factor(self, block_type: Any, index: Any) -> int:
        """The factor of the block the host names; without block information, the factor
        all blocks share (0 where they differ)."""
        if isinstance(index, int):
            pos = self.position(block_type, index)
            return 0 if pos is None else self.factors[pos]
        return self.factors[0] if len(set(self.factors)) == 1 else 0

    def part(self, block_type: Any, index: Any) -> Any:
        """The named block's part for residual reuse, or None (no reuse in this call)."""
        pos = self.position(block_type, index) if self.reuse is not None else None
        return None if pos is None or pos >= len(self.parts) else self.parts[pos]

    def start(self, queries: int, keys: int, whole: bool = False) -> int | None:
        """Where the image keys start in an attention call of these lengths (keys as long as
        the queries, or longer: ``percall_calls.key_start``), or None: not a self-attention
        over this call's sequence (cross-attention: also keys as long as ``spans.cross``)."""
        cross = keys != queries and keys in self.spans.cross
        return None if cross else key_start(self.spans, queries, keys, whole)


def key_start(spans: Any, queries: int, keys: int, whole: bool = False) -> int | None:
    """Where the image keys start in an attention call of these lengths (``spans``: the model
    call's ``Spans``), or None: not a self-attention over this call's sequence. Keys longer
    than the queries: the call's own tokens with extra keys on one side (a KV cache's
    reference, ComfyUI's FluxKVCache)."""
    if keys < queries:
        return None
    at = spans.start(keys, whole)
    if at is not None or keys == queries:
        return at
    at = spans.start(queries, whole)  # the call's own tokens, extra keys on one side
    if at is None:
        return None
    return at + (keys - queries) * bool(spans.before)


def channel(kernel: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            bias: torch.Tensor, dim: int, heads: int | None, flat: bool,
            mask: torch.Tensor | None = None) -> Any:
    """The bias as one extra query/key channel per head (``attend.count_channel``) for a
    kernel that takes no mask; the kernel scales by its own (wider) head dim, which
    ``count_channel`` corrects; the extra channels are cut from the output. In ``[B, S,
    heads * D]`` the keys and values are split by the queries' head width (fewer key heads:
    GQA), each key head widened alike."""
    if dim == 1:  # [B, S, heads * D]
        q = q.unflatten(-1, (heads, -1))
        k, v = (t.unflatten(-1, (-1, q.shape[-1])) for t in (k, v))
    d = q.shape[-1]
    q, k, v = attend.count_channel(q, k, v, bias, dim, attend.channel_width(d) ** -0.5)
    if dim == 1:
        q, k, v = (t.flatten(-2) for t in (q, k, v))
    out = kernel(q, k, v, mask)
    if not flat:  # [B, heads, S, D']
        return out[..., :d]
    return out.unflatten(-1, (heads, -1))[..., :d].flatten(-2)


# ----------------------------------------------------------------------------- one attention call

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], Any]


def step(p: dit.DitPlan, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         dim: int, kernel: Kernel, *, emb: Any = None, rotate: Any = None,
         positions: Any = None, bias: str | None = "mask", heads: int | None = None,
         flat: bool = True, mask: torch.Tensor | None = None, reuse: Any = None,
         part: Any = None, out_dim: int | None = None) -> Any:
    """One pooled attention call on plan ``p``: the image span of ``k`` and ``v`` (sequence
    axis ``dim``, from ``start``) pooled per cell, then ``kernel(q, k, v, mask)``.
    ``emb``: a rotation the queries and keys get here (``rotate(x, emb)``; keys per
    ``p.rope``, ``positions(emb)`` the pooled one). ``bias``: the proportional bias as
    ``"mask"`` (an additive ``[1, 1, 1, keys]`` mask), ``"channel"`` (``channel``; ``heads``
    splits ``[B, S, heads * D]``, ``flat`` says the kernel answers in that layout),
    ``"raw"`` (the ``[keys]`` bias handed to a kernel that places it itself: diffusers'
    dispatcher per backend) or None (left out). ``mask``: the call's own attention mask
    (keys on its last axis), pooled along the keys (``key_mask``), the bias added to it.
    ``reuse`` and ``part``: residual reuse's guard (``Reuse.around``, for self-attention
    only), the unpooled attention run on a refresh; ``out_dim``: the output's sequence axis
    (default: 1 for ``[B, S, heads * D]``, 2 for ``[B, heads, S, D]``)."""
    n = k.shape[dim]
    if emb is not None:
        q = rotate(q, emb)
        kp = p.keys(k, start, dim, emb, rotate, positions)
    else:
        kp = p.pool(k, start, dim)
    vp = p.pool(v, start, dim)
    if bias == "raw":
        out = kernel(q, kp, vp, p.bias(start, n, q.device))
    else:
        b = p.bias(start, n, k.device) if bias else None
        m = None if mask is None else key_mask(p, mask, start, q.dtype)
        if b is None:
            out = kernel(q, kp, vp, m)
        elif bias == "mask":
            b = b.to(q.dtype).view(1, 1, 1, -1)
            out = kernel(q, kp, vp, b if m is None else m + b)
        else:
            out = channel(kernel, q, kp, vp, b, dim, heads, flat, m)
    if part is None or reuse is None or q.shape[dim] != n:  # reuse: self-attention
        return out

    def full(rows: int | None = None) -> Any:  # the unpooled attention (keys rotated)
        return kernel(q if rows is None else q.narrow(dim, 0, rows),
                      k if emb is None else rotate(k, emb), v, mask)
    if out_dim is None:
        out_dim = 1 if out.dim() == 3 else 2
    return reuse.around((part, p.factor), out, full, out_dim, (start, start + p.tokens))


def pool_call(state: CallState, f: int, start: int, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, dim: int, kernel: Kernel, plans: dict, *, rope: str = "before",
              pe: Any = None, bias: str | None = "mask", heads: int | None = None,
              flat: bool = True, part: Any = None, mask: torch.Tensor | None = None) -> Any:
    """``step`` for a per-call host: ``state``'s grid at factor ``f`` (the plan cached in
    ``plans``); ``pe``: a rotation embedding the host applies inside its function (the
    queries and keys are rotated here, keys per ``rope``, and the kernel passes none on);
    ``part``: the block's part where this call reuses residuals (``state.reuse``)."""
    p = dit.cached_plan(plans, state.spans, f, rope, state.proportional, state.temporal)
    rotation = {} if pe is None else {"emb": pe, "rotate": dit.rotate,
                                      "positions": lambda e: p.rotations(e, start)}
    return step(p, start, q, k, v, dim, kernel, bias=bias, heads=heads, flat=flat, mask=mask,
                reuse=state.reuse, part=part, **rotation)


def attend_plan(wrapper: Any, kernel: Any, plan: dit.DitPlan, q: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, start: int, dim: int, emb: Any = None,
                rotate: Any = None, positions: Any = None) -> torch.Tensor:
    """``step`` for a processor (a DiT family's maths on plain modules): ``kernel(q, k, v,
    bias)`` takes the raw bias and places it (``attend.dispatch``, ``attend.sdpa``); queries
    are rotated by ``emb``, keys per ``plan.rope`` (``positions(emb)``: the pooled
    embedding; default diffusers' ``(cos, sin)`` of ``[S, D]`` pooled on the plan's grid);
    residual reuse from ``wrapper.source.reuse``, keyed by ``wrapper``'s block."""
    if getattr(plan, "around", None) is not None:  # Ulysses, cells across shards: parallel.py
        return plan.around(attend_plan, wrapper, q, k, v, start, dim, emb, rotate)
    rotation = {} if emb is None else {
        "emb": emb, "rotate": rotate,
        "positions": positions or (lambda e: plan.cos_sin(e, start))}
    return step(plan, start, q, k, v, dim, kernel, bias="raw",
                reuse=None if wrapper is None else wrapper.source.reuse, part=wrapper,
                out_dim=dim, **rotation)


def key_mask(p: dit.DitPlan, mask: torch.Tensor, start: int, dtype: torch.dtype
             ) -> torch.Tensor:
    """A call's attention mask for its pooled keys: as an additive mask (a boolean one's
    False as ``-inf``) with ComfyUI's axes (``[Sq, Sk]``, ``[B, Sq, Sk]`` or 4-D), its image
    span along the keys pooled like the keys: a cell's entry is the mean of its keys' (0
    where they all attend, ``-inf`` where any is masked), the text part kept as it is."""
    if mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, float("-inf"))
    if mask.dim() == 2:
        mask = mask[None, None]
    elif mask.dim() == 3:
        mask = mask[:, None]
    return p.pool(mask, start, mask.dim() - 1)
