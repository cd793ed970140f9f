"""Patching DiTs held as plain modules (diffusers' DiTs, A1111's SD3: the families with
``Family.call``; ``adapters.py`` chooses): the image tokens' keys and values pooled inside
each chosen block's attention.

Pooling happens inside the attention processor call (projections, norms, text+image, RoPE,
kernel). Each chosen module's processor is wrapped (``PoolingProcessor``): a call with no plan
for its block (the schedule's window, the auto policy, another patch's state) goes to the
original untouched, so those calls and, after removal, every call are bit-identical to the
unpatched model. A call with a plan runs the DiT family's maths (``tome/dits/``: the
library's processor with the image keys/values pooled, the proportional-attention bias and
residual reuse from ``attend.py``); a processor the family does not reproduce (another
library's, e.g. IP-Adapter's) leaves its block unpooled and reported. A family without
processors (A1111's MMDiT) puts its own pooled path on the block (``Family.shadow``), and
measuring runs a block on the family's inputs (``runner``, ``Family.inputs``).

Per transformer call a pre-hook reads the call the family's way (``Family.call``: the latent
grid, the text length, the timestep) and plans it as every bracket does
(``callplan.Planned.plan_call``, the per-call core's planner too: the window in timesteps,
the policy, reuse, the budget, each block's factor). Nothing here names a family.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from . import attend as _attend
from . import brackets, budget, console, dit, dits, graphs, parallel, percall, percall_calls, policy
from . import plan as _plan
from .callplan import CallPlan, Planned
from .config import ToMeConfig
from .layout import Block, Layout, uncompiled
from .report import PROCESSORS, STATE_ATTR, PatchReport
from .wrappers import (
    PHASES,
    SWITCHES,
    PoolingProcessor,
    block_problem,
    pinning,
    runner,
    unwrap,
    wrap,
)


class _State(percall_calls.Counts, percall.Flags, Planned):
    """One patched DiT: the planner, the current call's plan (planned as every bracket plans
    a call: ``Planned.plan_call``), its text length, the kept residuals of ``reuse``, and
    the counts of what its calls did (``Counts``: the same after-sampling line the per-call
    hosts print)."""

    NO_CALLS = "no transformer call ran"
    NEVER_CALLED = "the pooling processors were installed but never called"

    def __init__(self, config: ToMeConfig, report: PatchReport, layout: Layout):
        percall_calls.Counts.__init__(self, layout.family)
        percall.Flags.__init__(self)
        self.config, self.report, self.layout = config, report, layout
        self.family = dits.of(layout)
        self.planner: _plan.Planner = report.planner
        self.schedule = dit.schedule_of(config)
        self.kinds = [b.kind for b in layout.blocks]
        self.factors = self.static_factors()
        self.handles: list[Any] = []   # hook handles on the transformer
        self.wrapped: list[tuple[nn.Module, str, Any, Any]] = []  # (module, name, before, ours)
        self.plan: dit.DitPlan | None = None
        self.shadow: dit.DitPlan | None = None  # the grid's plan where this call pools nothing
        self.switching = False         # a wrapper's block switches plans (``_phases``)
        self.plans: dict[int, dit.DitPlan] = {}  # this call's plan per scheduled factor
        self.call: CallPlan | None = None  # this call's (progress, factors)
        self.text = 0                  # text tokens in this call (single blocks' span start)
        self.memo: dict = {}           # the family's call reading keeps what it may reuse
        self.reuse = _attend.Reuse(config.reuse, paced=config.paced)
        self.budget: budget.ReuseBudget | None = None  # what reuse may keep (``apply``)
        self.hooks: _Hooks | None = None
        self.removed = False           # removed while torch held its call hook
        self.parts: list[PoolingProcessor] = []  # the wrappers this state sets plans on
        self.joined: list[Any] = []    # the wrappers and shadows whose residuals reuse keeps

    def reset(self) -> None:
        """Drop what residual reuse keeps (a generation's start and end)."""
        self.reuse.reset()

    def push(self) -> None:
        """Set each wrapper's plan for this call (``PoolingProcessor.current``) on the host:
        a compiled block then reads its own attribute, and its graph guards on the plan, not
        on the block's index (one graph for every block, steps and identities alike). A
        block whose plan changes over sampling also gets every variant's plan for this
        call's grid (``shadow`` outside the window) and which one runs (``switch``)."""
        base = self.plan if self.plan is not None else self.shadow
        for part in self.parts:
            part.current = None if self.plan is None else self.plan_for(part.index, part.kind)
            if part.phases:
                f = 0 if part.current is None else self.call.factors[part.index]
                known = base is not None and f in part.phases
                part.variants = tuple(None if v == 0 else self._factored(base, v)
                                      for v in part.phases) if known else ()
                part.phase = PHASES[part.phases.index(f) if known else 0]
        if self.joined:  # this thread's slots of residual reuse, on our own wrappers
            slots = self.reuse.parts()
            for part in self.joined:
                part.reuse_slot = slots[part.reuse_pos]

    def plan_for(self, index: int, kind: str) -> dit.DitPlan | None:
        """Block ``index``'s plan in this call: the schedule's factor for it now, or None."""
        base, call = self.plan, self.call
        if base is None or call is None:
            return None
        f = call.factors[index]
        return None if f == 0 else self._factored(base, f)

    def _factored(self, base: dit.DitPlan, f: int) -> dit.DitPlan:
        if f == base.factor:
            return base
        if f not in self.plans:
            self.plans[f] = base.with_factor(f)
        return self.plans[f]


class _Hooks:
    """The transformer's pre- and post-hook: start and end a call."""

    def __init__(self, state: _State):
        self.state = state

    @graphs.host_side  # eager in a model compiled whole: its Python ints never guard a graph
    def call_pre(self, module: nn.Module | None, args: tuple, kwargs: dict) -> None:
        st = self.state
        st.plan = st.shadow = None  # the last call's plans go
        if st.removed or st.family.call is None:  # removed while torch held this call's hooks
            return
        st.push()  # no plan until this call's is known (a call that raised left its own)
        counted = not graphs.compiling()  # a compiled model's calls are not counted
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
        st.plans, st.call, st.shadow = {}, None, None
        n = policy.level_tokens(size, d.patch)  # an image's h x w tokens, a video's f x h x w
        # a 0-999 timestep window: the model's timestep in its own units (``timestep_scale``)
        st.call = st.plan_call(size, n, x.device, t, x.shape[0], grid=tuple(size),
                               text=st.text, x=x, scale=d.timestep_scale)
        if st.call is not None:
            st.plan = st.planner.plan(st.call.call, x.new_zeros(()).expand(x.shape[0], n, 1))
            parallel.shard(st, x)  # context parallelism: this rank's shard, or refused
        elif st.switching:
            st.shadow = _shadow(st.planner.config, size, n, d.patch)
        st.push()

    @graphs.host_side
    def post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        st = self.state
        active = st.plan is not None
        st.plan = st.shadow = None
        st.push()
        if st.reuse.every:
            st.reuse.end()  # a refreshing call's eager stance left (``reuse._Eager``)
        if not graphs.compiling() and st.flags.pop("call", False):  # as the per-call hosts
            if not st.flags.get("fired") and not getattr(module, "is_cache_enabled", False):
                st.flags.update(fired=True, pooled=active)  # compiled blocks record nothing
            # (a step cache's skipped call reaches no attention either: not a replayed one)
            st.count_call(st.flags, self.seen, self.placed, active)
            # what reuse did: refreshed, a refresh a step cache skipped moved here
            st.settled(st.reuse.settle(), st.tally[percall_calls.POOLED] - self.pooled)


def _shadow(config: ToMeConfig, size: tuple[int, ...], tokens: int, patch: int
            ) -> dit.DitPlan | None:
    """The plan a call outside the window would have had (what a switching block's graph
    traces its pooled variants with), or None where the grid is not the latent's."""
    grid = _plan.grid_of(tokens, size, patch)
    return None if grid is None else dit.plan_of(config, policy.latent_grid(size)[0], *grid[1:])


def _phases(state: _State) -> tuple[int, ...]:
    """The factors the pooled blocks switch between over sampling (``wrappers.switch``), 0
    (unpooled) where a window or the auto policy leaves them out; empty: one, a torch that
    cannot switch in a graph, or residual reuse (it writes what it keeps where a call
    traces a refresh, and nothing may be written inside ``torch.cond``: its variants stay
    guards). One set for every block: a graph compiled once for all of a model's blocks
    (``compile_repeated_blocks``) guards on how many variants there are."""
    if state.config.reuse or not SWITCHES:
        return ()
    n = len(state.kinds)
    found = {f for part in state.parts for f in state.schedule.factors(part.index, part.kind, n)}
    if state.config.policy != "fixed":
        found.add(0)
    if not 1 < len(found) <= len(PHASES):
        return ()
    pinning()
    return tuple(sorted(found))


# ----------------------------------------------------------------------------- public API

def apply(model: Any, layout: Layout, config: ToMeConfig, measurer: Any = None) -> PatchReport:
    """Pool the DiT blocks ``config`` names (schedule, ``blocks``) and say what was done;
    atomic (on any error the blocks are back as they were). ``measurer``: the auto policy's
    measuring service, as for UNets."""
    root, d, family = layout.root, layout.dit, dits.of(layout)
    method = dit.method_for(config)
    report = PatchReport.of(layout, config, PROCESSORS, max_downsample=d.patch)
    # A schedule may pool where the plain factor is 1: only a method without a DiT form or
    # settings that name no block pool nothing (factor 1 runs the pooled maths, bit for bit
    # the library's). Then nothing is installed, as for settings that change nothing.
    parallel.check(root)  # context parallelism ToMe cannot pool right: refused
    report.unmergeable = layout.unmergeable(config)
    if report.unmergeable:
        return report
    targets: list[tuple[int, Block]] = []
    schedule = dit.schedule_of(config)
    for i, b in enumerate(layout.blocks):
        if not schedule.factor(i, b.kind, len(layout.blocks), None):
            continue
        problem = block_problem(b.module, family)
        if problem:
            report.skipped.append((b.name, problem))
            continue
        targets.append((i, b))
        report.levels[d.patch] = report.levels.get(d.patch, 0) + 1
    if not targets:  # every named block skipped (``report.nothing`` says why)
        return report
    # reuse's period as the generation will run it (``state``'s, made below before any call)
    period = (lambda: state.refresh_period()) if config.reuse else 0
    measured = measurer.for_model(model, config, runner(layout, period)) \
        if measurer is not None else None
    lo, hi = schedule.window()  # the planner lets in the steps where any block pools
    report.planner = _plan.Planner(config.replace(start=lo, end=hi), d.patch, measured,
                                   sorted(report.levels), method=method)
    report.planner.variant = period or None  # a new period measures again
    state = _State(config, report, layout)
    state.reuse.order = tuple(i for i, _ in targets)
    if config.reuse:
        state.budget = budget.ReuseBudget(layout, config, state.reuse.order, state.reuse, report)
    hooks = state.hooks = _Hooks(state)
    try:
        state.handles.append(root.register_forward_pre_hook(hooks.call_pre, with_kwargs=True))
        state.handles.append(root.register_forward_hook(hooks.post, with_kwargs=True))
        for i, b in targets:
            state.wrapped += wrap(b.module, family, state, i, b.kind)
        for *_, ours in state.wrapped:  # the parts that keep residuals (on themselves)
            if hasattr(ours, "index") and config.reuse:
                ours.reuse_pos = state.reuse.join(ours.index)
                state.joined.append(ours)
            if isinstance(ours, PoolingProcessor):
                ours.pushed = True
                state.parts.append(ours)
        phases = _phases(state)
        for part in state.parts:
            part.phases = phases
        state.switching = bool(phases)
        state.wrapped += brackets.shadow(model, _generation)
        setattr(root, STATE_ATTR, state)
    except BaseException:
        _remove(state)
        vars(root).pop(STATE_ATTR, None)
        raise
    return report


def _states(pipe: Any) -> list[_State]:
    """The patch states of a pipeline's transformers (the second: Wan 2.2 A14B's expert),
    found under a compiled module too."""
    found = []
    for name in ("transformer", "transformer_2"):
        module = uncompiled(getattr(pipe, name, None))  # compiled after patching
        state = vars(module).get(STATE_ATTR) if isinstance(module, nn.Module) else None
        if isinstance(state, _State):
            found.append(state)
    return found


def _generation(pipe: Any, steps: int | None = None) -> Any:
    """What a pipeline's generation bracket does (``brackets.Bracket``): at its start, what
    residual reuse kept is dropped, its refreshes paced to the ``steps`` (``Reuse.pace``),
    diffusers' step caches reset and the counts noted; at its end (also on an error or
    an interrupt) dropped again, and one line per patched transformer says what its calls
    did (the per-call hosts' after-sampling line), unless the generation was interrupted."""
    states = _states(pipe)
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
                    st.tallies(), tallies, st.note(percall_calls.steps_of(st))))
    return end


def _remove(state: _State) -> None:
    state.removed, state.plan = True, None  # a hook torch still holds for a call: inert
    state.reuse.reset()                     # nothing kept past removal
    for h in state.handles:
        h.remove()
    state.handles.clear()
    unwrap(state.wrapped)


def remove(root: nn.Module) -> bool:
    """Remove a DiT patch from ``root``; whether there was one."""
    state = vars(root).get(STATE_ATTR)
    if not isinstance(state, _State):
        return False
    _remove(state)
    del vars(root)[STATE_ATTR]
    return True
