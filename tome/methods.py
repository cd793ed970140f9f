"""The reduction methods: one class each, owning everything in which methods differ.

A method answers, for a ``ToMeConfig`` that names it:

- what it is to people: ``describe`` (console, infotext notes, preset text), the one number a
  user tunes (``value_field``, ``value_text``: the lab's labels) and the share of attention
  tokens it removes (``reduction``: the lab's plots);
- which settings matter: ``ignores`` (fields that cannot change its image: the infotext leaves
  them out), ``active`` (whether the settings change anything), ``problem`` (a setting it
  cannot run with);
- where it acts: ``sub_layers`` (the block's sub-layers that get hooks), ``refuse`` (blocks it
  must leave alone), ``plan`` (its half of plan building: the planner has chosen the level and
  grid), ``reduce`` / ``restore`` (what a sub-layer receives and what its output becomes; the
  same two calls serve the hook adapter and the ModelPatcher's attn1 patch);
- when it pays: ``thresholds`` (the auto policy's token counts per device kind).

Everything else (finding blocks, levels, partitions, hooks, hosts) is shared. A new method is a
subclass registered with ``register``; ``docs/development.md`` lists the other places it
touches.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from . import merge

# A ``config.ToMeConfig``. The config validates method names against this module's registry,
# so it imports this module, never the reverse.
ToMeConfig = Any


class Planner(Protocol):
    """What a method's half of plan building may use of ``plan.Planner`` (which calls it)."""

    config: ToMeConfig

    def partition(self, call: Any, h: int, w: int, device: torch.device, level: int
                  ) -> Any: ...

    def record(self, level: int, tokens: int, removed: int) -> None: ...


Call = Any  # ``plan.Call``: one UNet call; ``call.plans`` is shared by its blocks

# Fields only merging reads: the downsample method ignores them.
MERGE_FIELDS = ("ratio", "sx", "sy", "use_rand", "merge_attn", "merge_crossattn", "merge_mlp",
                "matching", "share")


class Method:
    """The interface, with the defaults of a method that merges self-attention only."""

    name = ""
    value_field = "ratio"
    ignores: tuple[str, ...] = ()
    unmerges = True            # ``restore`` must run on the sub-layer's output
    self_attention_only = False  # needs attn1 to attend to its own tokens (refuses otherwise)
    # The auto policy: smallest token count at a level from which the method is faster than
    # not merging, per device kind (``policy.KINDS``; measurements in ``policy.py`` and
    # ``docs/speed.md``). Merge and downsample measured the same break-even; a method that
    # pays earlier or later overrides this.
    thresholds: dict[str, int] = {"cpu": 4096, "cuda": 16384, "mps": 4096}
    # The method's form on a DiT (``dit.DitPool`` for downsample, set by ``dit.py``, which
    # builds on this module); None: the method has no DiT form (merge).
    dit_form: Method | None = None

    def describe(self, c: ToMeConfig) -> str:
        return f"{self.value_field} {self.value_text(c)}"

    def seeded(self, c: ToMeConfig) -> bool:
        """Whether ``c.seed`` changes this method's image (the console names the seed then)."""
        return False

    def value_text(self, c: ToMeConfig) -> str:
        return f"{getattr(c, self.value_field):g}"

    def reduction(self, c: ToMeConfig) -> float:
        return float(getattr(c, self.value_field))

    def active(self, c: ToMeConfig) -> bool:
        return getattr(c, self.value_field) > 0

    def problem(self, c: ToMeConfig) -> tuple[str, str] | None:
        """``(field, message)`` for settings this method cannot run with."""
        return None

    def sub_layers(self, c: ToMeConfig) -> tuple[str, ...]:
        return ("attn1",)

    def refuse(self, block: nn.Module, c: ToMeConfig) -> str | None:
        """Why this method must leave ``block`` alone, or None."""
        if self.self_attention_only and (getattr(block, "disable_self_attn", False)
                                         or getattr(block, "only_cross_attention", False)):
            return "attn1 is a cross-attention; downsampling its keys would drop the context"
        return None

    def plan(self, planner: Planner, call: Call, x: torch.Tensor, level: int, h: int,
             w: int, decoder: bool) -> Any:
        raise NotImplementedError

    def reduce(self, plan: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(queries, keys_values)`` a sub-layer gets for its input ``x``: the queries replace
        its hidden states; keys/values, when not None, replace its context."""
        raise NotImplementedError

    def restore(self, plan: Any, out: torch.Tensor) -> torch.Tensor:
        return out


class Merge(Method):
    """ToMe: similar tokens are averaged before a sub-layer and copied back after it."""

    name = "merge"
    # All but the first: DiTs only.
    ignores = ("downsample_factor", "rope", "blocks", "proportional", "schedule", "reuse")

    def active(self, c: ToMeConfig) -> bool:
        return c.ratio > 0 and (c.merge_attn or c.merge_crossattn or c.merge_mlp)

    def seeded(self, c: ToMeConfig) -> bool:
        return c.use_rand

    def problem(self, c: ToMeConfig) -> tuple[str, str] | None:
        if c.sx * c.sy < 2 and c.ratio > 0:
            return "sx", "stride 1x1 leaves no source tokens to merge; use sx*sy >= 2"
        return None

    def sub_layers(self, c: ToMeConfig) -> tuple[str, ...]:
        merged = {"attn1": c.merge_attn, "attn2": c.merge_crossattn, "ff": c.merge_mlp}
        return tuple(name for name, on in merged.items() if on)

    def refuse(self, block: nn.Module, c: ToMeConfig) -> str | None:
        if c.merge_mlp and getattr(block, "_chunk_size", None):
            return "feed-forward chunking is on; merging the MLP input would mix chunks"
        return None

    def plan(self, planner: Planner, call: Call, x: torch.Tensor, level: int, h: int,
             w: int, decoder: bool) -> merge.Plan | None:
        c = planner.config
        N = x.shape[1]
        r = int(N * c.ratio)
        if r <= 0 or h < c.sy or w < c.sx:  # no whole stride cell: nothing to merge into
            return None
        key = (level, decoder)  # a compiled graph's h and w are symbolic: never a dict key
        if c.share == "level":
            plan = call.plans.get(key)
            if plan is not None and plan.batch == x.shape[0]:
                return plan
        src_idx, dst_idx = planner.partition(call, h, w, x.device, level)
        plan = merge.Plan(x, src_idx, dst_idx, r, merge.matcher(c.matching, h, w, c.sx, c.sy))
        if c.share == "level":
            call.plans[key] = plan
        planner.record(level, N, plan.r)
        return plan

    def reduce(self, plan: merge.Plan, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return plan.merge(x), None

    def restore(self, plan: merge.Plan, out: torch.Tensor) -> torch.Tensor:
        return plan.unmerge(out)


class DownsamplePlan:
    """ToDo for one level: the keys and values of self-attention are pooled by ``factor``;
    queries keep every token, so there is nothing to undo."""

    __slots__ = ("h", "w", "factor", "mode")

    def __init__(self, h: int, w: int, factor: int, mode: str = "nearest"):
        self.h, self.w, self.factor, self.mode = h, w, factor, mode

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        return merge.downsample_tokens(x, self.h, self.w, self.factor, self.mode)


class Downsample(Method):
    """ToDo: self-attention's keys and values are pooled; queries keep every token."""

    name = "downsample"
    value_field = "downsample_factor"
    ignores = MERGE_FIELDS
    unmerges = False
    self_attention_only = True

    def describe(self, c: ToMeConfig) -> str:
        return f"downsample {self.value_text(c)}"

    def value_text(self, c: ToMeConfig) -> str:
        return f"x{c.downsample_factor}"

    def reduction(self, c: ToMeConfig) -> float:
        return 1.0 - 1.0 / c.downsample_factor ** 2

    def active(self, c: ToMeConfig) -> bool:
        return c.downsample_factor > 1

    def plan(self, planner: Planner, call: Call, x: torch.Tensor, level: int, h: int,
             w: int, decoder: bool) -> DownsamplePlan:
        plan = call.plans.get(level)
        if plan is None:
            f = planner.config.downsample_factor
            plan = call.plans[level] = DownsamplePlan(h, w, f)
            planner.record(level, x.shape[1], x.shape[1] - max(1, h // f) * max(1, w // f))
        return plan

    def reduce(self, plan: DownsamplePlan, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, plan.kv(x)


#: The only registry of methods: name -> method. ``config`` validates names against it, the
#: accordion, API, X/Y/Z, infotext, Measure now and the lab list it.
REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Make ``method`` available under ``method.name`` everywhere: configs accept the name, the
    patch, the ModelPatcher adapter, the policy, the infotext and the lab use the object."""
    REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Forget a method registered with ``register`` (tests of a toy method undo themselves)."""
    REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered methods' names, built-in ones first."""
    return tuple(REGISTRY)


def get(name: str) -> Method:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"ToMe: unknown method {name!r}; known: {sorted(REGISTRY)}") from None


register(Merge())
register(Downsample())
