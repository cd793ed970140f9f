"""The DiT families: one file each in ``tome/dits/``, one registry here, read by ``layout.read``.

A family file (``flux.py``: diffusers Flux) holds everything in which DiTs differ: how to
recognise the model, its reader (the ``Dit`` facts and its blocks), how to read a call (the
grid, the text span, the timestep), its attention maths where an adapter reproduces the
host's attention, its measuring inputs, its display name. Everything else (the schedule,
pooling, the bias, reuse, the planner, the adapters) is shared and names no family.

Adding a DiT family:

1. a file ``tome/dits/<name>.py`` defining ``FAMILY = Family(...)`` (``family.py`` says what
   each field is; copy the closest family):
   - ``name``: the display name (``Layout.family``, reports, console lines);
   - ``recognise(module)``: whether a module is this family's denoiser (``by_class(...)``;
     a ComfyUI model: ``comfy_class(...)``);
   - ``read(model) -> (Dit(...), double-stream blocks, single-stream blocks)``;
   - for diffusers models pooled through their attention processors: ``call`` (how a
     forward call gives the latent size, text length and timestep; ``latent_call`` for a
     model called with the latent itself), ``maths`` (per processor class the library's
     attention with ``plan.pool`` / ``plan.keys`` before the kernel, through
     ``kv.attend_plan``), ``inputs`` (one block's call for measuring), and where needed
     ``attentions``, ``check`` (a library version the maths do not match), ``shadow``
     (a model without processors: A1111's MMDiT) and ``attention``;
   - for a host's own patch point (ComfyUI's attention override, Forge Neo's attention
     globals): ``name``, ``recognise``, ``read`` and ``host=HostPoint(COMFYUI, spans)``
     (how a model call places its text, image frames and reference tokens) or
     ``HostPoint(FORGE_NEO, spans, points)`` (also the globals Neo's blocks call attention
     by); the adapters find it through the registry, nothing else names the family;
2. one line here: its module in ``BUILTIN`` (a family outside the library calls
   ``register(FAMILY)`` itself; ``unregister(name)`` undoes it);
3. tests: the reader, a pooled call against a hand-written reference and factor 1 against
   the library's own bits, removal bit-exact (``tests/test_dits.py`` proves the recipe with
   a toy diffusers-like family and a toy ComfyUI family, each defined in the test file);
4. docs: the model lists (README, ``docs/development.md``); ``layout``'s "not supported"
   message names the registered families itself.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from . import (
    comfy_aura,
    comfy_chroma,
    comfy_cogvideox,
    comfy_cosmos,
    comfy_flux,
    comfy_flux2,
    comfy_hidream,
    comfy_hunyuan_video,
    comfy_kandinsky,
    comfy_ltxv,
    comfy_lumina,
    comfy_mochi,
    comfy_omnigen2,
    comfy_qwen,
    comfy_qwen21,
    comfy_sd3,
    comfy_sensenova,
    comfy_unreached,
    comfy_wan,
    flux,
    hunyuan_video,
    invoke_flux,
    mmdit,
    neo_chroma,
    neo_flux,
    neo_flux2,
    neo_lumina,
    neo_nunchaku,
    neo_qwen,
    neo_wan,
    qwen_image,
    sd3,
    wan,
)
from .family import (
    COMFYUI,
    FORGE_NEO,
    INVOKEAI,
    Call,
    Dit,
    Family,
    HostPoint,
    by_class,
    latent_call,
)

__all__ = ["COMFYUI", "FORGE_NEO", "INVOKEAI", "Call", "Dit", "Family", "HostPoint", "by_class",
           "latent_call", "register", "unregister", "families", "find", "of", "attention"]

REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make ``family`` known under ``family.name``: ``layout.read`` reads its models and the
    adapters pool them. A later registration of the same name replaces it."""
    REGISTRY[family.name] = family
    return family


def unregister(name: str) -> None:
    """Forget a family registered with ``register`` (tests of a toy family undo themselves)."""
    REGISTRY.pop(name, None)


def families() -> tuple[Family, ...]:
    """The registered families, in the order they are tried (built-in ones first)."""
    return tuple(REGISTRY.values())


def find(module: nn.Module) -> Family | None:
    """The family whose denoiser ``module`` is, or None. A ``recognise`` that raises on a
    module does not recognise it: one family's mistake about a model it does not know passes
    that model through (with the "not supported" line) instead of failing the host's run."""
    return next((f for f in REGISTRY.values() if _recognises(f, module)), None)


def _recognises(family: Family, module: nn.Module) -> bool:
    try:
        return bool(family.recognise(module))
    except Exception:
        return False


def of(layout: Any) -> Family:
    """The family a DiT layout was read by (``Layout.family`` is its name)."""
    return REGISTRY[layout.family]


def attention(block: nn.Module) -> nn.Module | None:
    """A block's attention module where a family names it (``Family.attention``), or None."""
    for f in REGISTRY.values():
        found = f.attention(block) if f.attention is not None else None
        if found is not None:
            return found
    return None


# The built-in families, in the order they are tried.
BUILTIN = (
    flux, sd3, mmdit, qwen_image, wan, hunyuan_video,  # diffusers', A1111's
    comfy_unreached,  # ComfyUI's: the unreachable first (a Nunchaku wrapper holds another's)
    comfy_sd3,
    comfy_aura,
    comfy_hunyuan_video,
    comfy_hidream,
    comfy_mochi,
    comfy_omnigen2,
    comfy_chroma,  # Chroma and Flux 2 before Flux (its blocks)
    comfy_flux2,
    comfy_flux,
    comfy_lumina,
    comfy_ltxv,
    comfy_cosmos,
    comfy_kandinsky,
    comfy_cogvideox,
    comfy_qwen,
    comfy_qwen21,
    comfy_sensenova,
    comfy_wan,
    neo_nunchaku,  # Forge Neo's: Nunchaku's before the others
    neo_chroma,  # before Flux (its blocks)
    neo_flux2,
    neo_flux,
    neo_wan,
    neo_qwen,
    neo_lumina,
    invoke_flux,
)
for _module in BUILTIN:
    register(_module.FAMILY)
BUILTIN_FAMILIES = tuple(m.FAMILY for m in BUILTIN)
