"""What a patch needs to run inside a ``torch.compile``d model (the compile rules every adapter
follows; ``docs/speed.md#compiled``).

- Per-call decisions run on the host (``host_side``): traced, their Python state would become
  guards (a graph per state) or break the trace.
- Sizes reach a graph as tensor shapes (``grid_tensor``, ``sized_by_graph``), which dynamo
  makes dynamic after a second size, never as Python ints it would guard on.
- Nothing Python-side is cached while a graph is traced (``compiling``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch


def host_side(fn: Callable) -> Callable:
    """``fn`` run eagerly even inside a ``torch.compile``d model (dynamo skips it): a patch's
    per-call decisions (the step's progress, residual reuse's state, the memory budget) are
    host work that reads Python state; traced, they would guard on it or break the trace."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(call) if disable is not None else call


def compiling() -> bool:
    """True while ``torch.compile`` traces: Python-side caches must not be filled then (the graph
    would guard on them and recompile). ``torch.compiler.is_compiling`` is torch >= 2.3; the
    WebUI 1.10 ships torch 2.1."""
    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if fn is None:
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return bool(fn()) if fn is not None else False


def sized_by_graph(t: Any, *dims: int) -> Any:
    """``t`` (a tensor kept for a later call, e.g. a residual) with ``dims`` marked dynamic for
    dynamo where it is loaded: otherwise its sizes stay static until they change, and a graph
    that reads it ties the call's symbolic sizes to them (a graph per size). Eager only: a
    graph being traced (a model compiled whole) may not call dynamo's marking."""
    dynamo = sys.modules.get("torch._dynamo")
    if t is not None and hasattr(dynamo, "maybe_mark_dynamic") and not compiling():
        dynamo.maybe_mark_dynamic(t, list(dims))
    return t


def grid_tensor(frames: int, h: int, w: int) -> torch.Tensor:
    """An empty tensor (no storage) whose shape is a grid ``(frames, h, w, 0)``: how a call
    or a plan carries its sizes into a compiled graph. The graph reads them as it reads the
    model's own tensors' sizes, so dynamo makes them dynamic after a second image size
    (automatic dynamic shapes) instead of guarding on each ``h == 16`` and recompiling per
    size, as it would on Python ints."""
    return torch.empty((frames, h, w, 0))


def forget_graphs(module: Any) -> bool:
    """Drop dynamo's compiled graphs so that ``module`` (a ``torch.compile``d module, or the
    module one wraps) is traced again at its next call; False where nothing could be dropped.

    For a host whose compile hides changes of patches from dynamo's guards (ComfyUI's
    TorchCompileModel drops every guard on ``transformer_options``): a graph traced before a
    patch was added would replay the model without it. Where attention breaks the graph
    (ComfyUI's CPU attention), the module's blocks are frames of their own, which their code
    cannot tell from other models' frames: every code cache dynamo holds is dropped
    (``reset_code_caches``; other compiled models trace again at their next call, dynamo's
    size history stays). Without it, the module's forward's own."""
    dynamo = sys.modules.get("torch._dynamo")
    everything = getattr(dynamo, "reset_code_caches", None)
    if module is not None and everything is not None:
        everything()
        return True
    original = getattr(module, "_orig_mod", module)
    reset = getattr(dynamo, "reset_code", None)
    code = getattr(getattr(type(original), "forward", None), "__code__", None)
    if module is None or reset is None or code is None:
        return False
    reset(code)
    return True
