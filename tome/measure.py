"""Timing whether merging pays on the device that runs it: the data behind the auto policy.

The fixed thresholds in ``policy.py`` were measured on a few machines; the real answer depends
on the user's device, dtype, attention kernel and image size. ``measure`` times, per UNet
level, one representative transformer block unmerged and merged on the user's own model, and
scales the figures to the whole level (blocks at the level, plans built per call), keeping the
spread of its rounds; ``decide`` turns a row into a yes/no with a safety margin, and a row whose
rounds disagree about it (a busy machine) is timed again, then uncertain: never merged. How a
block runs merged is the host adapter's business (``runner``: ``patch.run_block`` for hooks,
``patcher.run_block`` for the ModelPatcher contract, ``percall_runner.runner`` for a DiT reached
per call: ComfyUI's override, Forge Neo's swap), so this room imports no adapter; the
results' types are ``timing_results.py``'s, remembering them is ``measurements.py``'s.

Measuring never changes the model: it runs under ``torch.no_grad``, draws its inputs from a
private generator, leaves the blocks' hooks as they were, restores their ``training`` flags
and the global RNG state, and checks memory before anything runs (``memory.py``).
"""

from __future__ import annotations

import contextlib
import functools
import platform
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from . import memory, methods, policy
from . import plan as _plan
from .config import ToMeConfig
from .layout import Layout, UnsupportedModelError, attention, channels, context_dim, read, unusable
from .policy import MARGIN
from .timing_results import LevelTiming, Measurement, ratio

CONTEXT_TOKENS = 77  # CLIP's context length: what attn2 sees in every SD model
PHASES = ("unmerged", "build", "merged")  # what a round times, in this order at even rounds

# ``clock(phase, fn) -> seconds``: runs ``fn`` and says how long it took; ``phase`` (one of
# ``PHASES``) lets a test clock answer per phase.
Clock = Callable[[str, Callable[[], Any]], float]
# ``runner(block, x, context, planner, plan)``: run ``block`` on ``x`` with ``plan`` applied
# (None: unmerged) the way the host adapter does.
Runner = Callable[[nn.Module, torch.Tensor, "torch.Tensor | None", _plan.Planner, Any], Any]


# ----------------------------------------------------------------------------- deciding

def decide(row: LevelTiming, margin: float = MARGIN) -> bool:
    """Merge this level only where it was measured at least ``1 + margin`` times faster and
    its rounds agree on that (``policy.uncertain``)."""
    return policy.pays(row.speedup, margin) and not row.uncertain(margin)


# ----------------------------------------------------------------------------- the device

@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def device_name(device: torch.device) -> str:
    """A human-readable name of the device: timings from another device are not this one's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    if device.type == "cpu":
        return _cpu_name()
    return str(device)


def _wall_clock(phase: str, fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _mps_clock(phase: str, fn: Callable[[], Any]) -> float:
    torch.mps.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.mps.synchronize()
    return time.perf_counter() - t0


def _cuda_clock(device: torch.device) -> Clock:
    """CUDA events around ``fn``: the GPU's own time, with one synchronisation (on the end
    event) before the elapsed time is read."""
    def clock(phase: str, fn: Callable[[], Any]) -> float:
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
    return clock


def default_clock(device: torch.device) -> Clock:
    """``clock(phase, fn) -> seconds`` for ``device``: CUDA events, MPS-synchronised or plain wall
    clock (CPU)."""
    if device.type == "cuda":
        return _cuda_clock(device)
    if device.type == "mps":
        return _mps_clock
    return _wall_clock


def _untimed(phase: str, fn: Callable[[], Any]) -> float:
    fn()
    return 0.0


_flush: dict[str, torch.Tensor] = {}


def _evict(device: torch.device) -> None:
    """Push the block's weights and activations out of the caches (CPU L2/L3, a GPU's L2)
    before a timed run: inside a UNet call every block starts cold, and a block timed again
    and again with hot caches makes merging look better than it is where the saving is small
    (few tokens: the weights, not the attention, dominate)."""
    # Always in inference mode: the buffer outlives the call that made it, and the host may
    # sample under ``torch.inference_mode`` (Forge, ComfyUI) and measure later under
    # ``torch.no_grad`` (Measure now), or the reverse; an inference tensor cannot be updated
    # in place outside inference mode, while a normal tensor can be inside it.
    with torch.inference_mode():
        buf = _flush.get(str(device))
        if buf is None:
            buf = _flush[str(device)] = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        buf.add_(1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@contextlib.contextmanager
def _kept(block: nn.Module, device: torch.device):
    """Restore what a measurement could touch: the block's ``training`` flags (it runs in eval
    mode, so dropout never draws) and the global RNG state (CPU, and CUDA on a CUDA device)."""
    flags = [(m, m.training) for m in block.modules()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        block.eval()
        yield
    finally:
        for m, training in flags:
            m.training = training
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


# ----------------------------------------------------------------------------- the model

def attention_backend(model: Any) -> str:
    """Best effort: which attention kernel the blocks run. diffusers: attn1's processor class;
    ldm/sgm: attn1's class ``forward`` (the WebUI swaps it for xFormers, SDPA, sub-quadratic),
    plus the module-level kernel the Forge family and ComfyUI choose at start-up; on CUDA also
    the SDPA back-ends enabled. Part of the cache key, and what ``memory`` reads."""
    try:
        blocks = [b.module for b in read(model).blocks]
    except UnsupportedModelError:
        return "none"
    try:
        attn = attention(blocks[0])
    except UnsupportedModelError:  # a host's DiT block (ComfyUI's Flux): named by its kernel
        attn = blocks[0]
    processor = getattr(attn, "processor", None)
    # a wrapping processor (ours on DiTs) calls the one it wraps: name that one
    processor = getattr(processor, "original", processor)
    if processor is not None:
        name = type(processor).__name__
        if hasattr(processor, "_attention_backend"):  # diffusers' dispatch_attention_fn
            name += f" dispatch_attention_fn:{processor._attention_backend or 'native'}"
    else:
        fn = type(attn).forward
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        swapped = memory.kernel(attn)
        if swapped:
            name += f" {swapped}"
    if next(blocks[0].parameters()).device.type == "cuda":
        flags = [n for n in ("flash", "mem_efficient", "math", "cudnn")
                 if getattr(torch.backends.cuda, f"{n}_sdp_enabled", lambda: False)()]
        name += " sdp:" + ",".join(flags)
    return name


# ----------------------------------------------------------------------------- measuring

def representative(blocks: list[nn.Module], sub_layers: Iterable[str]) -> nn.Module | None:
    """The block that stands for its level: the first one that can run our way
    (``layout.unusable``: none another extension took over, which could not run on a bare
    input); None if there is none."""
    subs = tuple(sub_layers)
    return next((b for b in blocks if unusable(b, subs) is None), None)


def _plan_count(planner: _plan.Planner, call: Any, x: torch.Tensor, blocks: list[nn.Module],
                decoder: set[nn.Module]) -> int:
    """Plans built per UNet call at one level: ask the planner for every block's plan in one
    call and count the distinct ones (one per UNet side with share="level", one per block
    with share="block", one per grid for ToDo)."""
    plans = [planner.plan(call, x, b in decoder) for b in blocks]
    return len({id(p): p for p in plans if p is not None})


def _check_memory(layout: Layout, latent: tuple[int, ...], batch: int,
                  chosen: dict[int, nn.Module | None]) -> None:
    """Raise ``memory.NotEnoughMemoryError`` before anything runs if the largest timed run
    would not fit (``memory.py``: measuring must never take the host down)."""
    runs = [(b, policy.level_tokens(latent, lv), width(b)) for lv, b in chosen.items()
            if b is not None]
    if runs:
        memory.check(runs, batch, attention_backend(layout))


def width(block: nn.Module) -> int:
    """The block's token width (``layout.channels``), else the input width most of its linear
    layers share (a host's DiT block without ``norm1`` or ``attn``: ComfyUI's Flux)."""
    try:
        return channels(block)
    except (UnsupportedModelError, AttributeError):  # no norm1, attn, to_q or qkv
        widths = [m.in_features for m in block.modules() if isinstance(m, nn.Linear)]
        if not widths:
            raise
        return max(set(widths), key=widths.count)


def _clear(speedups: list[float], margin: float = MARGIN) -> bool:
    """Every round so far lands on the same side of the decision, with room to spare: more
    rounds could not change it (a large level at 2x, or one that clearly costs)."""
    return min(speedups) >= (1.0 + margin) ** 2 or max(speedups) < 1.0 / (1.0 + margin)


def measure(model: Any, latent: tuple[int, ...], batch: int, config: ToMeConfig, *,
            runner: Runner, rounds: int = 5, warmup: int = 1, clock: Clock | None = None,
            levels: Iterable[int] | None = None, min_rounds: int = 3,
            retakes: int = 2) -> Measurement:
    """Time each mergeable level of ``model`` unmerged and merged with ``config``.

    Per level, one transformer block stands for each group of blocks of one shape (a UNet
    level's blocks; a DiT's double- and single-stream blocks the schedule pools, summed into
    its one level: ``Layout.timed``; ``representative``; a group whose every block another
    extension has taken over is not timed, and a level with none gets no row, so the
    thresholds decide it); ``_Timer`` times it. ``runner`` runs a block with or without
    a plan the way the host adapter does (``patch.run_block``, ``patcher.run_block``,
    ``processors.runner``); ``clock`` replaces the device's clock (tests). Runs on the device
    and dtype of the UNet's blocks, with inputs from a private generator; the model, its
    hooks, flags and the global RNG state are left exactly as they were. Raises
    ``memory.NotEnoughMemoryError`` before anything runs where the largest run would not fit.

    A level whose rounds disagree about the decision (``LevelTiming.uncertain``: one round
    says merge, another not; a busy machine) is timed again, at most ``retakes`` times; the
    first take whose rounds agree is its row, else all its rounds together, uncertain (the
    policy then does not merge it).

    Cost: ``warmup`` + ``min_rounds`` to ``rounds`` x (two block runs + one plan build) per
    level, up to ``retakes`` times more where the rounds disagree; SD1.5 at 512 px on a CPU
    (level 1 only, the default) takes about one UNet forward, hence the cache.
    """
    if rounds < 1 or warmup < 0 or retakes < 0:
        raise ValueError(f"ToMe: rounds must be >= 1, warmup and retakes >= 0, not {rounds}, "
                         f"{warmup}, {retakes}")
    layout = read(model)
    # Seed, window and use_rand do not change the cost: build as a random-destination call would.
    cfg = config.replace(policy="fixed", start=0.0, end=1.0, use_rand=True)
    latent = tuple(int(s) for s in latent)  # (height, width), a video's (frames, h, w)
    facts = layout.facts  # what a UNet or a DiT times (``Layout.timed``)
    method, groups = facts.method(cfg), layout.timed(cfg, levels)
    decoder = {b.module for b in layout.blocks if b.decoder}
    subs = facts.sub_layers(cfg)
    reps = {level: [representative(g, subs) for g in gs] for level, gs in groups.items()}
    _check_memory(layout, latent, batch, {level: rs[0] for level, rs in reps.items()})
    rows = []
    for level, gs in groups.items():
        timers = [_Timer(rep, g, decoder, level, latent, batch, cfg, runner, clock, method)
                  for g, rep in zip(gs, reps[level]) if rep is not None]
        if not timers:
            continue
        takes: list[list[list[Sample]]] = []  # per take, per group: its rounds
        for take in range(1 + retakes):
            takes.append([t.rounds(rounds, warmup if take == 0 else 0, min_rounds)
                          for t in timers])
            row = _level_row(level, timers, takes[-1])
            if not row.uncertain():
                break
        else:  # every take disagreed: all their rounds, still uncertain
            row = _level_row(level, timers, [sum(parts, []) for parts in zip(*takes)])
        rows.append(row)
    return _result([r for rs in reps.values() for r in rs], layout, latent, batch,
                   config.method, rows)


Sample = tuple[float, float, float]  # one round's seconds: unmerged, plan build, merged


def _level_row(level: int, timers: list[_Timer], samples: list[list[Sample]]) -> LevelTiming:
    """One level's row from its groups' rounds (a DiT's double- and single-stream blocks:
    the blocks and times add up, one plan per call; the spread's ends are each group's ends,
    its merged time scaled to them)."""
    parts = [t.row(s) for t, s in zip(timers, samples)]
    if len(parts) == 1:
        return parts[0]
    unmerged = sum(r.unmerged_ms for r in parts)

    def end(at: Callable[[LevelTiming], float]) -> float:
        return ratio(unmerged, sum(ratio(r.unmerged_ms, at(r)) if r.unmerged_ms > 0
                                    else r.merged_ms for r in parts))
    return LevelTiming(level, parts[0].tokens, sum(r.blocks for r in parts), parts[0].plans,
                       unmerged, sum(r.merged_ms for r in parts),
                       end(lambda r: r.low), end(lambda r: r.high))


def _result(blocks: Iterable[nn.Module | None], layout: Layout, latent: tuple[int, ...],
            batch: int, method: str, rows: list[LevelTiming]) -> Measurement:
    p = next(iter(b for b in blocks if b is not None), layout.root)
    p = next(p.parameters())
    return Measurement(device_name(p.device), str(p.dtype).removeprefix("torch."), latent,
                       int(batch), method, tuple(rows),
                       time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


class _Timer:
    """One block standing for its group at one level: its inputs, planner and three runs
    (``PHASES``), timed in ``rounds``; ``row`` makes a level's row of them."""

    def __init__(self, block: nn.Module, blocks: list[nn.Module], decoder: set[nn.Module],
                 level: int, latent: tuple[int, ...], batch: int, cfg: ToMeConfig,
                 runner: Runner, clock: Clock | None, method: methods.Method | None = None):
        p = next(block.parameters())
        self.block, self.device = block, p.device
        self.tick = clock or default_clock(self.device)
        self.level, self.blocks = level, len(blocks)
        self.tokens = policy.level_tokens(latent, level)
        g = torch.Generator().manual_seed(level)
        x = torch.randn(batch, self.tokens, width(block), generator=g).to(self.device, p.dtype)
        ctx = None
        if context_dim(block) is not None:
            ctx = torch.randn(batch, CONTEXT_TOKENS, context_dim(block), generator=g
                              ).to(self.device, p.dtype)
        planner = _plan.Planner(cfg, level, method=method)
        t = torch.tensor(500.0, device=self.device)
        built: list[Any] = [None]

        def build() -> None:
            built[0] = planner.plan(planner.begin(latent, self.device, t), x, False)

        self.run = {"unmerged": lambda: runner(block, x, ctx, planner, None), "build": build,
                    "merged": lambda: runner(block, x, ctx, planner, built[0])}
        with torch.no_grad():
            self.plans = _plan_count(planner, planner.begin(latent, self.device, t), x, blocks,
                                     decoder)

    def _row(self, unmerged_s: float, build_s: float, merged_s: float) -> LevelTiming:
        n = self.blocks
        return LevelTiming(self.level, self.tokens, n, self.plans, n * unmerged_s * 1e3,
                           (self.plans * build_s + n * merged_s) * 1e3)

    def row(self, samples: list[Sample]) -> LevelTiming:
        """The fastest of each phase over ``samples`` (other work on the machine only ever
        adds time: the fastest run is the least disturbed), with the spread of the speed-up:
        every round's own figure and this one."""
        r = self._row(*(min(ts) for ts in zip(*samples)))
        speeds = [self._row(*s).speedup for s in samples] + [r.speedup]
        return LevelTiming(r.level, r.tokens, r.blocks, r.plans, r.unmerged_ms, r.merged_ms,
                           min(speeds), max(speeds))

    def rounds(self, rounds: int, warmup: int, min_rounds: int) -> list[Sample]:
        """``warmup`` untimed rounds (on a GPU the first runs pay for lazy initialisation and
        kernel selection: the clock never sees them), then at most ``rounds`` timed ones. Each
        round runs the block unmerged, the plan build (a fresh call, as in sampling) and the
        block merged, unmerged first in one round and last in the next, caches evicted before
        each run. Stops after ``min_rounds`` once every round's speed-up lands clearly on one
        side of the decision (``_clear``: the large levels, the costly ones to time, are
        rarely near the margin). On a 2-core CPU with a UNet running on the other core, the
        median moved by 25% from one measurement to the next, the fastest by 5%."""
        samples: list[Sample] = []
        with torch.no_grad(), _kept(self.block, self.device):
            for i in range(warmup + rounds):
                if i == warmup:
                    _sync(self.device)
                timed = self.tick if i >= warmup else _untimed
                # alternate the order, so whatever runs first is no handicap
                order = PHASES if i % 2 == 0 else ("build", "merged", "unmerged")
                took = {}
                for phase in order:
                    _evict(self.device)
                    took[phase] = timed(phase, self.run[phase])
                if i >= warmup:
                    samples.append((took["unmerged"], took["build"], took["merged"]))
                    if len(samples) >= min_rounds and _clear(
                            [self._row(*s).speedup for s in samples]):
                        break
        return samples
