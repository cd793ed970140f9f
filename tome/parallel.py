"""Pooling under diffusers' context parallelism (``model.enable_parallelism(config=
ContextParallelConfig(ulysses_degree=N | ring_degree=N))``).

diffusers splits a call's sequence into equal contiguous shards, one per rank (the model's
``_cp_plan``: Flux and Qwen-Image split the text as well, Wan only the image), and each
rank's attention processor sees its shard only: ``[text_r, image_r]``. Ulysses then swaps
sequence for heads with an all-to-all (every rank attends over every rank's keys), Ring
passes each rank's keys/values round the ring. Attention does not care in which order its
keys come, so where each shard holds whole cells (a rank's image rows a multiple of every
factor the schedule uses, or whole frames of a video), pooling each shard as an image of its
own gives exactly the one-process pooled keys, in another order: the keys are pooled before
they travel, so the all-to-all (Ulysses) and the rotation (Ring) move the pooled keys, not the
whole ones. The proportional bias of a shard is the same for every shard (its cells are), so
a mask is right where Ulysses gathers it and where Ring reuses it on each rank's keys.

``shard`` makes a call's plan and text length the rank's (``processors._Hooks``). Where cells
would straddle the shards, Ulysses pools after its all-to-all instead (``Gathered``, through
``kv.attend_plan``: the whole keys travel, the attention work is saved); Ring cannot (no rank
ever holds a whole cell), nor can a family whose maths pool by themselves (Qwen-Image): both
are refused with a ValueError, as are reference tokens beside the image, diffusers' uneven
"anything" splits and unified Ulysses x Ring (its ring step does not gather a mask) at
``apply_patch`` (``check``) or at the call: never pooled into another image. Tensor
parallelism splits heads, not the sequence: nothing changes. ``host_line`` says where a
sequence-parallel host's attention never reaches ToMe (raylight, ParaAttention, xDiT).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch

from . import attend, dit


def context(root: Any) -> Any:
    """The ``ContextParallelConfig`` in force on a diffusers model, or None."""
    return getattr(getattr(root, "_parallel_config", None), "context_parallel_config", None)


def refusal(cp: Any) -> str | None:
    """Why ToMe refuses to pool under ``cp`` (None: it pools right)."""
    if cp is None:
        return None
    if getattr(cp, "ulysses_anything", False) or getattr(cp, "ring_anything", False):
        return ("ToMe: pooling under diffusers' ulysses_anything/ring_anything context "
                "parallelism is not supported (uneven shards split cells): remove the ToMe "
                "patch or use equal shards")
    if cp.ring_degree > 1 and cp.ulysses_degree > 1:
        return (f"ToMe: pooling under diffusers' unified context parallelism (ring_degree "
                f"{cp.ring_degree} x ulysses_degree {cp.ulysses_degree}) is not supported "
                "(its ring step does not gather the pooled keys' bias mask): use "
                "ulysses_degree or ring_degree alone, or remove the ToMe patch")
    return None


def check(root: Any) -> None:
    """Raise ``ValueError`` where ToMe cannot pool ``root`` right under its context
    parallelism (``apply_patch``; ``shard`` asks again per call: parallelism enabled after
    patching)."""
    why = refusal(context(root))
    if why:
        raise ValueError(why)


def ranks(cp: Any) -> int:
    """How many shards diffusers splits a sequence into (the flattened ring x ulysses mesh)."""
    return cp.ring_degree * cp.ulysses_degree


def text_split(root: Any) -> bool:
    """Whether the model's context-parallel plan shards the text (Flux, Qwen-Image) or
    leaves it whole on every rank (Wan: cross-attention only)."""
    plan = getattr(root, "_cp_plan", None) or {}
    return any(isinstance(v, dict) and "encoder_hidden_states" in v for v in plan.values())


class Shard(NamedTuple):
    frames: int
    h: int
    w: int


def shard_grid(frames: int, h: int, w: int, n: int, factors: tuple[int, ...],
               temporal: int = 1) -> Shard | None:
    """The grid of each of ``n`` equal contiguous shards of a frame-major ``frames x h x w``
    grid where every shard holds whole cells for each of ``factors`` (whole frames, by
    ``temporal``; or, in an image, whole rows of cells), else None (a cell would straddle
    two ranks)."""
    if frames % n == 0 and (frames // n) % temporal == 0:
        return Shard(frames // n, h, w)
    if frames == 1 and h % n == 0 and all((h // n) % f == 0 for f in factors):
        return Shard(1, h // n, w)
    return None


def shard(st: Any, x: Any) -> None:
    """Make the processors' call state ``st`` (its ``plan``, ``text``) this rank's shard
    under the model's context parallelism, or raise ``ValueError`` (``refusal``, cells across
    shards, tokens beside the image); nothing where there is none."""
    cp = context(st.layout.root)
    plan = st.plan
    if cp is None or plan is None:
        return
    check(st.layout.root)
    n = ranks(cp)
    factors = tuple(sorted({plan.factor, *(item[1] for item in st.call.schedule.items)} - {0}))
    got = shard_grid(plan.frames, plan.h, plan.w, n, factors, plan.temporal)
    split = text_split(st.layout.root)
    # tokens beside the image: references after it (Kontext), or before it where they are
    # not a text every rank holds its share of (Wan 2.2 TI2V's whole first frame)
    beside = (x.dim() == 3 and x.shape[1] != plan.tokens) or bool(st.text and not split)
    if beside:
        raise ValueError(
            f"ToMe: cannot pool under context parallelism over {n} ranks: tokens beside the "
            "image (reference images, a whole first frame) are not split as the image is; "
            "remove the ToMe patch")
    if st.text % n and split:
        got = None
    if got is None and cp.ring_degree == 1 and plan.tokens % n == 0:
        st.plan = Gathered(plan, n, cp._ulysses_mesh.get_group())  # pooled after the all-to-all
    elif got is None:
        grid = f"{plan.h}x{plan.w}" + (f"x{plan.frames} frames" if plan.frames > 1 else "")
        cells = ", ".join(f"{f}x{f}" for f in factors)
        raise ValueError(
            f"ToMe: cannot pool a {grid} token grid under "
            f"{'ring' if cp.ring_degree > 1 else 'ulysses'} context parallelism over {n} "
            f"ranks: each rank's shard must hold whole {cells} cells (image rows per rank a "
            "multiple of the factor, or whole frames per rank); choose another size, use "
            "ulysses_degree, or remove the ToMe patch")
    else:
        st.plan = dit.DitPlan(got.h, got.w, plan.factor, plan.rope, plan.proportional,
                              got.frames, plan.temporal)
    if split:
        st.text //= n


GATHERED = ("ToMe: this model's attention pools its keys itself, which cannot follow a grid "
            "whose cells straddle the ranks' shards: choose a size whose image rows per rank "
            "are a multiple of the factor, or remove the ToMe patch")


class Gathered(dit.DitPlan):
    """A rank's plan under Ulysses where the grid's cells straddle the shards: the keys are
    pooled after the all-to-all, where the whole sequence is known (``around``; the
    all-to-all then moves the whole keys: only the attention work is saved). Its own grid is
    the shard's length (``1 x 1 x tokens/n``: what a family's maths check the call's length
    against); ``whole`` is the call's plan. A family whose maths pool by themselves instead
    of through ``kv.attend_plan`` is refused (``pool``, ``keys``... raise)."""

    __slots__ = ("whole", "n", "group")

    def __init__(self, whole: dit.DitPlan, n: int, group: Any):
        super().__init__(1, whole.tokens // n, whole.factor, whole.rope, whole.proportional)
        self.whole, self.n, self.group = whole, n, group

    def with_factor(self, factor: int) -> Gathered:
        return Gathered(self.whole.with_factor(factor), self.n, self.group)

    def pool(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(GATHERED)

    keys = cos_sin = rotations = bias = pool

    def around(self, attend_plan: Any, wrapper: Any, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, start: int, dim: int, emb: Any, rotate: Any) -> torch.Tensor:
        """``kv.attend_plan`` on the whole sequence: q, k, v ([B, S/n, H, D]) swapped to
        [B, S, H/n, D] (each rank's ``start`` text tokens, then its image tokens), put in the
        model's order ([text, image]), pooled with the whole plan, attended over this rank's
        heads with the backend's kernel, put back and swapped back."""
        if dim != 1:
            raise ValueError(GATHERED)
        n, s = self.n, q.shape[1]
        ranks = torch.arange(n, device=q.device)[:, None] * s
        order = torch.cat([(ranks + torch.arange(start, device=q.device)).reshape(-1),
                           (ranks + torch.arange(start, s, device=q.device)).reshape(-1)])
        q, k, v = (_heads(t, n, self.group).index_select(1, order) for t in (q, k, v))
        rotation: dict = {}
        if emb is not None:  # diffusers' (cos, sin), the sequence on its axis of length s
            axis = next(i for i, size in enumerate(emb[0].shape) if size == s)
            emb = tuple(_gather(e, axis, n, self.group).index_select(axis, order) for e in emb)
            rotation = {"emb": emb, "rotate": rotate,
                        "positions": lambda e: self.whole.cos_sin(e, n * start, axis)}
        local = SimpleNamespace(_attention_backend=getattr(
            getattr(wrapper, "original", None), "_attention_backend", None))
        out = attend_plan(wrapper, attend.dispatch(local), self.whole, q, k, v, n * start, 1,
                          **rotation)
        return _sequence(out.index_select(1, torch.argsort(order)), n, self.group)


def _heads(t: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """[B, S/n, H, D] -> [B, S, H/n, D] (every rank's tokens, rank-major; this rank's heads)."""
    import torch.distributed as dist
    b, s, h, d = t.shape
    x = t.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, group=group)
    return y.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _sequence(t: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """``_heads`` undone: [B, S, H/n, D] -> [B, S/n, H, D]."""
    import torch.distributed as dist
    b, s, h, d = t.shape
    x = t.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, group=group)
    return y.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


def _gather(t: torch.Tensor, axis: int, n: int, group: Any) -> torch.Tensor:
    """Every rank's ``t`` along ``axis``, rank-major."""
    import torch.distributed as dist
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, axis)


def forwarded(name: str) -> property:
    """An attribute of a wrapper read from and written to its ``original``: diffusers'
    ``enable_parallelism`` and ``set_attention_backend`` set ``_parallel_config`` and
    ``_attention_backend`` on each module's processor; patched first, they would reach the
    wrapper, and the original (every unpooled call) would attend over its shard alone."""
    return property(lambda self: getattr(self.original, name),
                    lambda self, value: setattr(self.original, name, value))


# ----------------------------------------------------------------------------- other hosts

# Sequence-parallel hosts whose attention never reaches ToMe's patch point: (the module that
# marks one loaded, why). ComfyUI's own MultiGPU CFG Split clones the model per device and
# runs each clone in its own worker thread, the override and all: it pools as one GPU does.
# xDiT's diffusers pipelines put their own processors (xFuser...AttnProcessor) on the blocks:
# the report names those blocks skipped, as any processor ToMe does not reproduce.
HOSTS = (
    ("raylight", "under raylight (loaded): its sequence-parallel blocks call xfuser's "
                 "attention without transformer_options, so the attention override never "
                 "runs"),
    ("para_attn", "under ParaAttention: its context-parallel forward hands each block a "
                  "shard of the sequence ToMe's grid does not describe"),
    ("xfuser", "under xDiT: its sequence-parallel attention replaces the model's own"),
)


def host_line(modules: Any = None) -> str | None:
    """Why nothing pooled where a sequence-parallel host ToMe passes through is loaded
    (``percall_calls.Counts.not_pooled``), or None."""
    loaded = sys.modules if modules is None else modules
    return next((why for name, why in HOSTS
                 if any(name in m.split(".") for m in list(loaded))), None)
