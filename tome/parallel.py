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

``shard`` makes a call's plan and text length the rank's (``processors._Hooks``); a grid
whose cells straddle the shards, reference tokens beside the image, diffusers' uneven
"anything" splits and unified (Ulysses x Ring: its ring step does not gather a mask, and
nothing here could run it) are refused with a ValueError at ``apply_patch`` (``check``) or at
the call, never pooled into another image. Tensor parallelism splits heads, not the
sequence: nothing changes. ``host_line`` says where a sequence-parallel host's attention
never reaches the override (raylight; xDiT's and ParaAttention's own attention).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

from . import dit


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
    factors = tuple(sorted({plan.factor, *(item[1] for item in st.schedule.items)} - {0}))
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
    if got is None or (st.text % n and split):
        grid = f"{plan.h}x{plan.w}" + (f"x{plan.frames} frames" if plan.frames > 1 else "")
        cells = ", ".join(f"{f}x{f}" for f in factors)
        raise ValueError(
            f"ToMe: cannot pool a {grid} token grid under context parallelism over {n} "
            f"ranks: each rank's shard must hold whole {cells} cells (image rows per rank a "
            "multiple of the factor, or whole frames per rank); choose another size or remove "
            "the ToMe patch")
    st.plan = dit.DitPlan(got.h, got.w, plan.factor, plan.rope, plan.proportional,
                          got.frames, plan.temporal)
    if split:
        st.text //= n


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
    ("raylight", "under raylight: its sequence-parallel blocks call xfuser's attention "
                 "without transformer_options, so the attention override never runs"),
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
