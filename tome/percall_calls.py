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
from typing import Any, NamedTuple

from . import parallel
from .graphs import compiling

# What an attention call did (``Tally`` keys), in the order the line names them.
POOLED, CROSS, MASKED, X1, OUTSIDE = "pooled", "cross", "masked", "x1", "outside"
LEFT = "left"  # to a chained override that declines pooled keys (``KvPool.leave``)
NAMES = {CROSS: "cross-attention or other lengths", MASKED: "masked",
         X1: "blocks at x1", OUTSIDE: "outside the window",
         LEFT: "left whole to the chained sparse attention"}


class Counts:
    """What a patch's model calls and their attention calls did, counted on the host (Python
    ints, eager calls only): the per-call core's (``percall.Core``) and the processors'
    (``processors.py``), read after each sampling or pass (``not_pooled``, ``line``)."""

    NEVER_CALLED = "the pooling attention was installed but never called"
    NO_CALLS = "no model call went through its apply_model wrapper"

    def __init__(self, family: str):
        self.family_name = family  # (a processors state's ``family`` is the Family)
        self.skipped: list[tuple[Any, str]] = []
        self.calls = self.fired = self.installed = 0  # model calls / that reached our
        # attention / that ran with it installed
        self.placed = self.active = self.pooled = 0  # ... placed by the family / pooling by
        # the settings at their step / that pooled at least one attention call (``counts``)
        self.tally: Counter = Counter()  # attention calls by outcome (``count``)
        self.refreshed: set[int] = set()  # steps whose calls refreshed reuse (host clears it)
        self.moved: set[tuple[int, int]] = set()  # refreshes a cache skipped: (due, ran at)
        self.ran: Counter = Counter()  # step -> pooled attention calls (``settled``)
        self.empty = 0  # model calls with reuse that ran no pooled attention (a cache's)
        self.computed = 1.0  # the share of the last sampling's steps its blocks computed
        self.compiled = self.silent = 0  # model calls reaching it uncounted / not reaching it
        self.on_silent: Any = None  # told once: installed, never reached

    def count_call(self, flags: dict, seen: int, placed: bool, active: bool,
                   installed: bool = True) -> None:
        """One model call ended: ``flags`` its attention calls' (``fired``, ``pooled``),
        ``seen`` the tally's total when it began; ``on_silent`` told where the first call
        that ran with our attention ``installed`` never reached it."""
        self.calls += 1
        self.installed += installed
        self.placed += placed
        self.active += active
        self.pooled += bool(flags.get("pooled"))
        if flags.get("fired"):
            self.fired += 1
            self.compiled += self.tally.total() == seen  # replayed by a compiled graph
        elif installed:
            self.silent += 1
            if not self.fired and self.installed == 1 and self.on_silent is not None:
                self.on_silent()

    def settled(self, done: Any, pooled: int) -> None:
        """A model call's reuse settled (``reuse.Settled``, or None), with its ``pooled``
        attention calls: where it refreshed, the refreshes a step cache moved here, and per
        step how many pooled attention calls ran (fewer than the most: a cache skipped
        blocks)."""
        if done is None:
            return
        self.ran[done.step] += pooled
        self.empty += not pooled
        if done.refreshed:
            self.refreshed.add(done.step)
        self.moved.update(done.moved)

    def note(self, steps: Steps | None) -> Steps | None:
        """A sampling's steps, told at its end (``Steps``): the share of them its pooled
        blocks computed (a step cache skips whole steps or some blocks), kept for
        ``refresh_period``; ``steps`` handed back."""
        most = max(self.ran.values(), default=0)
        if steps is not None and steps.total and most:
            self.computed = min(1.0, sum(self.ran.values()) / (most * steps.total))
        return steps

    def refresh_period(self) -> float:
        """Residual reuse's refresh period in the steps the next sampling will compute, what
        the auto policy times (``attend.Refresh``): the settings' N (paced to the sampling's
        steps, ``Reuse.pace``) times the share of steps the last sampling computed. A step
        cache's skipped refreshes run at the next computed step, so with a cache skipping
        half the steps, every 5 refreshes every 2.5 computed ones. 0 without reuse."""
        every = getattr(getattr(self, "reuse", None), "every", 0) or 0
        return max(1.0, round(every * self.computed, 1)) if every else 0

    def forget_steps(self) -> None:
        """A sampling starts: its steps are counted anew."""
        self.refreshed.clear()
        self.moved.clear()
        self.ran.clear()
        self.empty = 0

    def counts(self) -> tuple[int, int, int, int, int]:
        """The model calls so far: run, reaching our attention, placed by the family,
        pooling at their step by the settings, that pooled."""
        return self.calls, self.fired, self.placed, self.active, self.pooled

    def tallies(self) -> tuple:
        """What ``line`` reads: attention calls by outcome, model calls replayed by a
        compiled graph, run without it installed, with it installed but not reaching it."""
        return Counter(self.tally), self.compiled, self.calls - self.installed, self.silent

    def not_pooled(self, since: tuple[int, ...] = (0, 0, 0, 0, 0)) -> str | None:
        """One line where no model call since ``since`` (``counts()`` then) pooled anything,
        saying why (what happened, not what was installed); None where one did."""
        calls, fired, placed, active, pooled = (a - b for a, b in zip(self.counts(), since))
        if pooled:
            return None
        if not calls:
            why = self.NO_CALLS
        elif not fired:
            why = self.NEVER_CALLED
        elif not placed:
            why = (f"{self.family_name} cannot place this model's tokens (its latent or text "
                   "is not laid out as that family's are)")
        elif not active:
            why = "no step was pooled by the settings (the step window or the auto policy)"
        elif self.skipped:
            why = "its attention calls carry a mask (pooling would misalign it)"
        else:
            why = "no attention call had the lengths of this model's text and image tokens"
        if active or not fired:  # a sequence-parallel host's attention bypasses ours
            why = parallel.host_line() or why
        return f"ToMe: not pooled in this sampling ({calls} model calls): {why}"


def record(source: Any, outcome: str | None) -> None:
    """One attention call reached a processors patch (``source``: its state; measuring's
    fixed sources count nothing): ``fired``, ``pooled`` where ``outcome`` is, and the
    outcome tallied (None: not an attention call of its own, e.g. SD3's context half).
    Eager calls only: a compiled block's calls are the model call's "not counted"."""
    flags = getattr(source, "flags", None)
    if flags is None or compiling():  # a compiled block writes nothing (its keys: guards)
        return
    flags["fired"] = True
    if outcome == POOLED:
        flags["pooled"] = True
    if outcome is not None:
        count(source.tally, outcome)


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
    partial: tuple[int, ...] = ()  # ran fewer pooled blocks than the most (FirstBlockCache)
    moved: tuple[tuple[int, int], ...] = ()  # refreshes a cache skipped: (due, ran at)


def steps_of(counts: Counts) -> Steps | None:
    """What the steps of a sampling did, from the counts alone (a host that does not tell
    its schedule: diffusers): the steps reuse counted, those where no pooled attention ran
    or fewer than the most (a step cache skipped them or some blocks) and the refreshes;
    None where reuse counted none."""
    ran = counts.ran
    if not ran:
        return None
    most = max(ran.values())
    return Steps(max(ran) + 1, (), tuple(sorted(s for s, n in ran.items() if not n)),
                 counts.empty,
                 tuple(sorted(counts.refreshed)),
                 tuple(sorted(s for s, n in ran.items() if 0 < n < most)),
                 tuple(sorted(counts.moved)))


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
    if steps and (steps.before or steps.inside or steps.partial):
        where = [f"{w}: {_steps(n)}" for n, w in ((steps.before, "before the model call"),
                                                 (steps.inside, "inside the model"),
                                                 (steps.partial, "some blocks")) if n]
        skipped = len(steps.before) + len(steps.inside) + len(steps.partial)
        parts.append(f"steps skipped by a cache {skipped} of {steps.total} "
                     f"({'; '.join(where)})")
    if steps and steps.refreshed:
        parts.append(f"residual reuse refreshed at steps {_steps(steps.refreshed)}")
    if steps and steps.moved:
        pairs = [f"{a}->{b}" for a, b in steps.moved]
        parts.append("refreshes a cache skipped, moved to the next computed step: "
                     + (", ".join(pairs) if len(pairs) <= 12 else f"{len(pairs)}"))
    return "; ".join(parts)
