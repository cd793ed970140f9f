"""Whether a timed block run fits in memory, checked before it runs.

Measuring times a block *unmerged* at the size being measured, even where the generation
itself would merge it and fit. With an attention that materialises the whole score matrix (the
basic one: Forge Neo's and ComfyUI's CPU default, stock ldm, diffusers' ``AttnProcessor``),
one top-level SD1.5 block at 1024 px, batch 2, holds 2 x 8 x 16384^2 fp32 scores (16 GiB) and
their softmax: on a CPU the kernel's out-of-memory killer ends the host, which no ``except``
catches; on a GPU it is an exception at best. So ``measure`` asks ``check`` first, and a size
that does not fit is skipped with one line (the token thresholds decide for it).

The estimate is deliberately simple and errs high: activations (input, norms, q/k/v, the
feed-forward's 4x GEGLU) as 16 copies of the block input, plus, for a full-score attention,
two fp32 score matrices (scores and softmax) for self- and cross-attention; memory-efficient
kernels (SDPA, xFormers, sub-quadratic, sliced or split attention) add nothing per token pair.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from . import merge
from .layout import UnsupportedModelError, attention

ACTIVATION_COPIES = 16   # copies of the block input alive at once, at most (feed-forward: 4x2)
SCORE_COPIES = 2         # the score matrix and its softmax
MARGIN = 1.2             # estimate x this + HEADROOM must be available
HEADROOM = 512 << 20
# Attention kernels that never hold a token-by-token matrix (by name, lower case): PyTorch's
# SDPA (unless only its math back-end is enabled), xFormers, flash, Sage, sub-quadratic, and
# the split/sliced kernels that chunk the scores to fit (A1111's InvokeAI and Doggettx, Forge's
# and ComfyUI's attention_split, diffusers' SlicedAttnProcessor), and diffusers' processors that
# call its ``dispatch_attention_fn`` (SDPA by default; its math back-ends are caught below).
EFFICIENT = ("sdp", "scaled_dot_product", "attnprocessor2_0", "attention_pytorch", "xformers",
             "flash", "sage", "sub_quad", "split", "invokeai", "slice",
             "dispatch_attention_fn:native")


class NotEnoughMemoryError(Exception):
    """A timed run would need more memory than the device has free."""

    def __init__(self, need: int, available: int, full: bool, backend: str):
        self.need, self.available, self.full, self.backend = need, available, full, backend
        kind = "a full attention score matrix" if full else "memory-efficient attention"
        super().__init__(f"timing the unmerged block needs about {gib(need)} ({kind}: "
                         f"{backend}), {gib(available)} of memory is available")


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def amount(n: int) -> str:
    """``3.0 GiB``, ``4.5 MiB``, ``96.0 KiB``: bytes in the unit that reads."""
    for shift, unit in ((30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def kernel(attn: nn.Module) -> str:
    """The function that computes attention where the host swaps it at module level rather
    than on the class: Forge and Forge Neo (``backend.attention.attention_function``),
    reForge, Forge Classic and ComfyUI (``optimized_attention``); '' elsewhere."""
    module = sys.modules.get(type(attn).__module__)
    for name in ("attention_function", "optimized_attention"):
        fn = getattr(module, name, None)
        if callable(fn):
            return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', name)}"
    return ""


def full_scores(backend: str) -> bool:
    """Whether the attention named by ``measure.attention_backend`` holds the whole score
    matrix. Unknown kernels count as full: a wrong guess skips a measurement, never the
    host."""
    name, _, flags = backend.lower().partition(" sdp:")
    if flags and set(flags.split(",")) <= {"math", ""}:
        return True  # SDPA with only its math back-end materialises the scores
    if "dispatch_attention_fn:" in name and "math" in name:
        return True  # diffusers' "_native_math" back-end
    return not any(k in name for k in EFFICIENT)


def block_bytes(block: nn.Module, tokens: int, batch: int, channels: int, full: bool,
                context_tokens: int = 77) -> int:
    """Peak bytes of one unmerged run of ``block`` on ``tokens`` tokens (see the module
    docstring), plus the matching chunk of a plan build."""
    p = next(block.parameters())
    elem = p.element_size()
    try:
        heads = int(getattr(attention(block), "heads", 0) or max(1, channels // 64))
    except UnsupportedModelError:  # a host's DiT block without ``attn`` (ComfyUI's Flux)
        heads = max(1, channels // 64)
    need = batch * tokens * channels * elem * ACTIVATION_COPIES
    if full:
        score = max(elem, 4) * SCORE_COPIES * batch * heads * tokens
        need += score * (tokens + context_tokens)
    return need + merge.chunk_budget(p.device)


def available(device: torch.device) -> int | None:
    """Bytes free for a run on ``device``: the system's available memory for the CPU
    (``psutil``, else ``/proc/meminfo``); on CUDA the driver's free memory plus what PyTorch's
    allocator holds unused; on MPS the recommended limit less what is allocated; None where
    unknown (then nothing is skipped)."""
    try:
        if device.type == "cpu":
            return _cpu_available()
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free + torch.cuda.memory_reserved(device)
                       - torch.cuda.memory_allocated(device))
        if device.type == "mps":
            return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    except Exception:  # noqa: BLE001 (an old torch or driver: unknown)
        return None
    return None


def _cpu_available() -> int | None:
    try:
        import psutil
        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check(runs: list[tuple[nn.Module, int, int]], batch: int, backend: str) -> None:
    """Raise ``NotEnoughMemoryError`` unless the largest ``block_bytes`` of the ``(block,
    tokens, channels)`` runs (x ``MARGIN``, + ``HEADROOM``) fits on their device."""
    full = full_scores(backend)
    need = max(block_bytes(b, n, batch, c, full) for b, n, c in runs)
    free = available(next(runs[0][0].parameters()).device)
    if free is not None and need * MARGIN + HEADROOM > free:
        raise NotEnoughMemoryError(need, free, full, backend)
