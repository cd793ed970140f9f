"""Reading a model: one ``Layout`` value says what the planner, the adapters and the
measurement need to know of a model, and a reader per family produces it.

A ``Layout`` lists the model's transformer blocks, each with its level (its tokens form the
latent grid downsampled by that factor), its side (encoder or decoder) and its name, plus the
keyword its sub-layers take the context by, the family's name and, for a DiT, its facts
(``Dit``: patch size, where the text sits, RoPE, how it is called). Readers:

- ``read_ldm``: a UNet with ``input_blocks`` / ``middle_block`` / ``output_blocks``: ldm
  (SD1/SD2), sgm (SDXL), and the UNet behind a ModelPatcher (the Forge family's and ComfyUI's
  own copies of that code);
- ``read_diffusers``: a UNet with ``down_blocks`` / ``mid_block`` / ``up_blocks``;
- DiTs: diffusers' Flux and SD3/SD3.5 (``read_flux``, ``read_sd3``), A1111 1.10's SD3
  (``read_mmdit``), ComfyUI's Flux and Qwen-Image (``read_comfy_flux``, ``read_comfy_qwen``).

``read(model)`` finds the denoiser in whatever it is given (an ldm/sgm model, a diffusers
pipeline, a bare UNet or DiT, a ModelPatcher's ``diffusion_model``), picks the reader, and owns
the one "not supported" message. Adding a model family is adding a reader
(``docs/development.md``). Structure only: nothing here changes a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

BLOCK_CLASS = "BasicTransformerBlock"
# The denoiser inside a model: diffusers pipelines (``unet``, ``transformer``), ldm/sgm models
# and the ModelPatcher's model (``model.diffusion_model``, ``diffusion_model``).
_DENOISERS = ("unet", "transformer", "model.diffusion_model", "diffusion_model")


class UnsupportedModelError(TypeError):
    """The object is not a model this library can patch."""


def not_supported(name: str, found: bool = True) -> UnsupportedModelError:
    """The one message for a model ToMe cannot merge; ``found``: a denoiser was found in it
    (else what was expected is said too)."""
    text = (f"ToMe: {name} has no UNet transformer blocks to merge and is not a DiT it can "
            "pool (ToMe merges SD1, SD2 and SDXL UNets and pools image keys/values in Flux and "
            "SD3 DiTs and in ComfyUI Qwen-Image; not other DiTs such as Qwen-Image in "
            "diffusers, Wan or Lumina, nor compiled or replaced models)")
    if not found:
        text += ("; expected an ldm/sgm model (.model.diffusion_model), a diffusers pipeline "
                 "(.unet, .transformer) or the UNet or transformer itself")
    return UnsupportedModelError(text)


@dataclass(frozen=True)
class Block:
    """One transformer block as the planner sees it."""

    name: str            # its name in the UNet (``input_blocks.1.1.transformer_blocks.0``)
    module: nn.Module
    level: int           # downsample of the latent grid its tokens form (0: not known)
    decoder: bool        # on the upsampling side (it gets its own plans)
    kind: str = "unet"   # DiTs: "double" (double-stream / joint) or "single" (single-stream)


@dataclass(frozen=True)
class Dit:
    """What a DiT adds to its blocks: where its image tokens are and how its calls look."""

    patch: int              # latent pixels per token side: the DiT's one level
    text_first: bool        # the joint sequence is [text, image] (Flux) or [image, text] (SD3)
    text_tokens: int        # the text length its pipelines use (what measuring feeds it)
    timestep_scale: float   # its timestep times this is on the 0..1000 training scale
    rope: bool              # rotary positions inside attention (Flux) or none (SD3)
    # How the model is called: (name, position) of the latent or image tokens, the text
    # and the timestep (diffusers' names; A1111's MMDiT takes ``x, t, context=``).
    call: tuple[tuple[str, int], ...] = (("hidden_states", 0), ("encoder_hidden_states", 1),
                                         ("timestep", 3))


@dataclass(frozen=True)
class Layout:
    """What a model is made of, for the planner, the adapters and the measurement."""

    family: str                  # "ldm", "sgm", "diffusers", or the host package's name
    root: nn.Module              # the UNet: where a patch keeps its state
    blocks: tuple[Block, ...]    # in the UNet's order: encoder, middle, decoder
    context_keyword: str         # the sub-layers' keyword for the context
    dit: Dit | None = None       # set for DiTs (Flux, SD3): their blocks are pooled, not merged

    @property
    def kind(self) -> str:
        """``"UNet"`` or ``"DiT"``: what the report and the console call the model."""
        return "UNet" if self.dit is None else "DiT"

    @property
    def levels(self) -> list[int]:
        """The levels that have transformer blocks, highest resolution first."""
        return sorted({b.level for b in self.blocks if b.level > 0})

    @property
    def level_of(self) -> dict[nn.Module, int]:
        """Every block's level, in the UNet's order."""
        return {b.module: b.level for b in self.blocks}

    def at(self, level: int) -> list[Block]:
        return [b for b in self.blocks if b.level == level]

    def auto_level(self, max_downsample: int | None) -> int:
        return auto_level(max_downsample, self.levels)

    def unmergeable(self, config: Any) -> str | None:
        """Why ``config`` merges nothing on this model, or None: a method with no DiT form on
        a DiT, an explicit ``max_downsample`` above every UNet level."""
        if self.dit is not None:
            from .dit import method_for, no_form
            return None if method_for(config) is not None else no_form(config, self.family)
        return self.nothing_to_merge(config.max_downsample)

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
    """The block's self-attention: ``attn1`` in UNet blocks, ``attn`` in DiT blocks, the image
    block's ``attn`` in A1111's MMDiT."""
    found = getattr(block, "attn1", None) or getattr(block, "attn", None)
    if found is None:
        found = getattr(getattr(block, "x_block", None), "attn", None)
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
    return int((getattr(attn, "to_q", None) or attn.qkv).in_features)  # MMDiT: one qkv


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


def _dit_layout(root: nn.Module, fam: str, double: Iterable[nn.Module],
                single: Iterable[nn.Module], dit: Dit) -> Layout:
    """A DiT's blocks in order, double-stream first, all at the one level ``dit.patch``."""
    names = {m: n for n, m in root.named_modules()}
    blocks = [Block(names.get(m, ""), m, dit.patch, False, "double") for m in double]
    blocks += [Block(names.get(m, ""), m, dit.patch, False, "single") for m in single]
    return Layout(fam, root, tuple(blocks), "encoder_hidden_states", dit)


def read_flux(model: nn.Module) -> Layout:
    """diffusers ``FluxTransformer2DModel``: ``transformer_blocks`` (double-stream) then
    ``single_transformer_blocks``; [text, image] joint sequence; timesteps in [0, 1]."""
    cfg = getattr(model, "config", None)
    patch = 2 * int(getattr(cfg, "patch_size", 1) or 1)  # 2x2 latent packing by the pipeline
    return _dit_layout(model, "diffusers flux", model.transformer_blocks,
                       model.single_transformer_blocks, Dit(patch, True, 512, 1000.0, True))


def read_sd3(model: nn.Module) -> Layout:
    """diffusers ``SD3Transformer2DModel``: joint blocks; [image, text]; timesteps 0..1000."""
    patch = int(getattr(model.config, "patch_size", 2))
    return _dit_layout(model, "diffusers sd3", model.transformer_blocks, (),
                       Dit(patch, False, 333, 1.0, False))


def read_comfy_flux(model: nn.Module) -> Layout:
    """ComfyUI's (and its stand-in's) Flux: ``double_blocks`` then ``single_blocks``, reached
    through the attn1 patch's DiT call form; sigmas in [0, 1]."""
    return _dit_layout(model, "comfy flux", model.double_blocks, model.single_blocks,
                       Dit(2, True, 512, 1000.0, True))


def read_mmdit(model: nn.Module) -> Layout:
    """SD3 as A1111 1.10 runs it (``modules.models.sd3.mmdit.MMDiT``, Stability's reference
    code): ``joint_blocks``, each a context block and an image block (``x_block``) whose
    ``attn.pre_attention`` gives the image tokens' q, k, v; [text, image]; called as
    ``(x, t, context=, y=)`` with t = sigma * 1000."""
    patch = model.x_embedder.patch_size
    patch = int(patch[0] if isinstance(patch, (tuple, list)) else patch)
    return _dit_layout(model, "a1111 sd3", model.joint_blocks, (),
                       Dit(patch, True, 154, 1.0, False,
                           (("x", 0), ("context", 3), ("t", 1))))


def read_comfy_qwen(model: nn.Module) -> Layout:
    """ComfyUI's Qwen-Image: ``transformer_blocks`` (all double-stream), the same DiT call form
    and RoPE matrices as its Flux; [text, image]; sigmas in [0, 1]."""
    return _dit_layout(model, "comfy qwen-image", model.transformer_blocks, (),
                       Dit(int(getattr(model, "patch_size", 2)), True, 512, 1000.0, True))


_COMFY_READERS = {"QwenImageTransformer2DModel": read_comfy_qwen}  # Flux: by its block lists
_DIT_READERS = {"FluxTransformer2DModel": read_flux, "SD3Transformer2DModel": read_sd3,
                "MMDiT": read_mmdit}


def _reader(module: nn.Module):
    if hasattr(module, "input_blocks") and hasattr(module, "output_blocks"):
        return read_ldm
    if hasattr(module, "down_blocks") and hasattr(module, "up_blocks"):
        return read_diffusers
    for cls in type(module).__mro__:
        if cls.__name__ in _DIT_READERS:
            return _DIT_READERS[cls.__name__]
    if type(module).__module__.startswith("comfy.") and hasattr(module, "pe_embedder"):
        # ComfyUI's own DiTs that call attn1 patches (Forge Neo's copies, in backend.nn, call
        # none): Flux by its two block lists, Qwen-Image by its class
        if hasattr(module, "double_blocks") and hasattr(module, "single_blocks"):
            return read_comfy_flux
        return _COMFY_READERS.get(type(module).__name__)
    return None


def denoiser(model: Any) -> nn.Module | None:
    """The denoising network inside ``model`` (a UNet or a DiT), or None."""
    if isinstance(model, Layout):
        return model.root
    if isinstance(model, nn.Module) and _reader(model) is not None:
        return model
    for path in _DENOISERS:
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, nn.Module):
            return obj
    return model if isinstance(model, nn.Module) else None


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
