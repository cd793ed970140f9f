"""Measuring one call: time on any device, peak memory, FLOPs, and torch.compile's counters.

- Time: CUDA events with ``torch.cuda.synchronize`` around the call; MPS: wall clock between
  ``torch.mps.synchronize`` calls; CPU: wall clock, or this thread's CPU time (``clock="cpu"``:
  other processes on a shared machine do not inflate it).
- Peak memory: CUDA ``max_memory_allocated`` (reset before the call) above the level at its
  start; CPU: live tensor bytes from the PyTorch profiler's allocation events (no tracemalloc,
  works for CPU tensors); MPS: not measured (None).
- FLOPs: ``torch.utils.flop_counter`` with the CPU fused-attention kernel registered.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def synchronize(device: torch.device | str) -> None:
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.synchronize(device)
    elif kind == "mps":
        torch.mps.synchronize()


class Timer:
    """``seconds, result = timer(fn)``: the time of one call of ``fn`` on ``device``."""

    def __init__(self, device: torch.device | str = "cpu", clock: str = "wall"):
        self.device = torch.device(device)
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', not {clock!r}")
        if clock == "cpu" and self.device.type != "cpu":
            raise ValueError("the 'cpu' clock only times CPU work; use 'wall' on GPUs")
        self.clock = clock

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return start.elapsed_time(end) / 1000.0, out
        now = time.thread_time if self.clock == "cpu" else time.perf_counter
        synchronize(self.device)
        t0 = now()
        out = fn()
        synchronize(self.device)
        return now() - t0, out


def _sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query, key, value)


def flop_counter() -> Any:
    """A ``FlopCounterMode`` that also counts CPU fused attention (not registered upstream)."""
    from torch.utils.flop_counter import FlopCounterMode
    aten = torch.ops.aten
    custom = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        custom[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=custom)


@contextlib.contextmanager
def peak_memory(result: dict[str, float | None], device: torch.device | str = "cpu"):
    """Peak bytes allocated inside the block above its starting level: sets
    ``result["peak"]`` (None where the device has no such counter: MPS)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) - start
        return
    if device.type != "cpu":
        yield
        result["peak"] = None
        return
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with quiet_profiler():
        prof.__enter__()
    try:
        yield
    finally:
        with quiet_profiler():
            prof.__exit__(None, None, None)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    result["peak"] = peak


@contextlib.contextmanager
def quiet_profiler():
    """Starting and stopping the profiler: its C++ side prints ``USDT ... profiler_start`` /
    ``profiler_stop`` to the process's stderr (torch 2.13, no setting turns it off), so fd 2
    goes to the null device for those moments only, never around the measured code."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


# ----------------------------------------------------------------------------- torch.compile


def compile_config(cache_limit: int = 64) -> contextlib.AbstractContextManager:
    """Dynamo settings for comparing patches on one compiled model, for the duration.

    By default dynamo does not guard on module hooks: hooks added after compiling are
    *silently ignored* by the cached graph, so a ToMe patch applied to a compiled model would
    measure the unpatched model. Guarding on hooks makes every patch state its own graph; the
    cache limit is raised so switching between many settings never falls back to eager.
    """
    import torch._dynamo as dynamo
    cfg = dynamo.config
    changes: dict[str, Any] = {"skip_nnmodule_hook_guards": False}
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            changes[name] = max(getattr(cfg, name), cache_limit)
    return cfg.patch(**changes)


def compile_counters() -> dict[str, Any]:
    """A snapshot of dynamo's counters: frames compiled, graphs, graph breaks and reasons."""
    from torch._dynamo.utils import counters
    breaks = dict(counters.get("graph_break", {}))
    return {"frames": int(counters.get("frames", {}).get("total", 0)),
            "graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
            "breaks": int(sum(breaks.values())), "reasons": breaks}


def compile_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What happened between two ``compile_counters`` snapshots; ``reasons`` are the first
    lines of the graph-break reasons that were added."""
    reasons = [k.strip().splitlines()[0] for k, n in after["reasons"].items()
               if n > before["reasons"].get(k, 0)]
    return {"frames": after["frames"] - before["frames"],
            "graphs": after["graphs"] - before["graphs"],
            "breaks": after["breaks"] - before["breaks"], "reasons": reasons}
