"""What a DiT family file fills in: its facts (``Dit``) and its record (``Family``).

Kept apart from the registry (``tome/dits/__init__.py``) so that the registry can load the
built-in family files, which import these two types, without an import circle.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from .. import dit


def reuse_words(config: Any) -> str:
    """``residual reuse every 5 steps``; ``... (paced to the step count)``
    (``ToMeConfig.paced``: that period at 20 steps; no comma: an infotext value)."""
    paced = " (paced to the step count)" if getattr(config, "paced", False) else ""
    return f"residual reuse every {config.reuse} steps{paced}"


@dataclass(frozen=True)
class Dit:
    """What a DiT adds to its blocks: where its image tokens are and how its calls look."""

    patch: int              # latent pixels per token side: the DiT's one level
    text_first: bool        # the joint sequence is [text, image] (Flux) or [image, text] (SD3)
    text_tokens: int        # the text length its pipelines use (what measuring feeds it)
    timestep_scale: float   # its timestep times this is on the 0..1000 training scale
    rope: bool              # rotary positions inside attention (Flux) or none (SD3)

    kind = "DiT"  # what the report and the console call the model (not a field)
    ignores = ()  # config fields this kind of model does not read (a UNet: the DiT fields)
    # A host's model flags that name a DiT themselves (SD.Next flags every pipeline SD1).
    named_flags = ("SD3",)
    # The host names each attention call's block (ComfyUI's ``block_index``): per-block
    # factors and residual reuse (kept per block) apply; else ``UnnamedDit``.
    names_blocks = True

    def noun(self, flag: str) -> str:
        """What the console calls the model, given the host's flag for it: ``SD3 DiT``,
        else ``DiT`` (a host's UNet flag on a DiT pipeline is wrong)."""
        return f"{flag} DiT" if flag in self.named_flags else "DiT"

    def describe(self, config: Any) -> str:
        """What ``config`` does here, for the infotext and the console:
        ``x8 in all blocks; residual reuse every 5 steps; proportional attention; rope
        pooled`` (pass the config the patch report holds: a host path may have resolved it)."""
        if config.method != "downsample":
            return f"{config.method}: no DiT form, not pooled"
        parts = [dit.schedule_of(config).describe()]
        if config.reuse:
            parts.append(reuse_words(config))
        parts.append("proportional attention" if config.proportional else "plain pooling")
        return "; ".join(parts) + (f"; rope {config.rope}" if self.rope else "")

    def runs(self, config: Any) -> str | None:
        """What the report's summary says runs where a schedule or reuse is set: ``x8 in all
        blocks; residual reuse every 5 steps``; None: the method's own words
        (``downsample x2``)."""
        if config.method != "downsample" or not (config.schedule or config.reuse):
            return None
        parts = [dit.schedule_of(config).describe() if config.schedule
                 else f"downsample x{config.downsample_factor}"]
        if config.reuse:
            parts.append(reuse_words(config))
        return "; ".join(parts)

    def method(self, config: Any) -> Any:
        """The method ``config`` runs here: its DiT form (None: it has none)."""
        return dit.method_for(config)

    def unmergeable(self, layout: Any, config: Any) -> str | None:
        """Why ``config`` pools nothing here: a method without a DiT form, or a ``blocks`` or
        ``schedule`` setting that names none of this DiT's blocks (every adapter then installs
        nothing, as for other settings that change nothing)."""
        if dit.method_for(config) is None:
            return dit.no_form(config, layout.family)
        schedule, n = dit.schedule_of(config), len(layout.blocks)
        if any(schedule.factor(i, b.kind, n, None) for i, b in enumerate(layout.blocks)):
            return None
        named = f"schedule={config.schedule!r}" if config.schedule else \
            f"blocks={config.blocks!r}"
        has = f"blocks 0-{n - 1}, double-stream first" if n else "no blocks"
        return f"ToMe: {named} names no block of this DiT (it has {has}); nothing is pooled"

    def timed(self, layout: Any, config: Any, levels: Iterable[int] | None
              ) -> dict[int, list[list[nn.Module]]]:
        """What measuring times: the one level (the patch size), one group per block kind the
        schedule (or ``blocks``) pools (double- and single-stream blocks cost differently);
        ``levels`` does not apply."""
        method, schedule, n = dit.method_for(config), dit.schedule_of(config), len(layout.blocks)
        kinds: dict[str, list[nn.Module]] = {}
        for i, b in enumerate(layout.blocks):
            if method is not None and schedule.factor(i, b.kind, n, None):
                kinds.setdefault(b.kind, []).append(b.module)
        return {self.patch: list(kinds.values())} if kinds else {}

    def sub_layers(self, config: Any) -> tuple[str, ...]:
        """What a timed block must have: nothing beyond what the adapter already chose."""
        return ()

    def coverage(self, report: Any) -> str:
        """``2/4 blocks pooled (blocks all, rope pooled)``, whatever the adapter; a schedule
        names its blocks itself (``runs``), so then only the rope: ``(rope before)``."""
        c = report.config
        said = ([] if c.schedule.strip() else [f"blocks {c.blocks}"]) \
            + ([f"rope {c.rope}"] if report.rope else [])
        return f"{report.patched_blocks}/{report.total_blocks} blocks pooled" \
            + (f" ({', '.join(said)})" if said else "")


@dataclass(frozen=True)
class UnnamedDit(Dit):
    """A DiT whose host does not name the block of an attention call (ComfyUI's SD3,
    AuraFlow, HiDream, Mochi, OmniGen2): its blocks share one factor and residual reuse,
    kept per block, cannot apply (``percall.Core`` runs a preset's point without it). Its
    family reads its blocks as one kind, so that the point shares one factor too. Settings
    that give its blocks different factors pool nothing (no call says which block it is):
    one line, nothing installed."""

    names_blocks = False

    def unmergeable(self, layout: Any, config: Any) -> str | None:
        why = super().unmergeable(layout, config)
        schedule, n = dit.schedule_of(config), len(layout.blocks)
        if why is None and len({schedule.factor(i, b.kind, n, None)
                                for i, b in enumerate(layout.blocks)}) > 1:
            named = f"schedule={config.schedule!r}" if config.schedule else \
                f"blocks={config.blocks!r}"
            return (f"ToMe: {named} gives this DiT's blocks different factors, but its "
                    "attention calls do not name their block; nothing is pooled (set one "
                    "factor for all blocks)")
        return why


class Call(NamedTuple):
    """One transformer call as the processors adapter needs it."""

    x: torch.Tensor           # the latent or image tokens (device, batch)
    size: tuple[int, int]     # the latent's (height, width) in latent pixels
    text: int                 # text tokens in the call (where the image starts in single blocks)
    t: Any                    # the timestep as the model got it (``Dit.timestep_scale`` applies)


# ``read(model) -> (facts, double-stream blocks, single-stream blocks)``
Reader = Callable[[nn.Module], tuple[Dit, Iterable[nn.Module], Iterable[nn.Module]]]
# ``maths(wrapper, attn, plan, hidden_states, encoder_hidden_states, image_rotary_emb)``:
# the library processor's attention with the image keys/values pooled by ``plan``
# (``wrapper``: the ``processors.PoolingProcessor`` calling it: ``.original``, ``.source``);
# ``NotImplemented``: not a call the maths are for, the original runs it.
Maths = Callable[..., Any]


def pooled_attentions(block: nn.Module) -> list[nn.Module]:
    """diffusers' DiT blocks: ``attn``, and SD3.5's image-only ``attn2``."""
    return [a for a in (getattr(block, "attn", None), getattr(block, "attn2", None))
            if isinstance(a, nn.Module)]


# the hosts whose own patch points a family names (InvokeAI: Forge Neo's swap, its own bracket)
COMFYUI, FORGE_NEO, INVOKEAI = "comfyui", "forge neo", "invokeai"


@dataclass(frozen=True)
class HostPoint:
    """Where a host's own patch point meets the family's attention (``Family.host``).

    ComfyUI (``override.py``): every attention call passes through its override; the family
    says how a model call places its tokens, ``spans(model, x, context, conds)``. Forge Neo
    (``swap.py``): no hook, so the family names the module globals its blocks call attention
    by (``points``: ``(module, global, sequence axis, pre-RoPE embedding (position, keyword),
    mask (position, keyword))``, positions counting the arguments after q, k, v) and
    ``spans(model, x, c)``. Either ``spans`` gives ``kv.Spans``' fields, ``(text,
    text_first, before, frames, h, w, after)``, or None: that call is not pooled."""

    host: str                                    # COMFYUI, FORGE_NEO or INVOKEAI
    spans: Callable[..., tuple | None]
    points: tuple = ()


@dataclass(frozen=True)
class Family:
    """One DiT family: how to recognise and read it, and either how an adapter on plain
    modules (``processors.py``) finds its calls, pools its attention and measures a block, or
    (``host``) where a host's own patch point reaches it (ComfyUI's override, Forge Neo's
    attention globals). A family reached only through a host's point leaves the
    plain-module fields at their defaults: its blocks then stay unpooled on plain modules."""

    name: str                                  # display name: ``Layout.family``, reports
    recognise: Callable[[nn.Module], bool]     # this module is the family's denoiser
    read: Reader                               # its facts and blocks
    # ``call(facts, args, kwargs, memo) -> Call | None``: the transformer's forward arguments
    # read (``memo``: a dict kept per patch, e.g. a grid per ids tensor); None: not pooled.
    call: Callable[[Dit, tuple, dict, dict], Call | None] | None = None
    # diffusers processor class name -> its maths with pooled keys/values; any other
    # processor (another library's, e.g. IP-Adapter's) leaves its block unpooled.
    maths: Mapping[str, Maths] = field(default_factory=dict)
    attentions: Callable[[nn.Module], list[nn.Module]] = pooled_attentions
    # Why an attention module's maths do not apply here, or None (e.g. a library too old).
    check: Callable[[nn.Module], str | None] | None = None
    # Families without processors: ``shadow(block, source, index, kind)`` puts the pooled
    # path on the block's instance and returns ``[(module, attribute, before, ours)]``.
    shadow: Callable[..., list[tuple[nn.Module, str, Any, Any]]] | None = None
    # ``inputs(layout, x, size) -> (args, kwargs)``: one block's call on image tokens ``x``
    # for measuring (a latent of ``size``), drawn from a private generator.
    inputs: Callable[[Any, torch.Tensor, tuple[int, ...]], tuple[tuple, dict]] | None = None
    # The module named as the block's attention where it is not ``attn1``/``attn`` (measuring
    # names its kernel; the fingerprint reads its heads).
    attention: Callable[[nn.Module], nn.Module | None] | None = None
    # A host's own patch point: a family of ComfyUI's or Forge Neo's models (``HostPoint``).
    host: HostPoint | None = None
    # Its latents are videos (frames x h x w): ``recommended`` pools pairs of frames there
    # (ComfyUI's node); an image model sharing the family (one frame) is unchanged by it.
    video: bool = False


# ----------------------------------------------------------------------------- helpers

def by_class(*names: str) -> Callable[[nn.Module], bool]:
    """``recognise`` for a family known by its class name (any base class counts)."""
    return lambda module: any(cls.__name__ in names for cls in type(module).__mro__)


def comfy_class(*names: str) -> Callable[[nn.Module], bool]:
    """``recognise`` for a ComfyUI diffusion model known by its class name (any base class
    counts) from ``comfy.ldm``, never ComfyUI's model base of the same name
    (``comfy.model_base``, which holds it)."""
    return lambda module: any(c.__name__ in names and c.__module__.startswith("comfy.ldm.")
                              for c in type(module).__mro__)


def arg(args: tuple, kwargs: dict, name: str, pos: int) -> Any:
    """A forward argument given by position or by name."""
    return args[pos] if len(args) > pos else kwargs.get(name)


def text_length(text: Any) -> int:
    return text.shape[1] if isinstance(text, torch.Tensor) and text.dim() == 3 else 0


def latent_call(x: tuple[str, int], text: tuple[str, int], t: tuple[str, int]):
    """``call`` for a DiT called with the latent itself (``[B, C, H, W]``) and the text and
    timestep at these (name, position)s."""
    def call(facts: Dit, args: tuple, kwargs: dict, memo: dict) -> Call | None:
        lat = arg(args, kwargs, *x)
        if not isinstance(lat, torch.Tensor) or lat.dim() != 4:
            return None
        return Call(lat, tuple(lat.shape[-2:]), text_length(arg(args, kwargs, *text)),
                    arg(args, kwargs, *t))
    return call


def text_and_time(x: torch.Tensor, text_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Measuring inputs beside image tokens ``x`` ([B, N, C]): a text of ``text_tokens`` and
    a time embedding, from a generator seeded by ``N``."""
    b, n, c = x.shape
    g = torch.Generator().manual_seed(n)
    text = torch.randn(b, text_tokens, c, generator=g).to(x.device, x.dtype)
    return text, torch.randn(b, c, generator=g).to(x.device, x.dtype)


def grid_of(size: tuple[int, ...], patch: int) -> tuple[int, int]:
    """The token grid (rows, columns) of a latent of ``size`` (its last two sides)."""
    h, w = (math.ceil(s / patch) for s in size[-2:])
    return h, w
