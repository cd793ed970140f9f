"""The patch handle: what a host holds of a patch on a ModelPatcher clone, beside its report.

A host (ComfyUI's node, the WebUI's runner on the Forge family) patches through
``adapters.patch_model_patcher`` and then drives the patch through this handle alone: the
settings as applied and what its form could not apply (``applied``, ``limits``), its
callbacks given once (``attach``: the host's voice, its look at each call's options, its
judge of chained overrides that take pooled keys only whole, its word for a patch never
reached), and after each sampling or pass the line saying what happened (``since`` before,
``after`` then). No host reads the adapters' objects (``tests/test_layers.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from . import percall_calls
from .config import ToMeConfig
from .report import PatchReport


class Callbacks(NamedTuple):
    """What a host hands a patch (each optional).

    ``say``: its console voice (one line per event). ``on_call``: its look at each model
    call's ``transformer_options`` (ComfyUI: the step window's line). ``leave(prev, args,
    kwargs)``: the name of a chained override that takes this attention call only whole
    (ComfyUI's block-sparse attention), else None. ``on_silent``: told once where the patch
    was installed but its first call never reached it."""

    say: Callable[[str], Any] | None = None
    on_call: Callable[[dict], Any] | None = None
    leave: Callable[[Any, tuple, dict], str | None] | None = None
    on_silent: Callable[[], Any] | None = None


class PatchHandle:
    """One patch (``mark``: the adapter's object on a ModelPatcher clone, or its state on a
    plain module's root) with its report. ``per_call``: a DiT's patch, which counts its model
    and attention calls (ComfyUI's override, Forge Neo's swap, the processors on plain
    modules); else a UNet's (the attn1 patch counts its calls)."""

    def __init__(self, mark: Any, report: PatchReport | None, per_call: bool):
        self._mark, self.report, self.per_call = mark, report, per_call

    @property
    def applied(self) -> ToMeConfig:
        """The settings as this form applies them (a DiT's: presets resolved, RoPE)."""
        return getattr(self._mark, "applied", None) or self.report.config

    @property
    def limits(self) -> list[str]:
        """What this host's form cannot apply of the settings (named, never silent)."""
        return list(getattr(self._mark, "limits", ()))

    @property
    def silent(self) -> str:
        """The line for a patch installed but never reached."""
        return self._mark.SILENT

    @property
    def calls(self) -> int:
        """Calls the patch received so far, counted on the host (model calls, or a UNet's
        attn1 calls in eager calls)."""
        return self._mark.calls

    def start(self, x: Any, sigmas: Any, options: dict | None = None) -> Any:
        """A UNet's patch: begin the model call on the latent ``x`` at ``sigmas`` on the host,
        before the model runs (outside a compiled UNet); hand the result to ``finish`` after
        it. Hosts that call this get a compiled UNet's graphs right at every call (the
        window, the settings); None for a DiT's patch, which starts its own calls."""
        start = getattr(self._mark, "start", None)
        return start(x, sigmas, options) if not self.per_call and start is not None else None

    def finish(self, started: Any) -> None:
        if started is not None:
            self._mark.finish(started)

    def attach(self, callbacks: Callbacks) -> None:
        """Give the patch the host's callbacks (before its first sampling)."""
        mark = self._mark
        if callbacks.on_silent is not None and hasattr(mark, "on_silent"):
            mark.on_silent = callbacks.on_silent
        if callbacks.on_call is not None and hasattr(mark, "on_call"):
            mark.on_call = callbacks.on_call
        pool = getattr(mark, "pool", None)
        if pool is not None:  # ComfyUI's override: chained overrides judged and said
            pool.leave = callbacks.leave
            pool.say = callbacks.say

    def since(self) -> Any:
        """What has been counted so far (hand it to ``after`` or ``reached``). A UNet's patch
        also starts marking its calls anew: a compiled graph's replay runs no Python to count,
        but sets the mark."""
        if not self.per_call:
            return self._mark.since()
        return self._mark.counts(), self._mark.tallies()

    def after(self, since: Any, told_silent: bool = False) -> str | None:
        """The line after a sampling or pass that began at ``since``: a DiT's why nothing was
        pooled, else how many attention calls were pooled and what the rest were (with the
        steps a cache skipped and where reuse refreshed, where the host says them); a UNet's
        line where its patch was never called (unless ``told_silent``); else None."""
        mark = self._mark
        if not self.per_call:
            return self.silent if not mark.reached_since(since) and not told_silent else None
        return mark.not_pooled(since[0]) or self.tally(since)

    def tally(self, since: Any) -> str:
        """A DiT's attention calls since ``since``: how many pooled, what the rest were."""
        sampling = getattr(self._mark, "sampling", None)
        steps = sampling() if callable(sampling) else None
        self._mark.note(steps)  # what a step cache left to compute: the auto policy's next
        return percall_calls.line(self._mark.tallies(), since[1], steps)

    def reached(self, since: Any) -> bool:
        """Whether a call since ``since`` reached the patch's attention."""
        return self._mark.counts()[1] > since[0][1] if self.per_call else \
            self._mark.reached_since(since)

    def missed(self) -> bool:
        """A UNet's patch: its call started last had levels to merge and no block at them
        reached the patch since ``since`` (False for a DiT's)."""
        missed = getattr(self._mark, "missed", None)
        return bool(missed()) if not self.per_call and missed is not None else False

    def said_silent(self) -> bool:
        """Whether the host has a word for a never-reached patch (it said it at the call)."""
        return getattr(self._mark, "on_silent", None) is not None

    def held_bytes(self) -> int:
        """Bytes residual reuse holds now (0 without reuse)."""
        reuse = getattr(self._mark, "reuse", None)
        return reuse.held_bytes() if reuse is not None else 0

    def fix_keep(self, keep: Any) -> None:
        """Keep ``keep`` (``reuse.Keep``) whatever memory says (the lab's memory ladder)."""
        budget = getattr(self._mark, "budget", None)
        if budget is not None:
            budget.fixed = keep

    def reset(self, steps: int | None = None) -> None:
        """Drop what the patch keeps across steps (a generation's start or end); ``steps``:
        the next generation's step count, where known (reuse's refreshes are paced to it).
        The steps counted since the last reset are noted first (what a step cache left to
        compute: the auto policy's next measurement times it, ``Counts.refresh_period``)."""
        mark = self._mark
        if getattr(mark, "ran", None):
            mark.note(percall_calls.steps_of(mark))
            mark.forget_steps()
        reset = getattr(self._mark, "reset", None)
        if callable(reset):
            reset()
        reuse = getattr(self._mark, "reuse", None)
        if reuse is not None and hasattr(reuse, "pace"):
            reuse.pace(steps)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PatchHandle) and other._mark is self._mark

    def __hash__(self) -> int:
        return id(self._mark)
