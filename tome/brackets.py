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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

# ``start(pipe)``: the generation begins; it returns ``end(failed)``, called when it ends.
Start = Callable[[Any], Callable[[bool], None]]


class Bracket:
    """A diffusers pipeline's ``progress_bar``, shadowed on the pipeline instance: entering
    it is the generation's start and leaving it its end, also on an error or an interrupt
    (``KeyboardInterrupt``, the pipeline's ``interrupt`` flag)."""

    def __init__(self, original: Any, pipe: Any, start: Start):
        self.original, self.pipe, self.start = original, weakref.ref(pipe), start

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _Run(self.original(*args, **kwargs), self)


class _Run:
    """One opened progress bar: the bracket's ``start`` on entering and, whatever happened,
    its ``end`` on leaving."""

    def __init__(self, bar: Any, bracket: Bracket):
        self._bar, self._bracket, self._end = bar, bracket, None

    def __enter__(self) -> Any:
        pipe = self._bracket.pipe()
        self._end = self._bracket.start(pipe) if pipe is not None else None
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
