"""The per-call core's reading of one attention call (``percall.py``): where the image keys
start when the keys are longer than the queries, the extra-channel bias for keys with fewer
heads than the queries (GQA), and the tally of what the attention calls of a sampling did
(one console line after it).

- Keys longer than the queries (reference keys kept from another pass and appended, a
  segment of the sequence attending to all of it): where the keys are the model call's whole
  sequence, its spans place the image; where the queries are, the extra keys sit on the side
  where the family keeps its other tokens (before the image where it has some there, as
  Wan's reference, else after it, as Kontext's and Qwen-Image's references). Only the image
  span of the keys is pooled; the other keys, and the queries, stay whole.
- Fewer key heads than query heads: pooling is along tokens, so it is the same; only the
  extra channel splits the keys by their own head count.
- Cross-attention (keys as long as the text, or any other length) stays untouched.

Counting is Python ints on the host, in eager calls only: a compiled graph replays its
attention calls without running Python, so its model calls are counted apart ("not
counted"), never guessed. Pure torch.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import torch

from . import attend
from .merge import compiling

# What an attention call did (``Tally`` keys), in the order the line names them.
POOLED, CROSS, MASKED, X1, OUTSIDE = "pooled", "cross", "masked", "x1", "outside"
LEFT = "left"  # to a chained override that declines pooled keys (``KvPool.leave``)
NAMES = {CROSS: "cross-attention or other lengths", MASKED: "masked",
         X1: "blocks at x1", OUTSIDE: "outside the window",
         LEFT: "left whole to the chained sparse attention"}


def key_start(spans: Any, queries: int, keys: int, whole: bool = False) -> int | None:
    """Where the image keys start in an attention call of these lengths (``spans``: the model
    call's ``percall.Spans``), or None: not a self-attention over this call's sequence."""
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


def count(tally: Counter, what: str) -> None:
    """One attention call's outcome, counted in eager calls only (a plain int on the host)."""
    if not compiling():
        tally[what] += 1


class Steps(NamedTuple):
    """What the sampler's steps did in one sampling (``OverridePatch.sampling``)."""

    total: int                   # steps in the sampler's schedule
    before: tuple[int, ...]      # skipped by a cache before the model call (LazyCache)
    inside: tuple[int, ...]      # reached the model but not its attention (EasyCache)
    calls: int                   # the model calls of the ``inside`` steps
    refreshed: tuple[int, ...]   # steps whose calls refreshed residual reuse


def _steps(numbers: tuple[int, ...]) -> str:
    return ", ".join(map(str, numbers)) if len(numbers) <= 12 else f"{len(numbers)} steps"


def line(now: tuple, since: tuple, steps: Steps | None = None) -> str | None:
    """The console line after a sampling: ``now`` and ``since`` are ``Core.tallies()`` at its
    end and start; ``steps``: what the sampler's steps did (skipped by a cache, refreshed
    reuse), where the host knows its schedule. None where no attention call was counted and
    none pooled (the ``not_pooled`` line says why then)."""
    tally = now[0] - since[0]
    compiled, outside, silent = (a - b for a, b in zip(now[1:], since[1:]))
    total = sum(tally.values())
    if not tally[POOLED] and not compiled:
        return None
    rest = [f"{NAMES[key]} {tally[key]}" for key in NAMES if tally[key]]
    if outside:
        rest.append(f"model calls outside the window {outside}")
    silent -= steps.calls if steps else 0
    if silent > 0:
        rest.append(f"model calls not reaching it {silent}")
    if compiled:
        rest.append(f"model calls inside a compiled graph {compiled} (their attention calls "
                    "not counted)")
    head = f"ToMe: pooled {tally[POOLED]} of {total} attention calls"
    parts = [head + ("; the rest: " + ", ".join(rest) if rest else "")]
    if steps and (steps.before or steps.inside):
        where = [f"{w}: {_steps(n)}" for n, w in ((steps.before, "before the model call"),
                                                 (steps.inside, "inside the model")) if n]
        parts.append(f"steps skipped by a cache {len(steps.before) + len(steps.inside)} of "
                     f"{steps.total} ({'; '.join(where)})")
    if steps and steps.refreshed:
        parts.append(f"residual reuse refreshed at steps {_steps(steps.refreshed)}")
    return "; ".join(parts)
