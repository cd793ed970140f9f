"""What to merge in one model call: the plan module shared by every host adapter.

Every adapter (``patch.py``: forward hooks on ldm, sgm and diffusers UNets; ``patcher.py``:
the ModelPatcher contract of the Forge family and ComfyUI; the DiT adapters, whose planner
decides the window and the policy) sees the same things: a call starts (latent size,
timestep), then transformer blocks run, each with a token sequence.
``Planner`` turns that into one plan per block, or nothing, deciding

- which blocks are merged: the grid of the block's tokens (``grid_of``), ``max_downsample``
  and the ``auto`` policy (``policy.py``);
- the plan itself: the configured method builds it (``methods.py``: a ``merge.Plan`` for ToMe,
  a ``DownsamplePlan`` for ToDo);
- which tokens are destinations: a partition that is a pure function of (seed, timestep,
  grid), computed on the device, so the cond and uncond halves of a step agree even when a
  host runs them in separate calls, and the global RNG is never touched;
- how often matching runs: once per block (``share="block"``, tomesd's way) or once per level
  and call, reused by every block at that level (``share="level"``).

The forward path reads nothing back to the host (no ``.item()``, no ``float(tensor)``) except
the timestep, once per call, and only when a ``start``/``end`` window needs it.

The window is read in the units the host hands the model (``Window``): a 0-999 training
timestep where the UNet is called with one (A1111's hooks, diffusers), a k-diffusion sigma on
the ModelPatcher path (ComfyUI, the Forge family: 14.6 down to 0.03 on SD1.5, 1 down to 0 on
a flow-matching DiT), converted with the model's own ``percent_to_sigma`` so a shifted flow
schedule or a zero-terminal-SNR UNet is cut where its own sampler's progress is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import graphs, merge, methods, policy
from .config import ToMeConfig

NUM_TRAIN_TIMESTEPS = 1000


EDGE = 1e-5  # relative slack on a sigma window's edges (float32 against float64)


class Window:
    """Which steps of a sampling pass merge (``config.start``/``end``), in the host's units.

    ``Window(start, end)`` reads a 0-999 training timestep (progress ``1 - t / 1000``);
    ``Window.sigmas(start, end, percent_to_sigma)`` reads a k-diffusion sigma, merging where
    ``percent_to_sigma(end) <= sigma <= percent_to_sigma(start)`` (the host's own conversion,
    as ComfyUI's and Forge's start/end percent patches do). ``seen`` counts the steps of the
    latest pass, for the line that says ``merged in 2 of 4 steps``."""

    def __init__(self, start: float, end: float, bounds: tuple[float, float] | None = None,
                 percent_to_sigma: Callable[[float], Any] | None = None):
        self.start, self.end = start, end
        self.bounds = bounds  # (lowest, highest) sigma that merges; None: timesteps
        self.percent_to_sigma = percent_to_sigma  # the host's conversion (sigma windows)
        self.merged = self.steps = 0
        self._last: float | None = None

    @classmethod
    def sigmas(cls, start: float, end: float, percent_to_sigma: Callable[[float], Any]
               ) -> Window:
        """Both edges are kept: a step on an edge merges. The host hands float32 sigmas while
        its conversion may answer in float64 (a Flux step on the 0.5 edge read 0.75951093 >
        0.75951092), so the bounds are widened by a relative 1e-5, far below any step."""
        lo, hi = float(percent_to_sigma(end)), float(percent_to_sigma(start))
        return cls(start, end, (lo * (1 - EDGE), hi * (1 + EDGE)), percent_to_sigma)

    @property
    def full(self) -> bool:
        """The window is the whole pass: no timestep is read."""
        return self.start <= 0 and self.end >= 1

    def inside(self, t: float) -> bool:
        if self.bounds is None:
            return self.start <= self.progress(t) <= self.end
        return self.bounds[0] <= t <= self.bounds[1]

    def progress(self, t: float) -> float:
        """The sampling progress (0 = first step) at ``t`` in this window's units: ``1 - t /
        1000`` for a timestep, the host's ``percent_to_sigma`` inverted by bisection for a
        sigma (it falls from the largest sigma at 0 to 0 at 1); host floats only."""
        convert = self.percent_to_sigma
        if convert is None:
            return 1.0 - t / NUM_TRAIN_TIMESTEPS
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            if float(convert(mid)) > t:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    def seen(self, t: float, merged: bool) -> None:
        """Count a call at ``t``: calls at the same noise level (cond and uncond, a second-order
        sampler's correction) are one step; a noise level above the last starts a new pass."""
        if t == self._last:
            return
        if self._last is None or t > self._last:
            self.merged = self.steps = 0
        self._last = t
        self.steps += 1
        self.merged += merged

    def count(self, sigmas: Any) -> tuple[int, int]:
        """``(steps inside, steps)`` of a sampler's schedule (the model is called at every
        sigma but the last)."""
        values = [float(s) for s in list(sigmas)[:-1]]
        return sum(self.inside(s) for s in values), len(values)

    def sigma_text(self) -> str:
        """The window as the sigmas it merges between (ModelPatcher hosts), for a console line."""
        if self.bounds is None:
            return ""
        lo, hi = self.bounds
        if hi >= 1e6:  # percent_to_sigma(0): a placeholder above every real sigma
            return f"sigma >= {lo:.3g}"
        return f"sigma <= {hi:.3g}" if lo <= 0 else f"sigma {hi:.3g} to {lo:.3g}"

    def describe(self) -> str:
        """``steps 0-0.5: merged in 2 of 4 steps`` (the counts once a pass has run)."""
        text = f"steps {self.start:g}-{self.end:g}"
        return text + (f": merged in {self.merged} of {self.steps} steps" if self.steps else "")


def grid_of(tokens: int, size: tuple[int, ...], max_downsample: int
            ) -> tuple[int, int, int] | None:
    """``(downsample, h, w)`` of a block seeing ``tokens`` tokens of a latent of ``size``
    (``(height, width)``, or ``(frames, height, width)``: ``frames`` grids of ``h x w``), or
    None when that level is not merged (too deep, or not a grid of this latent). The sizes
    may be a compiled graph's symbolic ones (``Call.grid``): no ``int()`` of them here."""
    t, height, width = size if len(size) == 3 else (1, *size)
    if tokens % t:
        return None
    ds, h, w = merge.grid_size(tokens // t, height, width)
    return None if ds > max_downsample or t * h * w != tokens else (ds, h, w)


def _mix(*parts: int) -> int:
    """A stable 63-bit hash (splitmix64), identical in every process, unlike ``hash()``."""
    z = 0x9E3779B97F4A7C15
    for p in parts:
        z = (z ^ (p & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        z ^= z >> 31
    return z & 0x7FFFFFFFFFFFFFFF


def seeded_partition(config: ToMeConfig, timestep: torch.Tensor | float | None, h: int, w: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(src_idx, dst_idx)`` of an ``h x w`` grid: destinations hashed from
    ``(seed, timestep, grid, cell)`` on ``device``, or top-left without ``use_rand``."""
    c = config
    cells = None
    if c.use_rand:
        key = _mix(c.seed, h, w, c.sx, c.sy)
        cells = merge.hashed_cells(h, w, c.sx, c.sy, key, timestep, device)
    return merge.partition(h, w, c.sx, c.sy, cells, device)


def discrete_percent_to_sigma(percent: float) -> float:
    """The sigma at ``percent`` of SD1/SD2/SDXL's schedule (scaled-linear betas 0.00085 to
    0.012 over 1000 steps; the timestep ``(1 - percent) * 999``, log-sigma interpolated, as
    ComfyUI and Forge convert it): for a ModelPatcher host whose model answers no
    ``percent_to_sigma``."""
    if percent <= 0:
        return float("inf")
    if percent >= 1:
        return 0.0
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, NUM_TRAIN_TIMESTEPS,
                           dtype=torch.float64) ** 2
    cumprod = torch.cumprod(1 - betas, 0)
    log_sigmas = ((1 - cumprod) / cumprod).sqrt().log()
    t = (1 - percent) * (NUM_TRAIN_TIMESTEPS - 1)
    lo = int(t)
    hi = min(lo + 1, NUM_TRAIN_TIMESTEPS - 1)
    return float(((1 - (t - lo)) * log_sigmas[lo] + (t - lo) * log_sigmas[hi]).exp())


def flow_percent_to_sigma(percent: float) -> float:
    """A flow-matching DiT's sigma at ``percent`` without a shift (``1 - percent``): for a host
    whose model answers no ``percent_to_sigma``."""
    return min(max(1.0 - percent, 0.0), 1.0)


class Call:
    """One UNet call: the latent's grid ``(frames, height, width)`` (an image is one frame; a
    video DiT's blocks see ``frames`` grids, frame-major), the timestep (left on the device)
    and the plans shared by the blocks of this call, per level.

    ``size`` is the grid as host ints (reports, measuring); ``grid`` the same as an empty
    tensor's shape (``graphs.grid_tensor``), which is what the blocks read (``sizes``): a call
    started on the host (a UNet's pre-hook runs eagerly) hands a compiled graph its sizes as
    dynamic shapes, not as ints the graph would guard on."""

    __slots__ = ("size", "grid", "timestep", "kind", "measured", "plans", "partitions")

    def __init__(self, size: tuple[int, ...], timestep: Any, kind: str,
                 measured: dict[int, policy.LevelSpeed] | None = None):
        self.size, self.timestep, self.kind = policy.latent_grid(size), timestep, kind
        self.grid = graphs.grid_tensor(*self.size)
        self.measured = measured or {}  # level -> (speed-up, device) measured at this size
        self.plans: dict[tuple, Any] = {}  # keyed by level: a graph's sizes are symbolic
        self.partitions: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # level -> idx

    @property
    def frames(self) -> int:
        return self.size[0]

    @property
    def sizes(self) -> tuple[int, int, int]:
        """``(frames, height, width)`` read from ``grid`` (symbolic in a graph)."""
        return self.grid.shape[0], self.grid.shape[1], self.grid.shape[2]


class Planner:
    """The plans of one patched model, call after call (see the module docstring)."""

    def __init__(self, config: ToMeConfig, max_downsample: int,
                 measurer: Callable[[tuple[int, int, int], int, torch.device], dict] | None = None,
                 levels: list[int] | tuple[int, ...] = (), method: methods.Method | None = None,
                 window: Window | None = None):
        self.config, self.max_downsample = config, max_downsample
        # The start/end window in the host's units (default: 0-999 timesteps).
        self.window = window or Window(config.start, config.end)
        self.levels = sorted(levels)  # the model's levels that may merge (for ``announce``)
        # The config's method, or its DiT form (``dit.DitPool``) on a DiT.
        self.method = method or methods.get(config.method)
        # The latent grid (frames, height, width) of the latest call.
        self.size: tuple[int, int, int] | None = None
        # ``auto`` policy: ``measurer(size, batch, device) -> {level: (speed-up, device)}``,
        # asked once per latent size, in eager mode only (never while compiling a graph).
        self.measurer = measurer if config.policy == "auto" else None
        self.measured: dict[tuple[int, int, int], dict[int, policy.LevelSpeed]] = {}
        # What a measurement depends on beyond the size, read before each call (residual
        # reuse's refresh period in the steps that will run: paced, a step cache's skips): a
        # new value measures that size again. ``_as``: the value each size was measured at.
        self.variant: Callable[[], Any] | None = None
        self._as: dict[tuple[int, int, int], Any] = {}
        # Without random destinations the partition never changes: kept across calls.
        self.fixed: dict[tuple[int, int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        # (level, tokens, device kind, measured) -> policy.Decision, filled as levels are met.
        self.decisions: dict[tuple[int, int, str], policy.Decision] = {}
        # Filled while running: downsample -> (tokens, tokens removed) of the latest call.
        self.tokens: dict[int, tuple[int, int]] = {}
        # ``on_decided(size, [Decision per level])``: told once per size (a latent grid) and
        # device kind, as soon as the decisions are known (a host's narration; no polling, no
        # recomputing).
        self.on_decided: Callable[[tuple[int, int, int], list[policy.Decision]], Any] | None \
            = None
        self._told: set[tuple] = set()  # (size, kind, measured at)

    def begin(self, size: tuple[int, ...], device: torch.device, timestep: Any,
              batch: int = 1) -> Call | None:
        """Start a UNet call on a latent of ``size`` (height, width; a video's frames, height,
        width) on ``device`` with ``batch`` images; None when this step is outside the
        ``start``/``end`` window (the only place the timestep is read on the host). The first
        call at a new size measures first (``measurer``)."""
        size = self.size = policy.latent_grid(size)
        self.prepare(size, batch, device)
        kind = policy.device_kind(device)
        self.announce(size, kind)
        c = self.config
        if not self.window.full:
            if isinstance(timestep, torch.Tensor) and timestep.numel():
                t = float(timestep.reshape(-1)[0])
            elif isinstance(timestep, (int, float)):
                t = float(timestep)
            else:
                t = None
            if t is not None:
                inside = self.window.inside(t)
                if not graphs.compiling():
                    self.window.seen(t, inside)
                if not inside:
                    return None
        return Call(size, timestep if c.use_rand else None, kind, self.measured.get(size))

    def prepare(self, size: tuple[int, ...], batch: int, device: torch.device) -> None:
        """Measure at ``size`` now, if the policy measures and nothing is known yet."""
        size = policy.latent_grid(size)
        if self.measurer is None or graphs.compiling():
            return
        now = self.variant() if self.variant is not None else None
        if size not in self.measured or self._as.get(size) != now:
            self.measured[size] = self.measurer(size, batch, device) or {}
            self._as[size] = now

    def announce(self, size: tuple[int, ...], kind: str) -> None:
        """Tell ``on_decided`` the decisions at ``size`` on ``kind`` once they are known: now,
        or (when this size is still to be measured) right after measuring, at the first call.
        The decisions are the ones the blocks then use."""
        size = policy.latent_grid(size)
        told = (size, kind, self._as.get(size))  # measured again: told again
        if self.on_decided is None or graphs.compiling() or told in self._told \
                or (self.measurer is not None and size not in self.measured):
            return
        self._told.add(told)
        self.on_decided(size, self.decided(size, kind))

    def decided(self, size: tuple[int, ...], kind: str) -> list[policy.Decision]:
        """The decisions at ``size`` on ``kind``, one per level (host side)."""
        size = policy.latent_grid(size)
        measured = self.measured.get(size) or {}
        return [self.decision(lv, policy.level_tokens(size, lv), kind, measured.get(lv))
                for lv in self.levels]

    def decision(self, level: int, tokens: int, kind: str,
                 measured: policy.LevelSpeed | None = None) -> policy.Decision:
        if graphs.compiling():  # a dict filled on the first call would recompile; the tokens
            # may be symbolic: no reason text (it would print, and so pin, them)
            merged = policy.merges(self.config, tokens, kind, measured, self.method)
            return policy.Decision(level, tokens, merged, "")
        key = (level, tokens, kind, measured)
        if key not in self.decisions:
            self.decisions[key] = policy.decide_level(self.config, level, tokens, kind, measured,
                                                      self.method)
        return self.decisions[key]

    def plan(self, call: Call, x: torch.Tensor, decoder: bool = False) -> Any:
        """The plan for a block whose input is ``x`` [B, N, C] in ``call``, or None.

        ``decoder``: the block is on the UNet's upsampling side. With ``share="level"`` the
        encoder and the decoder each build their own plan for a level: decoder features differ
        from the encoder's (they carry the skip connections), and reusing the encoder's matches
        there costs visibly more quality (docs/quality.md).
        """
        N = x.shape[1]
        grid = grid_of(N, call.sizes, self.max_downsample)
        if grid is None:
            return None
        ds, h, w = grid
        if not self.decision(ds, N, call.kind, call.measured.get(ds)).merged:
            return None
        return self.method.plan(self, call, x, ds, h, w, decoder)

    def merges(self, call: Call, tokens: int) -> bool:
        """Whether a block seeing ``tokens`` tokens is merged in ``call`` (level and policy)."""
        grid = grid_of(tokens, call.sizes, self.max_downsample)
        return grid is not None and self.decision(grid[0], tokens, call.kind,
                                                  call.measured.get(grid[0])).merged

    def record(self, ds: int, tokens: int, removed: int) -> None:
        """Report figures, in eager mode only: a compiled graph would guard on the dict."""
        if not graphs.compiling():
            self.tokens[ds] = (tokens, removed)

    def partition(self, call: Call, h: int, w: int, device: torch.device, level: int):
        """Shared by every block at ``level`` (its grid ``h x w``) in this call."""
        key = level
        if key not in call.partitions:
            c = self.config
            if c.use_rand:
                call.partitions[key] = seeded_partition(c, call.timestep, h, w, device)
            elif graphs.compiling():  # part of the graph, no cache to guard on
                call.partitions[key] = seeded_partition(c, None, h, w, device)
            else:
                fixed = (h, w, str(device))
                if fixed not in self.fixed:
                    self.fixed[fixed] = seeded_partition(c, None, h, w, device)
                call.partitions[key] = self.fixed[fixed]
        return call.partitions[key]
