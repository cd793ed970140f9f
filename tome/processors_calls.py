"""The processors patch's brackets (``processors.py``): per transformer call its pre- and
post-hook (the call read the family's way, the plan, reuse's state decided on the host and
settled after the call, counted), and per pipeline generation what ``brackets.Bracket``
does (reuse dropped and paced, diffusers' step caches reset, the after-sampling line).
Nothing here names a family or imports an adapter: the state is the processors'
``_State``, read by attribute.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import brackets, console, merge, percall_calls, policy
from .layout import uncompiled
from .percall_calls import Counts
from .report import STATE_ATTR


class Hooks:
    """The transformer's pre- and post-hook: start and end a call."""

    def __init__(self, state: Any):
        self.state = state

    def call_pre(self, module: nn.Module | None, args: tuple, kwargs: dict) -> None:
        st = self.state
        st.plan = None
        if st.removed or st.family.call is None:  # removed while torch held this call's hooks
            return
        st.push()  # no plan until this call's is known (a call that raised left its own)
        counted = not merge.compiling()  # a compiled model's calls are not counted
        if counted:
            st.flags.clear()
            st.flags["call"] = True
            self.seen, self.placed = st.tally.total(), False
            self.pooled = st.tally[percall_calls.POOLED]
        d = st.layout.dit
        got = st.family.call(d, args, kwargs, st.memo)
        if got is None:
            return
        if counted:
            self.placed = True
        x, size, st.text, t = got
        c = st.planner.config  # its window is the schedule's
        read = st.schedule.varies() or st.reuse.every > 0
        if isinstance(t, torch.Tensor) and (c.start > 0 or c.end < 1 or read):
            t = t * d.timestep_scale
        st.plans, st.p = {}, None
        call = st.planner.begin(size, x.device, t, x.shape[0])
        if call is not None:  # an image's h x w tokens, a video's frames x h x w
            n = policy.level_tokens(size, d.patch)
            st.plan = st.planner.plan(call, x.new_zeros(()).expand(x.shape[0], n, 1))
            if st.plan is not None and read and t is not None:
                progress(st, x, size, t)
        st.push()

    def post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        st = self.state
        active = st.plan is not None
        st.plan = None
        st.push()
        if not merge.compiling() and st.flags.pop("call", False):  # as the per-call hosts
            if not st.flags.get("fired") and not getattr(module, "is_cache_enabled", False):
                st.flags.update(fired=True, pooled=active)  # compiled blocks record nothing
            # (a step cache's skipped call reaches no attention either: not a replayed one)
            st.count_call(st.flags, self.seen, self.placed, active)
            # what reuse did: refreshed, a refresh a step cache skipped moved here
            st.settled(st.reuse.settle(), st.tally[percall_calls.POOLED] - self.pooled)


@merge.host_side
def progress(st: Any, x: torch.Tensor, size: Any, t: Any) -> None:
    """The one host read of a call (as the planner's window), only where needed: the
    progress, reuse's state and the memory budget (eager under a whole-model compile)."""
    tv = float(t.reshape(-1)[0]) if isinstance(t, torch.Tensor) else float(t)
    st.p = st.planner.window.progress(tv)  # a 0-999 timestep window
    st.reuse.begin(st.p, x.shape[0], tuple(size), device=x.device)
    if st.budget is not None:  # what reuse will keep, checked before it keeps it
        st.schedule = st.budget.begin(x, size, st.text, st.p)


def patched(pipe: Any) -> list[Any]:
    """The patch states of a pipeline's transformers (the second: Wan 2.2 A14B's expert),
    found under a compiled module too."""
    found = []
    for name in ("transformer", "transformer_2"):
        module = uncompiled(getattr(pipe, name, None))  # compiled after patching
        state = vars(module).get(STATE_ATTR) if isinstance(module, nn.Module) else None
        if isinstance(state, Counts) and hasattr(state, "hooks"):
            found.append(state)
    return found


def generation(pipe: Any, steps: int | None = None) -> Any:
    """What a pipeline's generation bracket does (``brackets.Bracket``): at its start, what
    residual reuse kept is dropped, its refreshes paced to the ``steps`` (``Reuse.pace``),
    diffusers' step caches reset and the counts noted; at its end (also on an error or
    an interrupt) dropped again, and one line per patched transformer says what its calls
    did (the per-call hosts' after-sampling line), unless the generation was interrupted."""
    states = patched(pipe)
    since = [(st, st.counts(), st.tallies()) for st in states]
    for st in states:
        st.reset()
        st.reuse.pace(steps)
        st.forget_steps()
    brackets.reset_caches(pipe)

    def end(failed: bool) -> None:
        for st, counts, tallies in since:
            st.reset()
            if not failed and not st.removed and st.calls > counts[0]:  # compiled: uncounted
                say = st.budget.say if st.budget is not None else console.line
                say(st.not_pooled(counts) or percall_calls.line(
                    st.tallies(), tallies, percall_calls.steps_of(st)))
    return end


