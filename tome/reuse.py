"""Residual reuse (DiTFastAttn's residual sharing on pooled keys), for every DiT adapter:
what it keeps (``Keep``, the memory budget's knobs), and ``Reuse``, which owns it all (per
thread ``Lane``, per block part ``Slot``, per call identity and factor) and is the one guard
every family's maths put around a pooled attention (``Reuse.around``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import graphs
from .schedule import period


@dataclass(frozen=True)
class Keep:
    """What residual reuse keeps per pooled block, call identity and factor: the memory
    budget's knobs (``tome.memory``), each a step that keeps the most quality per byte."""

    slope: bool = True                # the extrapolation slope too (a 2nd tensor); False: none
    dtype: torch.dtype | None = None  # None: the attention output's; e.g. float16 halves float32
    image_only: bool = False          # only the image span's rows (text rows get no residual)
    blocks: int | None = None         # only the first ``blocks`` pooled blocks (by index); 0: none

    def words(self) -> str:
        """``residual + slope``, ``, image rows``, ``, float16``, ``, first 4 blocks``."""
        if self.blocks == 0:
            return "nothing"
        parts = ["residual + slope" if self.slope else "residual"]
        if self.image_only:
            parts.append("image rows")
        if self.dtype is not None:
            parts.append(str(self.dtype).replace("torch.", ""))
        if self.blocks is not None:
            parts.append(f"first {self.blocks} pooled blocks")
        return ", ".join(parts)


def kept_as(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` as reuse keeps it in ``dtype`` (None: as it is), clamped first to that dtype's
    finite range: before torch made float8 casts saturate, a float8_e4m3fn cast turned values
    past +-448 into NaN (e5m2: past 57344, inf), which the steps between would add to the image."""
    if dtype is None or dtype == t.dtype:
        return t
    top = torch.finfo(dtype).max
    return (t.clamp(-top, top) if top < torch.finfo(t.dtype).max else t).to(dtype)


class _Eager:
    """Compiled code run eagerly while any thread's call refreshes
    (``torch.compiler.set_stance("force_eager")``, torch >= 2.6; before, nothing changes).
    A refresh also runs the unpooled attention and writes what is kept: compiled, it would be
    a graph of its own per size for every block (nothing kept yet, refresh, reuse: dynamo's
    recompile limit of 8 came at the second size). Eager, the graphs see reuse's one state,
    1 call in N, and need no more graphs per size than the unpatched model. Process-wide and
    counted (the stance is the process's): the first refresh enters, the last leaves."""

    def __init__(self) -> None:
        self.lock, self.depth, self.held = threading.Lock(), 0, None

    def enter(self) -> None:
        with self.lock:
            set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
            if set_stance is not None and self.depth == 0:
                self.held = set_stance("force_eager")  # set now; leaving restores the stance
            self.depth += 1

    def clear(self) -> None:
        """Compiled code compiled again, whoever still holds the stance (tests)."""
        with self.lock:
            self.depth = 1
        self.leave()

    def leave(self) -> None:
        with self.lock:
            self.depth = max(self.depth - 1, 0)
            if self.depth == 0 and self.held is not None:
                held, self.held = self.held, None
                held.__exit__(None, None, None)


EAGER = _Eager()


class Slot:
    """One block part's residuals in one thread's generation (a ``Lane``'s): what ``Reuse``
    keeps for it (identity -> factor -> (r, slope, at)) and, during a call, this call's
    identity's entry (``cur``; None: the part keeps nothing) and whether it refreshes
    (``due``: its identity's refresh, or its own residual ``every`` steps old because a step
    cache skipped the block when its refresh was due). Reuse owns it; the adapters hand it
    to their blocks (``Reuse.parts``, or pushed onto their own wrappers), so a compiled
    block reads attributes, never a dict keyed by block."""

    __slots__ = ("index", "on", "kept", "cur", "lane", "due", "fresh", "owed", "was")

    def __init__(self, index: int, on: bool, lane: Lane):
        self.index, self.on, self.lane = index, on, lane
        self.kept: dict[tuple, dict] = {}
        self.cur: dict | None = None
        self.due = False                    # this call refreshes this part
        self.fresh: dict[tuple, int] = {}   # identity -> step its last refresh ran (host int)
        self.owed: dict[tuple, int] = {}    # identity -> step of a due refresh that did not run
        self.was: dict | None = None        # ``cur`` as the call began (``Lane.settle``)


class Lane:
    """One thread's generation under residual reuse: the steps, the identities seen, their
    last refreshes, this call's decision (``who``, ``refresh``, ``active``, ``now``) and its
    ``Slot``s. Threads never share one (ComfyUI's MultiGPU runs clones of one patch in worker
    threads: each keeps its own residuals, on its own device)."""

    def __init__(self, reuse: Reuse):
        self.thread = threading.current_thread()
        self.slots = tuple(Slot(i, reuse.keeps(i), self) for i in reuse.indices)
        self.reset()

    eager = False  # this lane holds ``EAGER`` (a refreshing call, until ``Reuse.end``)

    def reset(self) -> None:
        self.leave()
        for slot in self.slots:
            slot.kept, slot.cur, slot.was, slot.due = {}, None, None, False
            slot.fresh, slot.owed = {}, {}
        self.at: dict[tuple, int] = {}      # identity -> step of its last refresh
        self.seen: dict[tuple, int] = {}    # (grid, rows, host identity) -> calls at this level
        self.step, self.last = -1, None
        self.who: tuple | None = None       # this call's identity; None: no reuse in this call
        self.before: int | None = None      # its last refresh before this call (``missed``)
        self.active = self.refresh = False
        self.now = torch.zeros(())          # the step, a 0-dim tensor (a graph input)

    def leave(self) -> None:
        if self.eager:
            self.eager = False
            EAGER.leave()

    def settle(self, every: int) -> Settled | None:
        """What the call that just ran did with its parts, read on the host after it: which
        refreshed (their kept entry replaced) and which refreshes were due but did not run
        (a step cache skipped the block: ``owed``, refreshed at its next computed call);
        None outside a call with reuse. Idempotent: the next ``begin`` settles too."""
        who, step = self.who, self.step
        if who is None or not self.active:
            return None
        refreshed, moved = False, []
        for slot in self.slots:
            was, cur, slot.was = slot.was, slot.cur, None
            if was is None or cur is None:
                continue
            if cur.keys() != was.keys() or any(cur[f] is not was[f] for f in cur):
                refreshed = True
                last = slot.fresh.get(who)
                due = slot.owed.pop(who, None)
                if due is None and last is not None and step - last > every:
                    due = last + every  # no call of this identity when it was due
                if due is not None and due != step:
                    moved.append((due, step))
                slot.fresh[who] = step
            elif slot.due and who in slot.fresh:  # due, ran before, did not run now
                slot.owed.setdefault(who, step)
        self.active = False
        return Settled(step, refreshed, tuple(sorted(set(moved))))


class Settled(NamedTuple):
    """One model call's reuse, settled (``Lane.settle``): its step, whether any part
    refreshed, and the refreshes a step cache skipped that ran here: (due step, this step)."""

    step: int
    refreshed: bool
    moved: tuple[tuple[int, int], ...]


class Reuse:
    """Residual reuse (``reuse`` = N, DiTFastAttn's residual sharing on pooled keys): a pooled
    block's attention also runs unpooled on a refresh and keeps ``r = full - pooled``; the
    calls between add ``r`` to the pooled output, extrapolated linearly from the last two
    refreshes (``r + slope * d``, ``d`` = steps since the refresh, at most N; the slope is 0
    until there are two; measured 1.5 dB closer than the plain residual at the same speed,
    docs/quality.md#dit).

    It owns everything it keeps: per thread (``Lane``), block part (``Slot``), *call
    identity* and factor. An identity is the call's latent grid, its batch rows, the host's
    own identity (cond/uncond) where it gives one, and the call's place among the calls of
    its noise level with the same grid and rows: two grids in one step (ComfyUI's area
    conditioning, a tiled sampler's edge tiles), a batch that drops its uncond on some steps,
    or Heun's extra calls each find their own residuals. An identity refreshes when it has
    nothing kept or its last refresh is N steps old (a step the host skipped is caught up).
    ``reset`` is the one way back to nothing: every host bracket calls it at a generation's
    start and end (``tome.generation``), on errors and on removal; without a bracket, progress
    going back starts anew (a bare model cannot tell an interrupted generation from the next
    img2img at the same size: open ``tome.generation`` around each one). ``keep`` (``Keep``)
    says what is kept. Memory: ``held_bytes``.

    Compiled blocks (``torch.compile``, fullgraph): everything a block reads is decided on
    the host before the call (``begin``: the lane's ``active``, ``refresh``, the step as a
    0-dim tensor ``now`` on the call's device, each slot's ``cur``), and a refreshing call
    runs eagerly (``_Eager``; its bracket calls ``end``), so a compiled block only ever sees
    reuse's one state: steps, identities and refreshes do not recompile."""

    def __init__(self, every: int = 0, keep: Keep = Keep(), extrapolate: bool = True,
                 paced: bool = False):
        self.every, self.keep, self.extrapolate = every, keep, extrapolate
        self.base, self.paced = every, paced  # ``pace``
        self.order: tuple[int, ...] = ()  # pooled blocks' indices (``Keep.blocks`` counts here)
        self.indices: list[int] = []      # the joined parts' blocks, in joining order
        self._local = threading.local()
        self._lock = threading.Lock()
        self._lanes: list[Lane] = []

    def pace(self, steps: int | None) -> None:
        """The sampling has ``steps`` steps (None: not told): where ``paced``, the refresh
        period follows them (``period``); else it stays the settings' ``every``."""
        self.every = period(self.base, self.paced, steps)

    # ---------------------------------------------------------------- lanes

    def lane(self) -> Lane:
        """This thread's lane (made at its first call)."""
        lane = getattr(self._local, "lane", None)
        if lane is None:
            lane = self._local.lane = Lane(self)
            with self._lock:  # a worker thread that ended leaves its lane (and what it kept)
                dead = [x for x in self._lanes if not x.thread.is_alive()]
                self._lanes = [x for x in self._lanes if x not in dead] + [lane]
            for x in dead:
                x.reset()
        return lane

    def join(self, index: int) -> int:
        """A block part of block ``index`` whose calls go through ``around``: its position in
        every lane's ``slots``."""
        self.indices.append(index)
        with self._lock:
            for lane in self._lanes:  # lanes already made gain the slot
                slot = Slot(index, self.keeps(index), lane)
                if lane.who is not None and slot.on:
                    slot.cur = slot.kept.setdefault(lane.who, {})
                lane.slots += (slot,)
        return len(self.indices) - 1

    def parts(self) -> tuple[Slot, ...]:
        """This thread's slots, in joining order (``join``'s positions)."""
        return self.lane().slots

    def __getattr__(self, name: str) -> Any:
        """This thread's call state (``who``, ``step``, ``at``, ``refresh``, ``active``,
        ``now``, ``before``) read as the reuse's own (the memory budget asks per call)."""
        if name in ("who", "step", "at", "refresh", "active", "now", "before", "last"):
            return getattr(self.lane(), name)
        raise AttributeError(name)

    # ---------------------------------------------------------------- host side, per call

    def reset(self) -> None:
        """Drop everything kept, in every thread, and start counting steps again (a host's
        run start, a generation's end, an error, removal)."""
        with self._lock:
            lanes = list(self._lanes)
        for lane in lanes:
            lane.reset()

    def reset_lane(self) -> None:
        """Drop what this thread's lane keeps (its own run's start or end)."""
        self.lane().reset()

    def set_keep(self, keep: Keep) -> None:
        """Keep ``keep`` from now on, step counting intact. What is kept is converted where
        only the dtype or the slope changes (true CFG's second call stepping the ladder down:
        the first call's refresh stands), else dropped: every identity then refreshes at its
        next call, the current call too, where it reuses."""
        old, self.keep = self.keep, keep
        convert = keep.blocks is None and old.blocks is None and keep.image_only == old.image_only
        with self._lock:
            lanes = list(self._lanes)
        me = self.lane()
        for lane in lanes:
            for slot in lane.slots:
                slot.kept = {who: {f: self._converted(*t) for f, t in by.items()}
                             for who, by in slot.kept.items()} if convert else {}
                slot.on = self.keeps(slot.index)
                slot.cur = None if lane.who is None or not slot.on \
                    else slot.kept.setdefault(lane.who, {})
            lane.active = lane.active and keep.blocks != 0
            if not convert:
                lane.at, lane.refresh = {}, lane.who is not None
                for slot in lane.slots:
                    slot.due, slot.fresh, slot.owed = lane.refresh, {}, {}
                    slot.was = None if slot.cur is None else {}
                if lane.who is not None and lane is me:
                    lane.at[lane.who] = lane.step

    def _converted(self, r: torch.Tensor, slope: Any, at: Any) -> tuple:
        """What is kept, (residual, slope, step), as ``keep`` keeps it (``set_keep``)."""
        dt = self.keep.dtype
        return kept_as(r, dt), None if slope is None or not self.keep.slope \
            else kept_as(slope, dt), at

    @property
    def kept(self) -> dict[tuple, tuple]:
        """What is kept now: (block index, slot, factor, identity) -> (r, slope, at)."""
        with self._lock:
            lanes = list(self._lanes)
        return {(slot.index, id(slot), f, who): t for lane in lanes for slot in lane.slots
                for who, by in slot.kept.items() for f, t in by.items()}

    def held_bytes(self) -> int:
        """Bytes kept now (the residuals and slopes)."""
        return sum(t.nbytes for kept in self.kept.values() for t in kept[:2] if t is not None)

    def begin(self, p: float, rows: int, grid: tuple[int, ...], who: Any = None,
              device: Any = None, step: int | None = None) -> None:
        """One model call at sampling progress ``p`` (0 at the first step) with ``rows`` batch
        rows on latent ``grid`` (frames, h, w); ``who``: the host's identity of the call
        (e.g. ComfyUI's cond_or_uncond), where it gives one; ``device``: the call's (the
        step is filled there, a kernel argument: no copy from the host, no sync); ``step``:
        the sampler's own step number, where the host tells it (ComfyUI: the sigma's place
        in its schedule), so steps a cache answered without calling the model still count;
        else the noise levels seen are counted."""
        lane = self.lane()
        lane.settle(self.every)  # a call whose host did not settle it (it raised)
        lane.leave()  # a call that raised before its end
        lane.who, lane.active = None, False
        for slot in lane.slots:
            slot.cur = slot.was = None
        if not self.every or self.keep.blocks == 0:
            return
        if lane.last is not None and p < lane.last:
            lane.reset()  # progress went back: another generation (no bracket said so)
        if p != lane.last:
            lane.step = lane.step + 1 if step is None else step
            lane.last, lane.seen = p, {}
            lane.now = torch.full((), float(lane.step), device=device)
        ident = (tuple(grid), rows, who)
        n = lane.seen[ident] = lane.seen.get(ident, -1) + 1
        who = lane.who = (*ident, n)
        at = lane.before = lane.at.get(who)
        lane.refresh = at is None or lane.step - at >= self.every
        if lane.refresh:
            lane.at[who] = lane.step
        for slot in lane.slots:
            if not slot.on:
                slot.cur = None
                continue
            slot.cur = slot.kept.setdefault(who, {})
            slot.was = dict(slot.cur)
            last = slot.fresh.get(who)
            # a part a step cache skipped when its refresh was due refreshes at its next
            # computed call, as one whose residual is ``every`` steps old: never older
            slot.due = lane.refresh or who in slot.owed or (
                last is not None and lane.step - last >= self.every)
        lane.active = True
        if any(slot.due for slot in lane.slots if slot.on):  # compiled blocks see one
            lane.eager = True                                  # state (``_Eager``)
            EAGER.enter()

    @graphs.host_side
    def end(self) -> None:
        """This thread's model call ended (its bracket's exit): compiled code runs compiled
        again where no other thread's call refreshes (eager inside a compiled model)."""
        lane = getattr(self._local, "lane", None)
        if lane is not None:
            lane.leave()

    def settle(self) -> Settled | None:
        """This thread's call that just ran, settled on the host (``Lane.settle``): the
        adapters call it at each model call's end and count what it says."""
        return self.lane().settle(self.every)

    def missed(self) -> None:
        """This call was to refresh but ran no pooled attention (a cache answered it inside
        the model): its refresh is left to the identity's next call."""
        lane = self.lane()
        if lane.refresh and lane.who is not None:
            if lane.before is None:
                lane.at.pop(lane.who, None)
            else:
                lane.at[lane.who] = lane.before

    # ---------------------------------------------------------------- in the block

    def keeps(self, index: int) -> bool:
        n = self.keep.blocks
        return n is None or index in (self.order[:n] if self.order else range(n))

    def slot_of(self, part: Any) -> Slot | None:
        """``part``'s slot in this call: a ``Slot``, or one pushed onto an adapter's own
        wrapper (``reuse_slot``); a part no adapter joined (a test's) joins now."""
        if isinstance(part, Slot):
            return part
        slot = getattr(part, "reuse_slot", None)
        if slot is None:  # eager only: tests call maths on wrappers no patch made
            pos = self.join(getattr(part, "index", 0))
            part.reuse_slot = slot = self.parts()[pos]
        return slot

    def around(self, key: tuple, out: torch.Tensor, full: Any, dim: int = 1,
               span: tuple[int, int] | None = None) -> torch.Tensor:
        """The one guard of every family's maths: a pooled attention output ``out`` (the
        sequence on ``dim``; ``span``: the image rows, start and stop) plus its kept residual,
        or on a refresh (or with nothing kept for this part and factor) ``full()``, keeping
        ``full - out`` per ``keep``. ``full(rows=None)``: the unpooled attention (of the first
        ``rows`` query rows only, where given: the auto policy times a refresh's share with
        it). ``key``: (part, factor). Outside a call with reuse: ``out``."""
        if not self.every:
            return out
        part, factor = key
        slot = self.slot_of(part)
        lane = slot.lane
        if not lane.active or slot.cur is None:
            return out
        cur = slot.cur
        kept = cur.get(factor)
        image = span if self.keep.image_only and span is not None else None
        if kept is not None and kept[0].shape != (out.shape if image is None else out.narrow(
                dim, image[0], image[1] - image[0]).shape):
            kept = None  # another text length under the same identity: start again
        if kept is not None and not slot.due:
            r, slope, at = kept
            add = r.to(out.dtype)
            if slope is not None:
                add = add + slope.to(out.dtype) * (lane.now - at).clamp(max=self.every)
            if image is None:
                return out + add
            a, b = image
            return torch.cat([out.narrow(dim, 0, a), out.narrow(dim, a, b - a) + add,
                              out.narrow(dim, b, out.shape[dim] - b)], dim)
        f = full()
        r = f - out
        if image is not None:  # a copy: a view would hold all of ``full - out``
            r = r.narrow(dim, image[0], image[1] - image[0]).clone()
        slope = None
        if self.extrapolate and self.keep.slope:
            slope = torch.zeros_like(r) if kept is None else \
                (r - kept[0].to(r.dtype)) / (lane.now - kept[2]).clamp(min=1)
        dt, sized = self.keep.dtype, lambda t: graphs.sized_by_graph(t, 0, dim)  # rows, sequence
        cur[factor] = (sized(kept_as(r, dt)), sized(None if slope is None else kept_as(slope, dt)),
                       lane.now)
        return f
