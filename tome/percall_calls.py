"""The tally of what the attention calls of a sampling did, for the per-call core
(``percall.py``), and its one console line after each sampling (with the steps a cache
skipped, and where residual reuse refreshed). How one attention call is read (keys longer
than the queries, GQA's extra channel) is ``kv.py``'s.

Counting is Python ints on the host, in eager calls only: a compiled graph replays its
attention calls without running Python, so its model calls are counted apart ("not
counted"), never guessed. Pure torch.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from .merge import compiling

# What an attention call did (``Tally`` keys), in the order the line names them.
POOLED, CROSS, MASKED, X1, OUTSIDE = "pooled", "cross", "masked", "x1", "outside"
LEFT = "left"  # to a chained override that declines pooled keys (``KvPool.leave``)
NAMES = {CROSS: "cross-attention or other lengths", MASKED: "masked",
         X1: "blocks at x1", OUTSIDE: "outside the window",
         LEFT: "left whole to the chained sparse attention"}


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
