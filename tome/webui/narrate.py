"""The one voice of the WebUI layer: every console line and infotext note, written here once.

A generation prints one summary line (what is merged, where, with which seed), at most one
line per note after it (the auto policy's choice per pass, skipped blocks, library notes), and
writes the same notes into the infotext. ``Voice`` remembers what it said in a generation, so
hosts that re-apply the patch per pass or per step never repeat themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import console as _console
from .. import methods, policy
from ..config import ToMeConfig
from ..report import ATTN1_PATCH, PatchReport
from . import infotext

PASS_LABELS = infotext.PASS_LABELS

_said_builtin = False


def console(line: str) -> None:
    """One console line: through the host's logger where it has one (SD.Next's ``shared.log``,
    so the line is in its log file and log panel), else printed on a line of its own
    (``tome.console.line``: never glued to the sampler's progress bar)."""
    log = _host_log()
    if log is not None:
        log.info(line)
    else:
        _console.line(line)


def _host_log() -> Any:
    try:
        from modules import shared
    except ImportError:
        return None
    log = getattr(shared, "log", None)
    return log if callable(getattr(log, "info", None)) else None


def head(kind: str, report: PatchReport) -> str:
    """Who is merged how: ``SD1 (ldm)`` for the hooks, ``Forge UNet (attn1 patch),`` for the
    Forge family's patcher."""
    if report.adapter == ATTN1_PATCH:
        return "Forge UNet (attn1 patch),"
    kind = report.facts.noun(kind) if report.facts is not None else kind
    return f"{kind + ' ' if kind else ''}({report.family})"


def what(cfg: ToMeConfig | None, runs: Any = None) -> str:
    """``ratio 0.5``, ``downsample x2`` or ``off``; on a DiT what its schedule and reuse run
    (``runs``: ``Dit.runs``, e.g. ``x8 in all blocks; residual reuse every 5 steps``)."""
    if cfg is None:
        return "off"
    return (runs(cfg) if runs is not None else None) or methods.get(cfg.method).describe(cfg)


def passes_text(passes: dict[str, ToMeConfig | None], runs: Any = None) -> str:
    """``first pass off, hires pass ratio 0.6``."""
    return ", ".join(f"{PASS_LABELS[name]} {what(cfg, runs)}" for name, cfg in passes.items())


def skipped_text(skipped: list[tuple[Any, str]]) -> str:
    return f"{len(skipped)} block(s) skipped: {skipped[0][1]}"


def stopped(error: Exception) -> None:
    """An invalid setting stops the generation: the console's only line about it."""
    console(f"{error}; the generation is stopped")


def hires_only_without_hires() -> None:
    console("ToMe: 'Only in hires fix' is on but hires fix is off: nothing is merged")


def builtin_off(was_on: dict[str, Any]) -> None:
    """Once per process: the WebUI's own token merging is off while ToMe is on."""
    global _said_builtin
    if was_on and not _said_builtin:
        _said_builtin = True
        was = ", ".join(f"{k}={v}" for k, v in was_on.items())
        console(f"ToMe: the WebUI's built-in token merging ({was}) is off while ToMe is enabled, "
              "so the model is never merged twice")


@dataclass
class Voice:
    """What one generation has said so far."""

    announced: bool = False            # the one summary line was printed
    skipped: str | None = None         # why the model is not merged at all
    said: set[str] = field(default_factory=set)         # notes printed once per generation
    auto: dict[str, str] = field(default_factory=dict)  # pass -> what the auto policy chose
    merged: dict[str, list[int]] = field(default_factory=dict)  # pass -> levels it merged

    def say(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            console(line)

    def summary(self, head: str, passes: dict[str, ToMeConfig | None], coverage: str,
                skipped: list[tuple[Any, str]] = (), seed: int | None = None,
                runs: Any = None) -> None:
        """The one console line per generation that shows ToMe is working, e.g.
        ``ToMe: SD1 (ldm) first pass ratio 0.5; 5/16 blocks patched at downsample <= 1
        (ds1: 5); seed 3``."""
        if self.announced:
            return
        self.announced = True
        line = f"ToMe: {head} {passes_text(passes, runs)}; {coverage}"
        if skipped:
            self.said.add("skipped")
            line += f"; {skipped_text(skipped)}"
        if seed is not None:
            line += f"; seed {seed}"
        console(line)

    def auto_choice(self, p: Any, name: str, cfg: ToMeConfig, latent: tuple[int, ...],
                    decisions: list[policy.Decision]) -> None:
        """Once per pass: what the auto policy decided and why (console and infotext), and
        which levels it merged (infotext: pasting reproduces the image on any machine). The
        planner tells its ``decisions`` as soon as it knows them (``Planner.on_decided``)."""
        if cfg.policy != "auto" or name in self.auto:
            return
        self.auto[name] = f"{PASS_LABELS[name]} {policy.summary(decisions, latent)}"
        self.merged[name] = [d.level for d in decisions if d.merged]
        console(f"ToMe auto: {self.auto[name]}")
        params = p.extra_generation_params
        params[infotext.AUTO] = " | ".join(self.auto.values())
        params[infotext.MERGED] = infotext.merged_text(self.merged)

    def window_steps(self, p: Any, windows: dict[str, Any]) -> None:
        """After sampling, per pass with a start/end window (``plan.Window``): which steps it
        merged, on the console (``first pass steps 0-0.5: merged in 2 of 4 steps``, once) and
        in the infotext note (``first pass 2 of 4``), so a window that merged nothing shows."""
        counted = {name: w for name, w in windows.items() if w.steps}
        if not counted:
            return
        for name, w in counted.items():
            self.say(f"ToMe: {PASS_LABELS[name]} {w.describe()}")
        p.extra_generation_params[infotext.STEPS] = " | ".join(
            f"{PASS_LABELS[name]} {w.merged} of {w.steps}" for name, w in counted.items())

    def tally(self, name: str, line: str | None) -> None:
        """After a pass on the per-call path (Forge Neo's swap): ComfyUI's line after each
        sampling (``ToMe: pooled 16 of 16 attention calls``, or why none was), the pass named:
        ``ToMe: first pass pooled 16 of 16 attention calls``; once per generation."""
        if line:
            self.say(f"ToMe: {PASS_LABELS[name]} {line.removeprefix('ToMe: ')}")

    def dit_resolved(self, p: Any, name: str, text: str) -> None:
        """Per DiT pass: what its settings resolved to (console once, infotext note)."""
        line = f"{PASS_LABELS[name]} {text}"
        self.say(f"ToMe DiT: {line}")
        old = p.extra_generation_params.get(infotext.RESOLVED)
        if not old or line not in str(old).split(" | "):
            p.extra_generation_params[infotext.RESOLVED] = f"{old} | {line}" if old else line

    def skipped_blocks(self, p: Any, skipped: list[tuple[Any, str]]) -> None:
        """Blocks another extension has taken over are left alone: one infotext note, and one
        console line unless the summary line already said it."""
        if not skipped:
            return
        p.extra_generation_params[infotext.SKIPPED] = f"{len(skipped)} block(s): {skipped[0][1]}"
        if self.announced and "skipped" not in self.said:
            self.said.add("skipped")
            console(f"ToMe: {skipped_text(skipped)}; the other blocks are merged")

    def skip_model(self, p: Any, reason: str) -> None:
        """The model is not merged at all: one console line, one infotext note. While nothing
        was merged in this generation the infotext claims no ToMe setting either (pasting it
        back must not turn on a merge the image never had)."""
        if self.skipped is None:
            self.skipped = reason
            console(f"ToMe: skipped, the image is generated without merging: {reason}")
        params = p.extra_generation_params
        if not self.announced:
            params = {k: v for k, v in params.items() if k not in infotext.SETTINGS_KEYS}
        p.extra_generation_params = {**params, infotext.SKIPPED: reason}
