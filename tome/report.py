"""What a patch did: the one report every adapter returns.

Every adapter (hooks, processors, the ModelPatcher's attn1 forms; ``adapters.py`` chooses)
answers with a ``PatchReport`` built by ``PatchReport.of`` from the model's layout, so a host
handles them alike: the family and kind, the levels and blocks that may merge, the blocks left
alone and why, the planner (its live decisions and token figures), and why nothing is merged
at all as data (``nothing``), never as an exception on one path and a warning on another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import console, methods
from .config import ToMeConfig

# How a patch reaches the blocks: hooks (UNets), the attn1 patch (ModelPatcher), attention
# processors (diffusers DiTs).
HOOKS, ATTN1_PATCH, PROCESSORS = "hooks", "attn1 patch", "processors"

# Where a patch on plain modules (hooks or processors) keeps its state: one attribute, so a
# model carries one patch of ours at a time (tomesd uses ``_tome_info`` and ``ToMeBlock``).
STATE_ATTR = "_tome_sd_state"

TOMESD_REPLACED = ("ToMe: the model was patched by tomesd (e.g. the WebUI's built-in token "
                   "merging); that patch was removed so tokens are never merged twice")


@dataclass
class PatchReport:
    """What a patch did: a short, printable account for users, hosts and tests."""

    family: str
    config: ToMeConfig
    max_downsample: int
    levels: dict[int, int] = field(default_factory=dict)   # downsample -> blocks patched
    total_blocks: int = 0
    # (block, reason): blocks left alone. The ModelPatcher adapter learns them while sampling.
    skipped: list[tuple[Any, str]] = field(default_factory=list)
    replaced_tomesd: bool = False
    adapter: str = HOOKS
    planner: Any = field(default=None, repr=False)  # ``plan.Planner``: decisions, tokens
    unmergeable: str | None = None  # why the settings merge no level of this model
    kind: str = "UNet"  # or "DiT": its blocks' image keys/values are pooled
    rope: bool = False  # a DiT with rotary positions (the ``rope`` option applies)
    # What the model is to the library (``Layout.facts``): its words for the blocks covered.
    facts: Any = field(default=None, repr=False, compare=False)
    # What residual reuse keeps, once a generation has decided it (``budget.ReuseBudget``):
    # ``reuse keeps 3.0 GiB (residual + slope)``, ``reuse off (not enough memory)``.
    memory: str | None = None

    @classmethod
    def of(cls, layout: Any, config: ToMeConfig, adapter: str, **more: Any) -> PatchReport:
        """The report of patching ``layout``'s model with ``config`` through ``adapter``: the
        family, kind ("UNet" or "DiT"), block count and RoPE come from the layout, and why
        nothing would be merged (settings that change nothing, a level the model lacks, a
        method without a DiT form) is set before anything is patched."""
        report = cls(family=layout.family, config=config, adapter=adapter,
                     total_blocks=len(layout.blocks), kind=layout.kind,
                     rope=bool(getattr(layout.dit, "rope", False)), facts=layout.facts,
                     max_downsample=more.pop("max_downsample", 0), **more)
        report.unmergeable = ("ToMe: these settings change nothing" if not config.active
                              else layout.unmergeable(config))
        return report

    @property
    def patched_blocks(self) -> int:
        return sum(self.levels.values())

    @property
    def tokens(self) -> dict[int, tuple[int, int]]:
        """Filled while running: downsample -> (tokens, tokens removed) of the latest call."""
        return self.planner.tokens if self.planner is not None else {}

    @property
    def decisions(self) -> dict[tuple, Any]:
        """Filled while running: the auto policy's decisions."""
        return self.planner.decisions if self.planner is not None else {}

    @property
    def nothing(self) -> str | None:
        """Why this patch merges nothing at all (the model is then left as it was), or None."""
        if self.unmergeable:
            return self.unmergeable
        if self.patched_blocks:
            return None
        if self.skipped:
            return f"ToMe: every block skipped: {self.skipped[0][1]}"
        return "ToMe: no transformer block at the levels to merge"

    def notes(self) -> list[str]:
        """What the patch changed besides merging, one line each."""
        return [TOMESD_REPLACED] if self.replaced_tomesd else []

    def coverage(self) -> str:
        """Hooks: ``5/16 blocks patched at downsample <= 1 (ds1: 5)``; the attn1 patch:
        ``ratio 0.5 at downsample <= 1``; a DiT, in its own words (``Layout.facts``): ``2/4
        blocks pooled (blocks all, rope pooled)``; plus the step window (``steps 0-0.5``, and
        on a ModelPatcher host the sigmas that bounds)."""
        c = self.config
        text = self.facts.coverage(self) if self.facts is not None else None
        if text is None and self.adapter != HOOKS:
            text = f"{methods.get(c.method).describe(c)} at downsample <= {self.max_downsample}"
        elif text is None:
            levels = ", ".join(f"ds{d}: {n}" for d, n in sorted(self.levels.items())) or "none"
            text = (f"{self.patched_blocks}/{self.total_blocks} blocks patched at downsample <= "
                    f"{self.max_downsample} ({levels})")
        window = self.planner.window if self.planner is not None else None
        if c.start > 0 or c.end < 1:
            text += f", steps {c.start:g}-{c.end:g}"
            if window is not None and window.sigma_text():
                text += f" ({window.sigma_text()})"
        return text

    def steps(self) -> str | None:
        """``steps 0-0.5: merged in 2 of 4 steps`` once a pass has run with a start/end window;
        None without a window or before any step."""
        window = self.planner.window if self.planner is not None else None
        if window is None or window.full or not window.steps:
            return None
        return window.describe()

    def summary(self) -> str:
        """``ToMe: diffusers flux DiT, x8 in all blocks; residual reuse every 5 steps; 6/6
        blocks pooled (...)``: what runs (on a DiT its schedule's factor per block and reuse,
        ``Dit.runs``), then where."""
        runs = getattr(self.facts, "runs", None)
        what = runs(self.config) if runs is not None else None
        text = (f"ToMe: {self.family} {self.kind}, "
                f"{what or methods.get(self.config.method).describe(self.config)}"
                f"; {self.coverage()}")
        if self.memory:
            text += f"; {self.memory}"
        if self.skipped:
            text += f"; {len(self.skipped)} skipped ({self.skipped[0][1]})"
        return text


class Unread:
    """A family's reading of a model call while sampling (its ``spans``), guarded as
    ``recognise`` and ``read`` are when the graph is built: one that raises passes the call
    through unpooled (None) with one console line per patch, instead of failing the prompt
    (the per-call shims: ComfyUI's ``apply_model`` wrapper, Forge Neo's swap)."""

    def __init__(self, family: str, say: Any = console.line):
        self.family, self.say, self.told = family, say, False

    def __call__(self, read: Any, *args: Any) -> Any:
        try:
            return read(*args)
        except Exception as e:  # noqa: BLE001 (the family's mistake: this call runs unpooled)
            if not self.told:
                self.told = True
                why = f"{type(e).__name__}: {e}"
                self.say(f"ToMe: {self.family} could not place a model call's tokens "
                         f"({why if len(why) <= 200 else why[:197] + '...'}); the calls it "
                         "cannot place run unpooled")
            return None
