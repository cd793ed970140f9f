"""Reading a model: one ``Layout`` value says what the planner, the adapters and the
measurement need to know of a model, and a reader per family produces it.

A ``Layout`` lists the model's transformer blocks, each with its level (its tokens form the
latent grid downsampled by that factor), its side (encoder or decoder) and its name, plus the
keyword its sub-layers take the context by, the family's name and, for a DiT, its facts
(``dits.Dit``: patch size, where the text sits, RoPE). The UNet readers are here:

- ``read_ldm``: a UNet with ``input_blocks`` / ``middle_block`` / ``output_blocks``: ldm
  (SD1/SD2), sgm (SDXL), and the UNet behind a ModelPatcher (the Forge family's and ComfyUI's
  own copies of that code);
- ``read_diffusers``: a UNet with ``down_blocks`` / ``mid_block`` / ``up_blocks``;

and the DiT readers are the families' (``tome/dits/``, one file each), found through their
registry (``dits.find``). What differs between a UNet and a DiT for the rest of the library
(the method a config runs, why it merges nothing, what measuring times, a report's coverage)
is asked of ``Layout.facts``: ``Unet`` here, ``dits.Dit`` there.

``read(model)`` finds the denoiser in whatever it is given (an ldm/sgm model, a diffusers
pipeline, a bare UNet or DiT, a ModelPatcher's ``diffusion_model``), picks the reader, and owns
the one "not supported" message. Structure only: nothing here changes a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

from . import dits, methods
from .config import DIT_FIELDS
from .dits import Dit

BLOCK_CLASS = "BasicTransformerBlock"
# The denoiser inside a model: diffusers pipelines (``unet``, ``transformer``), ldm/sgm models
# and the ModelPatcher's model (``model.diffusion_model``, ``diffusion_model``).
_DENOISERS = ("unet", "transformer", "model.diffusion_model", "diffusion_model")


class UnsupportedModelError(TypeError):
    """The object is not a model this library can patch."""


def not_supported(name: str, found: bool = True, why: str = "") -> UnsupportedModelError:
    """The one message for a model ToMe cannot merge; ``found``: a denoiser was found in it
    (else what was expected is said too); ``why``: what went wrong reading it. The DiTs it
    names are the registered families."""
    text = (f"ToMe: {name} has no UNet transformer blocks to merge and is not a DiT it can "
            "pool (ToMe merges SD1, SD2 and SDXL UNets and pools image keys/values in the DiTs "
            f"it reads: {dits_read()}; not other DiTs, nor compiled or replaced models)")
    if why:
        text += f"; {why}"
    if not found:
        text += ("; expected an ldm/sgm model (.model.diffusion_model), a diffusers pipeline "
                 "(.unet, .transformer) or the UNet or transformer itself")
    return UnsupportedModelError(text)


def dits_read() -> str:
    """The registered DiT families, by the host their names start with: ``diffusers flux and
    sd3; a1111 sd3; comfy flux and qwen-image``."""
    hosts: dict[str, list[str]] = {}
    for f in dits.families():
        host, _, model = f.name.rpartition(" ")
        hosts.setdefault(host, []).append(model)

    def listed(models: list[str]) -> str:
        return models[0] if len(models) == 1 else f"{', '.join(models[:-1])} and {models[-1]}"
    return "; ".join(f"{host} {listed(models)}".strip() for host, models in hosts.items())


@dataclass(frozen=True)
class Block:
    """One transformer block as the planner sees it."""

    name: str            # its name in the UNet (``input_blocks.1.1.transformer_blocks.0``)
    module: nn.Module
    level: int           # downsample of the latent grid its tokens form (0: not known)
    decoder: bool        # on the upsampling side (it gets its own plans)
    kind: str = "unet"   # DiTs: "double" (double-stream / joint) or "single" (single-stream)


class Unet:
    """What a UNet is to the rest of the library (``Layout.facts``; a DiT's is ``dits.Dit``):
    the config's method, merging levels up to ``max_downsample``, one timed block per level."""

    kind = "UNet"  # what the report and the console call the model
    ignores = DIT_FIELDS  # config fields a UNet does not read

    def noun(self, flag: str) -> str:
        """What the console calls the model: the host's flag for it (``SDXL``)."""
        return flag

    def describe(self, config: Any) -> None:
        """None: a UNet's settings are their own description (a DiT's resolve per preset)."""
        return None

    def method(self, config: Any) -> methods.Method:
        return methods.get(config.method)

    def unmergeable(self, layout: Layout, config: Any) -> str | None:
        return layout.nothing_to_merge(config.max_downsample)

    def timed(self, layout: Layout, config: Any, levels: Iterable[int] | None
              ) -> dict[int, list[list[nn.Module]]]:
        by_level, chosen = layout.levels_to_measure(config, levels)
        return {lv: [by_level[lv]] for lv in chosen}

    def sub_layers(self, config: Any) -> tuple[str, ...]:
        return methods.get(config.method).sub_layers(config)

    def coverage(self, report: Any) -> str | None:
        """None: a UNet's coverage is in its adapter's words (``PatchReport.coverage``)."""
        return None


UNET = Unet()


@dataclass(frozen=True)
class Layout:
    """What a model is made of, for the planner, the adapters and the measurement."""

    family: str                  # "ldm", "sgm", "diffusers", or a DiT family's name
    root: nn.Module              # the UNet: where a patch keeps its state
    blocks: tuple[Block, ...]    # in the UNet's order: encoder, middle, decoder
    context_keyword: str         # the sub-layers' keyword for the context
    dit: Dit | None = None       # set for DiTs: their blocks are pooled, not merged

    @property
    def facts(self) -> Unet | Dit:
        """What this kind of model is to the library (``Unet`` or the DiT's ``dits.Dit``)."""
        return self.dit or UNET

    @property
    def kind(self) -> str:
        """``"UNet"`` or ``"DiT"``: what the report and the console call the model."""
        return self.facts.kind

    @property
    def levels(self) -> list[int]:
        """The levels that have transformer blocks, highest resolution first."""
        return sorted({b.level for b in self.blocks if b.level > 0})

    def at(self, level: int) -> list[Block]:
        return [b for b in self.blocks if b.level == level]

    def auto_level(self, max_downsample: int | None) -> int:
        return auto_level(max_downsample, self.levels)

    def unmergeable(self, config: Any) -> str | None:
        """Why ``config`` merges nothing on this model, or None: a method with no DiT form on
        a DiT, an explicit ``max_downsample`` above every UNet level."""
        return self.facts.unmergeable(self, config)

    def timed(self, config: Any, levels: Iterable[int] | None = None
              ) -> dict[int, list[list[nn.Module]]]:
        """What measuring ``config`` times: per level, the groups of blocks that share one
        shape (one block stands for each group); ``levels``: the UNet levels asked for."""
        return self.facts.timed(self, config, levels)

    def levels_to_measure(self, config: Any, levels: Iterable[int] | None
                          ) -> tuple[dict[int, list[nn.Module]], list[int]]:
        """The blocks of each level, in the UNet's order, and the levels to measure:
        ``levels``, or those with blocks up to the config's max downsample (auto: the first
        with blocks)."""
        by_level = {lv: [b.module for b in self.at(lv)] for lv in self.levels}
        if levels is None:
            max_ds = self.auto_level(config.max_downsample)
            return by_level, [lv for lv in self.levels if lv <= max_ds]
        chosen = sorted(set(levels))
        missing = [lv for lv in chosen if lv not in by_level]
        if missing:
            raise ValueError(f"ToMe: no transformer blocks at level(s) {missing}; this UNet "
                             f"has them at {sorted(by_level)}")
        return by_level, chosen

    def nothing_to_merge(self, max_downsample: int | None) -> str | None:
        """Why an explicit ``max_downsample`` merges no block of this model, or None."""
        levels = self.levels
        if max_downsample is None or not levels or any(d <= max_downsample for d in levels):
            return None
        return (f"ToMe: max_downsample={max_downsample} merges nothing on this model (its "
                f"transformer blocks are at downsample {levels}); use max_downsample=None "
                f"(auto) or >= {levels[0]}")


# ----------------------------------------------------------------------------- blocks

def is_block(module: nn.Module) -> bool:
    """A transformer block (ldm, sgm, Forge and diffusers all name it ``BasicTransformerBlock``)."""
    return any(cls.__name__ == BLOCK_CLASS for cls in type(module).__mro__)


def family(module: nn.Module) -> str:
    """``ldm``, ``sgm``, ``diffusers`` or the top-level package a module's class comes from."""
    root = type(module).__module__.split(".")[0]
    return root if root in ("ldm", "sgm", "diffusers") else root or "unknown"


def context_keyword(block: nn.Module) -> str:
    """The sub-layers' keyword for the context (and ToDo's keys/values): ldm/sgm ``context``,
    diffusers ``encoder_hidden_states``."""
    return "context" if family(block) in ("ldm", "sgm") else "encoder_hidden_states"


def attention(block: nn.Module) -> nn.Module:
    """The block's self-attention: ``attn1`` in UNet blocks, ``attn`` in DiT blocks, or where
    a DiT family names it (``dits.attention``: the image block's in A1111's MMDiT)."""
    found = getattr(block, "attn1", None) or getattr(block, "attn", None) \
        or dits.attention(block)
    if found is None:  # e.g. ComfyUI's Flux blocks (img_attn, txt_attn): not timed this way
        raise UnsupportedModelError(f"ToMe: {type(block).__name__} has no attention module "
                                    "this version can time")
    return found


def channels(block: nn.Module) -> int:
    """The width of a transformer block's tokens."""
    norm = getattr(block, "norm1", None)
    shape = getattr(norm, "normalized_shape", None)
    if shape:
        return int(shape[0])
    attn = attention(block)
    return int((getattr(attn, "to_q", None) or attn.qkv).in_features)  # or fused q, k, v


def context_dim(block: nn.Module) -> int | None:
    """The width of the context its cross-attention reads (None without one)."""
    to_k = getattr(getattr(block, "attn2", None), "to_k", None)
    return int(to_k.in_features) if to_k is not None else None


def unusable(block: nn.Module, sub_layers: Iterable[str]) -> str | None:
    """Why ``block`` cannot run our way at all, or None: another extension took it over (its
    or a sub-layer's forward replaced on the instance: ControlNet reference, Self-Attention
    Guidance, which records attn1's attention map in the middle block and expects every
    token), tomesd patched it, or it lacks a sub-layer the method uses."""
    if "_forward" in vars(block) or "forward" in vars(block):
        return "forward shadowed on the instance by another extension (e.g. ControlNet reference)"
    if type(block).__name__ == "ToMeBlock":
        return "patched by tomesd"
    subs = tuple(sub_layers)
    missing = [n for n in subs if not isinstance(getattr(block, n, None), nn.Module)]
    if missing:
        return f"unsupported block variant {type(block).__qualname__}: no {', '.join(missing)}"
    for name in subs:
        if "forward" in vars(getattr(block, name)):
            return (f"{name} forward replaced on the instance by another extension (e.g. "
                    "Self-Attention Guidance)")
    return None


def auto_level(max_downsample: int | None, levels: Iterable[int]) -> int:
    """``max_downsample``, or when None the highest-resolution level that has transformer
    blocks (1 on SD1/SD2; 2 on SDXL, which has no attention at full resolution)."""
    if max_downsample is not None:
        return max_downsample
    known = sorted(d for d in levels if d > 0)
    return known[0] if known else 1


# ----------------------------------------------------------------------------- readers

def _layout(unet: nn.Module, parts: list[tuple[nn.Module, int, bool]]) -> Layout:
    """The blocks of ``parts`` (part, level, decoder side) in order, then any others at level
    0 (the runtime still decides per token count)."""
    names = {m: n for n, m in unet.named_modules()}
    seen: dict[nn.Module, Block] = {}
    for part, level, decoder in parts:
        for m in part.modules():
            if is_block(m) and m not in seen:
                seen[m] = Block(names.get(m, ""), m, level, decoder)
    for m in unet.modules():
        if is_block(m) and m not in seen:
            seen[m] = Block(names.get(m, ""), m, 0, False)
    blocks = tuple(seen.values())
    first = blocks[0].module if blocks else unet
    return Layout(family(first), unet, blocks, context_keyword(first))


def _has(part: nn.Module, name: str) -> bool:
    return any(type(m).__name__ == name for m in part.modules())


def read_ldm(unet: nn.Module) -> Layout:
    """ldm, sgm and the ModelPatcher's UNet: count Downsample and Upsample layers along
    ``input_blocks`` / ``middle_block`` / ``output_blocks``."""
    parts, ds = [], 1
    for part in unet.input_blocks:
        if _has(part, "Downsample"):
            ds *= 2
        parts.append((part, ds, False))
    parts.append((unet.middle_block, ds, False))
    for part in unet.output_blocks:
        parts.append((part, ds, True))
        if _has(part, "Upsample"):
            ds //= 2
    return _layout(unet, parts)


def read_diffusers(unet: nn.Module) -> Layout:
    """diffusers: level ``2**i`` for ``down_blocks[i]``, mirrored for ``up_blocks``."""
    n = len(unet.down_blocks)
    parts = [(part, 2 ** i, False) for i, part in enumerate(unet.down_blocks)]
    if getattr(unet, "mid_block", None) is not None:
        parts.append((unet.mid_block, 2 ** (n - 1), False))
    parts += [(part, 2 ** (n - 1 - i), True) for i, part in enumerate(unet.up_blocks)]
    return _layout(unet, parts)


def _dit_layout(root: nn.Module, fam: dits.Family) -> Layout:
    """A DiT's blocks as its family reads them, double-stream first, all at the one level
    ``dit.patch``. A reader that fails on the model raises the one message (with what failed),
    so the host passes the model through with its line instead of failing its run."""
    try:
        dit, double, single = fam.read(root)
        names = {m: n for n, m in root.named_modules()}
        blocks = [Block(names.get(m, ""), m, dit.patch, False, "double") for m in double]
        blocks += [Block(names.get(m, ""), m, dit.patch, False, "single") for m in single]
    except Exception as e:
        raise not_supported(type(root).__name__, why=(
            f"it looked like {fam.name} but could not be read as one "
            f"({type(e).__name__}: {e})")) from e
    return Layout(fam.name, root, tuple(blocks), "encoder_hidden_states", dit)


def _reader(module: nn.Module):
    if hasattr(module, "input_blocks") and hasattr(module, "output_blocks"):
        return read_ldm
    if hasattr(module, "down_blocks") and hasattr(module, "up_blocks"):
        return read_diffusers
    fam = dits.find(module)
    return None if fam is None else lambda m: _dit_layout(m, fam)


def denoiser(model: Any) -> nn.Module | None:
    """The denoising network inside ``model`` (a UNet or a DiT), or None."""
    if isinstance(model, Layout):
        return model.root
    model = uncompiled(model)
    if isinstance(model, nn.Module) and _reader(model) is not None:
        return model
    for path in _DENOISERS:
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, nn.Module):
            return uncompiled(obj)
    return model if isinstance(model, nn.Module) else None


def uncompiled(model: Any) -> Any:
    """The module under a ``torch.compile``d one (its ``_orig_mod``: what a patch goes on
    and comes off, whether the model was compiled before or after patching), else
    ``model``."""
    inner = getattr(model, "_orig_mod", None) if isinstance(model, nn.Module) else None
    return inner if isinstance(inner, nn.Module) else model


def read(model: Any) -> Layout:
    """The layout of ``model``'s denoiser (an ldm/sgm model, a diffusers pipeline, a bare UNet
    or DiT, a ModelPatcher's ``diffusion_model``, or a ``Layout`` already read). Raises
    ``UnsupportedModelError`` (the one message) for anything without UNet transformer blocks
    that no DiT reader reads."""
    if isinstance(model, Layout):
        return model
    net = denoiser(model)
    reader = _reader(net) if net is not None else None
    layout = reader(net) if reader is not None else None
    if layout is None or not layout.blocks:
        what = net if net is not None else model
        raise not_supported("no model" if what is None else type(what).__name__,
                            found=net is not None and (net is not model or reader is not None))
    return layout


def find_unet(model: Any) -> nn.Module:
    """The UNet of an ldm/sgm model, a diffusers pipeline, or a bare UNet, without reading
    its blocks (removing a patch and looking one up need no more); anything else raises the
    one message (``read``)."""
    net = denoiser(model)
    return net if net is not None and _reader(net) is not None else read(model).root
