"""DiT key/value pooling: the downsample method (ToDo) for Flux- and SD3-like transformers.

In a DiT's joint attention every token (text and image) attends to every token. Pooling the
*image* tokens' keys and values by ``factor`` per side (the mean of each ``factor x factor``
cell of the token grid) cuts the attention's key length by about ``factor**2`` while queries
and text tokens stay whole: every token still gets its own output, so there is nothing to
unmerge, and any attention kernel runs the shorter keys.

Rotary position embeddings (Flux, Qwen-Image; SD3 has none) are applied to queries and keys
inside attention, so a pooled key needs a position. ``rope`` chooses how:

- ``"before"``: every key is rotated by its own position first, then the rotated keys are
  pooled (what the key would contribute on average over its cell);
- ``"pooled"``: the raw keys are pooled and rotated by their cell's mean position. Neighbouring
  tokens' angles differ by less than pi at every RoPE frequency, so the normalised mean of a
  cell's rotations *is* the rotation by the cell's mean angle: pooling the embedding (cos/sin
  pairs, or ComfyUI's 2x2 rotation matrices) and normalising gives the pooled positions exactly,
  with no model code.

``docs/quality.md`` measures which keeps the image closer. This module is pure tensor code:
the adapters (``processors.py`` for diffusers, ``patcher.py`` for ComfyUI's DiT patch form)
say where the image tokens sit in the joint sequence (``start``), the grid (``frames x h x
w``, frame-major; an image is one frame) and which layout the tensors have (``dim``: the
sequence dimension). A video's cells are spatial within each frame by default; ``temporal``
(the ``temporal`` setting) pools runs of frames too: 2x2x2 cells at factor 2.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from . import graphs, methods
from .schedule import (  # noqa: F401 (the schedule's names as the DiT form's)
    BLOCKS_HELP,
    MAX_FACTOR,
    MAX_ITEMS,
    Schedule,
    parse_blocks,
    schedule_of,
)

ROPES = ("before", "pooled")


# ----------------------------------------------------------------------------- pooling
# A grid is ``frames x h x w`` tokens laid out frame-major (``[frame][row][col]``, as video
# DiTs flatten them; an image is one frame). Cells are ``factor x factor`` within a frame and
# span ``temporal`` frames (1: each frame pooled on its own; 2: pairs of frames, ``2x2x2``).

def pool_span(x: torch.Tensor, start: int, h: int, w: int, factor: int, dim: int,
              frames: int = 1, temporal: int = 1) -> torch.Tensor:
    """``x`` with its ``frames*h*w`` image tokens at ``[start, start + frames*h*w)`` along
    ``dim`` replaced by their cell means (``pooled_tokens`` of them; a partial cell at an edge
    averages the tokens it has). Tokens before and after the span are kept as they are. One
    pooling op plus reshapes and a concatenation; shapes depend only on the grid. Factor 1
    with temporal 1 is the identity (bit for bit)."""
    if factor == 1 and temporal == 1:
        return x
    n = frames * h * w
    img = x.narrow(dim, start, n)
    lead, trail = img.shape[:dim], img.shape[dim + 1:]
    b, c = math.prod(lead), math.prod(trail)
    grid = img.reshape(b * frames, h, w, c).permute(0, 3, 1, 2)  # frames ride in the batch
    pooled = F.avg_pool2d(grid, factor, ceil_mode=True) if factor > 1 else grid
    pooled = pooled.permute(0, 2, 3, 1)
    if temporal > 1:  # then each run of ``temporal`` frames' cells averaged (the last shorter)
        pooled = _frame_means(pooled.reshape(b, frames, -1, c), frames, temporal)
    pooled = pooled.reshape(*lead, pooled_tokens(h, w, factor, frames, temporal), *trail)
    parts = [x.narrow(dim, 0, start), pooled, x.narrow(dim, start + n, x.shape[dim] - start - n)]
    return torch.cat([p for p in parts if p.shape[dim]], dim)


def _frame_means(x: torch.Tensor, frames: int, temporal: int) -> torch.Tensor:
    """``x`` (``[B, frames, cells, C]``, a frame's cells each) with each run of ``temporal``
    frames replaced by its mean: within a frame every cell has the same count in every frame,
    so this is the 3-D cell's mean, with no 3-D pooling kernel (PyTorch's CPU avg_pool3d has
    none for bf16)."""
    full = frames - frames % temporal
    parts = [x.narrow(1, 0, full).unflatten(1, (-1, temporal)).mean(2)]
    if full < frames:
        parts.append(x.narrow(1, full, frames - full).mean(1, keepdim=True))
    return torch.cat(parts, 1) if len(parts) > 1 else parts[0]


def pooled_tokens(h: int, w: int, factor: int, frames: int = 1, temporal: int = 1) -> int:
    """Image keys left after pooling a ``frames x h x w`` grid by ``factor`` (and
    ``temporal``); integer ceilings, so a compiled graph's symbolic sizes stay symbolic."""
    return -(-frames // temporal) * -(-h // factor) * -(-w // factor)


def pool_cos_sin(cos: torch.Tensor, sin: torch.Tensor, start: int, h: int, w: int,
                 factor: int, dim: int = 0, frames: int = 1, temporal: int = 1
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled positions for diffusers' ``(cos, sin)`` embedding ([S, D]): each cell's mean
    rotation, normalised back to a rotation (the rotation by the cell's mean angle)."""
    if factor == 1 and temporal == 1:
        return cos, sin
    c = pool_span(cos.float(), start, h, w, factor, dim, frames, temporal)
    s = pool_span(sin.float(), start, h, w, factor, dim, frames, temporal)
    r = torch.sqrt(c * c + s * s).clamp_min(1e-12)
    return (c / r).to(cos.dtype), (s / r).to(sin.dtype)


def pool_rotations(pe: torch.Tensor, start: int, h: int, w: int, factor: int,
                   dim: int = 2, frames: int = 1, temporal: int = 1) -> torch.Tensor:
    """Pooled positions for ComfyUI's RoPE (``[..., S, D/2, 2, 2]`` rotation matrices): each
    cell's mean matrix divided by its scale (``sqrt(det)``), a rotation again."""
    if factor == 1 and temporal == 1:
        return pe
    m = pool_span(pe.float(), start, h, w, factor, dim, frames, temporal)
    r = torch.sqrt(m[..., 0, 0] ** 2 + m[..., 1, 0] ** 2).clamp_min(1e-12)
    return (m / r[..., None, None]).to(pe.dtype)


def cell_counts(h: int, w: int, factor: int, frames: int = 1, temporal: int = 1) -> list[int]:
    """Tokens in each cell of a ``frames x h x w`` grid, in the pooled order (``temporal *
    factor**2`` for full cells, fewer in partial cells at the right, bottom and last frames)."""
    spans = [min(temporal, frames - t) for t in range(0, frames, temporal)]
    rows = [min(factor, h - i) for i in range(0, h, factor)]
    cols = [min(factor, w - j) for j in range(0, w, factor)]
    return [s * r * c for s in spans for r in rows for c in cols]


def key_bias(start: int, total: int, h: int, w: int, factor: int, device: Any,
             dtype: torch.dtype = torch.float32, frames: int = 1, temporal: int = 1
             ) -> torch.Tensor:
    """Proportional attention: the additive logit bias of each key ([S'] for the pooled
    sequence of ``total`` keys with the image's ``frames*h*w`` at ``start``): ``log(tokens in
    the cell)`` on pooled image keys, 0 on every other key. A pooled key stands for its whole
    cell; softmax would count it once, so against keys that are not pooled (a DiT's text, a
    partial edge cell) the image would lose attention mass ``factor**2``-fold. Built from
    Python ints (no device read), once per call."""
    rest = total - start - frames * h * w
    if graphs.compiling():  # sizes may be symbolic: the same counts as tensor ops
        return F.pad(_cell_logs(h, w, factor, frames, temporal, device), (start, rest)).to(dtype)
    logs = [math.log(n) for n in cell_counts(h, w, factor, frames, temporal)]
    return torch.tensor([0.0] * start + logs + [0.0] * rest, device=device, dtype=dtype)


def _cell_logs(h: int, w: int, factor: int, frames: int, temporal: int, device: Any
               ) -> torch.Tensor:
    """``log(cell_counts(...))`` built in a graph (float64, as ``math.log``): each axis's
    cell lengths (``factor``, the last one shorter at an edge), their outer product."""
    def lengths(n: int, f: int) -> torch.Tensor:
        at = torch.arange(0, -(-n // f), device=device, dtype=torch.float64) * f
        return (n - at).clamp(max=f)
    t, r, c = lengths(frames, temporal), lengths(h, factor), lengths(w, factor)
    return (t[:, None, None] * r[None, :, None] * c[None, None, :]).log().reshape(-1)


def rotate(x: torch.Tensor, pe: torch.Tensor) -> torch.Tensor:
    """RoPE in ComfyUI's form: ``pe`` holds a 2x2 rotation matrix per pair of channels
    (``[..., S, D/2, 2, 2]``); each pair ``(x0, x1)`` of ``x`` (``[B, heads, S, D]``) becomes
    the matrix times it, computed in ``pe``'s dtype."""
    pairs = x.to(pe.dtype).unflatten(-1, (-1, 2))  # [..., S, D/2, 2]
    out = (pe * pairs.unsqueeze(-2)).sum(-1)        # row i: m[i, 0] x0 + m[i, 1] x1
    return out.flatten(-2).type_as(x)


# ----------------------------------------------------------------------------- the method

class DitPlan:
    """Pooling for one DiT call: the image grid (``frames x h x w``, frame-major; an image is
    one frame), the factor per side within a frame, the temporal factor (frames per cell: 1
    pools each frame on its own; a plan at factor 1 pools nothing), the RoPE option and
    whether pooled keys get the proportional-attention bias."""

    __slots__ = ("size", "factor", "rope", "proportional", "temporal", "_positions", "_bias")

    def __init__(self, h: int, w: int, factor: int, rope: str, proportional: bool = False,
                 frames: int = 1, temporal: int = 1, size: torch.Tensor | None = None):
        # The grid is the shape of an empty tensor (``graphs.grid_tensor``), not Python ints: a
        # compiled graph reads sizes from it as it reads the model's own tensors' sizes, so
        # dynamo makes them dynamic after a second image size (automatic dynamic shapes)
        # instead of guarding on each ``h == 16`` and recompiling per size.
        self.size = graphs.grid_tensor(frames, h, w) if size is None else size
        self.factor, self.rope = factor, rope
        self.proportional = proportional
        self.temporal = temporal if factor > 1 else 1  # frames pooled only where space is
        self._positions: tuple[Any, Any] = (None, None)
        self._bias: tuple[Any, Any] = (None, None)

    @property
    def frames(self) -> int:
        return self.size.shape[0]

    @property
    def h(self) -> int:
        return self.size.shape[1]

    @property
    def w(self) -> int:
        return self.size.shape[2]

    @property
    def grid(self) -> tuple[int, int, int]:
        """``(frames, h, w)`` of the image tokens."""
        return self.frames, self.h, self.w

    @property
    def tokens(self) -> int:
        """Image tokens before pooling (the span ``pool`` replaces)."""
        return self.frames * self.h * self.w

    @property
    def pooled(self) -> int:
        """Image keys after pooling."""
        return pooled_tokens(self.h, self.w, self.factor, self.frames, self.temporal)

    def pool(self, x: torch.Tensor, start: int, dim: int) -> torch.Tensor:
        return pool_span(x, start, self.h, self.w, self.factor, dim, self.frames, self.temporal)

    def cos_sin(self, emb: tuple[torch.Tensor, torch.Tensor], start: int, dim: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pool_cos_sin`` of diffusers' ``(cos, sin)`` on this plan's grid."""
        return pool_cos_sin(emb[0], emb[1], start, self.h, self.w, self.factor, dim,
                            self.frames, self.temporal)

    def rotations(self, pe: torch.Tensor, start: int, dim: int = 2) -> torch.Tensor:
        """``pool_rotations`` of ComfyUI's rotation matrices on this plan's grid."""
        return pool_rotations(pe, start, self.h, self.w, self.factor, dim, self.frames,
                              self.temporal)

    def with_factor(self, factor: int) -> DitPlan:
        return DitPlan(0, 0, factor, self.rope, self.proportional, temporal=self.temporal,
                       size=self.size)

    @property
    def biased(self) -> bool:
        """Whether this plan's pooled keys get the proportional bias (nothing pooled: no)."""
        return self.proportional and (self.factor > 1 or self.temporal > 1)

    def _key_bias(self, start: int, total: int, device: Any) -> torch.Tensor:
        return key_bias(start, total, self.h, self.w, self.factor, device,
                        frames=self.frames, temporal=self.temporal)

    def bias(self, start: int, total: int, device: Any) -> torch.Tensor | None:
        """``key_bias`` for a sequence of ``total`` keys (None without ``proportional``), built
        once per plan (one call) and shared by its blocks; float32, cast by the caller."""
        if not self.biased:
            return None
        if graphs.compiling():
            return self._key_bias(start, total, device)
        key = (start, total, str(device))
        if self._bias[0] != key:
            self._bias = (key, self._key_bias(start, total, device))
        return self._bias[1]

    def keys(self, k: torch.Tensor, start: int, dim: int, emb: Any, rotate: Any,
             pool_positions: Any) -> torch.Tensor:
        """The pooled keys with their positions, per ``rope``: every key rotated by its own
        position, then pooled ("before"), or pooled, then rotated by its cell's mean position
        ("pooled"). ``rotate(x, emb)`` and ``pool_positions(emb)`` speak the host's embedding
        form (diffusers' cos/sin pair, ComfyUI's 2x2 matrices); the one RoPE branch of every
        adapter."""
        if self.rope == "before":
            return self.pool(rotate(k, emb), start, dim)
        return rotate(self.pool(k, start, dim), self.positions(emb, start, pool_positions))

    def positions(self, emb: Any, start: int, pool: Any) -> Any:
        """``pool(emb)``, once per call: every block of a call shares the embedding (a plan
        lives for one call, so the embedding outlives the cache). Not cached while
        ``torch.compile`` traces: a guard on the embedding's identity would recompile every
        call; the compiled graph pools it per block instead."""
        if graphs.compiling():
            return pool(emb)
        key = (id(emb[0]) if isinstance(emb, (tuple, list)) else id(emb), start)
        if self._positions[0] != key:
            self._positions = (key, pool(emb))
        return self._positions[1]


def cached_plan(cache: dict, s: Any, f: int, rope: str, proportional: bool,
                temporal: int = 1) -> DitPlan:
    """The plan of a per-call grid ``s`` (``percall.Spans``) at factor ``f`` (``temporal``
    frames per cell), kept in
    ``cache`` in eager mode (its pooled positions and bias are built once; at most 32 kept),
    built in the graph while compiling (a dict read would add guards; ``s``'s sizes are
    symbolic there: ``percall._traced``)."""
    if graphs.compiling():
        return DitPlan(s.h, s.w, f, rope, proportional, s.frames, temporal)
    key = (s.frames, s.h, s.w, f, rope, proportional, temporal)
    if key not in cache:
        if len(cache) > 32:
            cache.clear()
        cache[key] = DitPlan(s.h, s.w, f, rope, proportional, s.frames, temporal)
    return cache[key]


class DitPool(methods.Downsample):
    """ToDo on a DiT: the image tokens' keys and values are pooled in joint attention.

    The same user-facing method as the UNet's ``downsample`` (name, factor, description, the
    config's fields), acting on one grid per call (a DiT has one "level": its patch size), in
    the blocks the ``blocks`` setting names, with the ``rope`` option for rotary positions."""

    self_attention_only = False
    # The settings that change a pooled block's cost beyond the method's own: part of the
    # measurement cache key (``measurements.key_config``; reuse: its refresh share is timed).
    key_fields = ("rope", "blocks", "proportional", "schedule", "reuse", "temporal")
    # The auto policy's fallback where nothing is measured: image tokens from which pooling
    # pays. CPU: `make bench-dit` (docs/speed.md#dits-flux-sd3; Flux and SD3 shapes, bf16, one
    # thread) paid by 5% from 576 tokens (384 px) and clearly (1.11x, 1.21x) at 1024 (512 px).
    # CUDA: published FlashAttention figures on an H100 show little change for Flux at
    # 1024 px and gains at 2K (16384 tokens); not measured here. MPS: an estimate.
    thresholds = {"cpu": 1024, "cuda": 16384, "mps": 4096}

    def sub_layers(self, c: Any) -> tuple[str, ...]:
        return ("attn",)

    def plan(self, planner: Any, call: Any, x: torch.Tensor, level: int, h: int, w: int,
             decoder: bool) -> DitPlan:
        """The call's plan for its ``call.frames`` grids of ``h x w`` (one per call)."""
        t = call.frames
        plan = call.plans.get((t, h, w))
        if plan is None:
            plan = call.plans[(t, h, w)] = plan_of(planner.config, t, h, w)
            planner.record(level, plan.tokens, plan.tokens - plan.pooled)
        return plan


def plan_of(config: Any, frames: int, h: int, w: int) -> DitPlan:
    """The settings' plan for ``frames`` grids of ``h x w`` tokens."""
    return DitPlan(h, w, config.downsample_factor, config.rope,
                   getattr(config, "proportional", False), frames, getattr(config, "temporal", 1))


# The DiT form rides on the method it belongs to: ``methods.REGISTRY`` stays the only registry.
methods.get("downsample").dit_form = DitPool()


def method_for(config: Any) -> methods.Method | None:
    """The DiT form of ``config.method`` (``Method.dit_form``), or None when the method has
    none (merge: pairing tokens across a joint sequence with text in it is not what ToMe for
    SD measured)."""
    return methods.get(config.method).dit_form


def no_form(config: Any, family: str) -> str:
    """The one line for a method without a DiT form."""
    return (f"ToMe: {config.method} has no DiT form ({family}); use method downsample (ToDo: "
            "image keys/values pooled) on DiTs")
