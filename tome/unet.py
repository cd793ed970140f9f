"""Reading a UNet: where it is inside a model, its transformer blocks and their levels.

Shared by both host adapters (``patch.py``, ``patcher.py``), the measurement and the lab, so
there is one answer to "which blocks are at which level" and one auto level. Structure only:
nothing here changes a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

BLOCK_CLASS = "BasicTransformerBlock"


class UnsupportedModelError(TypeError):
    """The object is not a model this library can patch."""


def find_unet(model: Any) -> nn.Module:
    """The UNet of an ldm/sgm model, a diffusers pipeline, or a bare UNet."""
    for path in ("unet", "model.diffusion_model", "diffusion_model"):
        obj = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if isinstance(obj, nn.Module):
            return obj
    if isinstance(model, nn.Module) and (hasattr(model, "input_blocks")
                                         or hasattr(model, "down_blocks")):
        return model
    raise UnsupportedModelError(
        f"ToMe: cannot find a UNet in {type(model).__module__}.{type(model).__name__}; expected "
        "an ldm/sgm model (with .model.diffusion_model), a UNet (ldm UNetModel or diffusers "
        "UNet2DConditionModel) or a diffusers pipeline (with .unet)")


def is_block(module: nn.Module) -> bool:
    """A transformer block (ldm, sgm, Forge and diffusers all name it ``BasicTransformerBlock``)."""
    return any(cls.__name__ == BLOCK_CLASS for cls in type(module).__mro__)


def family(module: nn.Module) -> str:
    """``ldm``, ``sgm``, ``diffusers`` or the top-level package a module's class comes from."""
    root = type(module).__module__.split(".")[0]
    return root if root in ("ldm", "sgm", "diffusers") else root or "unknown"


def block_levels(unet: nn.Module) -> dict[nn.Module, int]:
    """The downsample level of every transformer block, read from the UNet's structure.

    ldm/sgm: walk ``input_blocks`` / ``middle_block`` / ``output_blocks`` counting Downsample
    and Upsample layers. diffusers: level ``2**i`` for ``down_blocks[i]``, mirrored for
    ``up_blocks``. Anything else: level unknown (0); the runtime still decides per token count.
    """
    levels: dict[nn.Module, int] = {}

    def mark(part: nn.Module, ds: int) -> None:
        for m in part.modules():
            if is_block(m):
                levels.setdefault(m, ds)

    def has(part: nn.Module, name: str) -> bool:
        return any(type(m).__name__ == name for m in part.modules())

    if hasattr(unet, "input_blocks") and hasattr(unet, "output_blocks"):
        ds = 1
        for part in unet.input_blocks:
            if has(part, "Downsample"):
                ds *= 2
            mark(part, ds)
        mark(unet.middle_block, ds)
        for part in unet.output_blocks:
            mark(part, ds)
            if has(part, "Upsample"):
                ds //= 2
    elif hasattr(unet, "down_blocks") and hasattr(unet, "up_blocks"):
        n = len(unet.down_blocks)
        for i, part in enumerate(unet.down_blocks):
            mark(part, 2 ** i)
        if getattr(unet, "mid_block", None) is not None:
            mark(unet.mid_block, 2 ** (n - 1))
        for i, part in enumerate(unet.up_blocks):
            mark(part, 2 ** (n - 1 - i))
    for m in unet.modules():
        if is_block(m):
            levels.setdefault(m, 0)
    return levels


def channels(block: nn.Module) -> int:
    """The width of a transformer block's tokens."""
    norm = getattr(block, "norm1", None)
    shape = getattr(norm, "normalized_shape", None)
    return int(shape[0]) if shape else int(block.attn1.to_q.in_features)


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


def known_levels(unet: nn.Module | None) -> list[int]:
    """The levels that have transformer blocks, highest resolution first ([] for None)."""
    if unet is None:
        return []
    return sorted({d for d in block_levels(unet).values() if d > 0})


def auto_level(max_downsample: int | None, levels: list[int] | set[int]) -> int:
    """``max_downsample``, or when None the highest-resolution level that has transformer
    blocks (1 on SD1/SD2; 2 on SDXL, which has no attention at full resolution)."""
    if max_downsample is not None:
        return max_downsample
    known = sorted(d for d in levels if d > 0)
    return known[0] if known else 1


def nothing_to_merge(max_downsample: int | None, levels: list[int]) -> str | None:
    """Why an explicit ``max_downsample`` merges no block of a UNet with transformer blocks at
    ``levels``, or None."""
    if max_downsample is None or not levels or any(d <= max_downsample for d in levels):
        return None
    return (f"ToMe: max_downsample={max_downsample} merges nothing on this model (its "
            f"transformer blocks are at downsample {levels}); use max_downsample=None (auto) "
            f"or >= {levels[0]}")


def decoder_blocks(unet: nn.Module) -> set[nn.Module]:
    """The transformer blocks on the upsampling side (ldm/sgm ``output_blocks``, diffusers
    ``up_blocks``)."""
    side = getattr(unet, "output_blocks", None) or getattr(unet, "up_blocks", None) or []
    return {m for part in side for m in part.modules() if is_block(m)}
