"""Generation brackets: how a host's generation is framed, apart from how its attention is
reached (the interception: processors, the attention override, swapped functions). A
bracket says when a generation starts and ends, so what a patch keeps across steps
(residual reuse) lives exactly as long as one generation, and the after-sampling line is
said once per generation.

- ``tome.generation(model)``: the public bracket, for a hand-written loop or an unknown host;
- a diffusers pipeline: its ``progress_bar``, which every pipeline opens around its
  denoising loop (``shadow``, here);
- ComfyUI: its run callbacks (``on_pre_run``/``on_cleanup``) on the patched clone
  (``override.py``); the WebUI: its generation, through ``adapters.remove``.

A generation also starts diffusers' step caches anew (``reset_caches``): their hooks keep
what the last call saw, which a pipeline resets after its call and a hand-written loop never.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

# ``start(pipe, steps)``: the generation begins (``steps``: its step count where the pipeline
# tells it, the progress bar's ``total``, else None); it returns ``end(failed)``, called when
# it ends.
Start = Callable[[Any, Any], Callable[[bool], None]]


class Bracket:
    """A diffusers pipeline's ``progress_bar``, shadowed on the pipeline instance: entering
    it is the generation's start and leaving it its end, also on an error or an interrupt
    (``KeyboardInterrupt``, the pipeline's ``interrupt`` flag)."""

    def __init__(self, original: Any, pipe: Any, start: Start):
        self.original, self.pipe, self.start = original, weakref.ref(pipe), start

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        total = kwargs.get("total")
        return _Run(self.original(*args, **kwargs), self,
                    total if isinstance(total, int) and not isinstance(total, bool) else None)


class _Run:
    """One opened progress bar: the bracket's ``start`` on entering and, whatever happened,
    its ``end`` on leaving."""

    def __init__(self, bar: Any, bracket: Bracket, total: int | None = None):
        self._bar, self._bracket, self._end, self._total = bar, bracket, None, total

    def __enter__(self) -> Any:
        pipe = self._bracket.pipe()
        self._end = self._bracket.start(pipe, self._total) if pipe is not None else None
        return self._bar.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self._bar.__exit__(*exc)
        finally:
            interrupted = exc[0] is not None or bool(getattr(self._bracket.pipe(),
                                                             "interrupt", False))
            if self._end is not None:
                self._end(interrupted)

    def __iter__(self) -> Any:
        return iter(self._bar)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


def shadow(model: Any, start: Start) -> list[tuple[Any, str, Any, Any]]:
    """Shadow a diffusers pipeline's ``progress_bar`` with a ``Bracket`` (the first
    transformer's patch carries it): ``(model, attribute, before, ours)`` to undo; nothing
    for a bare module or a pipeline already bracketed."""
    original = getattr(model, "progress_bar", None)
    if isinstance(model, nn.Module) or not callable(original) \
            or isinstance(original, Bracket):
        return []
    ours = Bracket(original, model, start)
    before = vars(model).get("progress_bar")
    model.progress_bar = ours
    return [(model, "progress_bar", before, ours)]


def reset_caches(model: Any) -> bool:
    """Reset diffusers' step caches on ``model``'s transformers (a pipeline's, a wrapper's
    ``transformer``, or the module itself): FirstBlockCache, MagCache, TaylorSeer... are
    stateful hooks that keep the last call's features and step count, so outside a pipeline
    (which resets them after its call) the next image starts from the last one's (TaylorSeer
    on the tiny DiT: 11.6 dB off). Only where a stateful hook is on it; whether one was."""
    found = [getattr(model, n, None) for n in ("transformer", "transformer_2")]
    done = False
    for module in [m for m in found if m is not None] or [model]:
        module = getattr(module, "_orig_mod", module)  # compiled after patching
        if isinstance(module, nn.Module) and callable(
                getattr(module, "_reset_stateful_cache", None)) and any(
                getattr(hook, "_is_stateful", False) for m in module.modules()
                for hook in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values()):
            module._reset_stateful_cache()
            done = True
    return done
