"""ComfyUI's DiTs whose attention never reaches ComfyUI's attention override, so ToMe can pool
nothing in them: recognised, read (for the report) and said so in one line each, instead of
"not a DiT it can pool".

- PixArt alpha/sigma (``comfy.ldm.pixart.pixartms.PixArtMS``) and HunyuanDiT
  (``comfy.ldm.hydit.models.HunYuanDiT``): their blocks call ComfyUI's attention without
  ``transformer_options``, where the override is carried (0.8.0 and v0.30.0);
- Ernie-Image (``comfy.ldm.ernie.model.ErnieImageModel``, v0.30.0): the same;
- Prism (``comfy.ldm.prism.model.Prism``, after v0.30.0, read at Comfy-Org/ComfyUI@c4b595b8):
  its video self-attention runs in its own 3-D block-sparse kernel (``prism/sparse.py``),
  never the override; what does reach it (the dense tail frames, cross-attention, the audio
  tower) names no block and no token layout;
- Kandinsky 6 (``comfy.ldm.kandinsky6.model.Kandinsky6NativeAVDiT``, read at
  Comfy-Org/ComfyUI@4ab48ceb): its attention does reach the override (``block_index``
  named; fused video and audio blocks; a reference frame appended as the video's tail), but
  the model is called with a joint video and audio latent (a pair, packed into one tensor
  with ``latent_shapes`` where ``apply_model`` sees it), and its blocks' cross-modal calls
  (audio queries over the video's keys, video queries over the audio's) cannot be told from
  self-attention by key and query lengths alone (``kv.key_start``): said so, nothing
  installed (docs/comfyui.md, "Newer ComfyUI");
- Nunchaku (SVDQuant) models loaded by ComfyUI-nunchaku (its wrappers around ``nunchaku``'s
  transformers): attention in Nunchaku's own kernels (its Qwen-Image copy calls ComfyUI's
  attention without ``transformer_options`` too).
Recognised before the other ComfyUI families (``BUILTIN``): a Nunchaku wrapper may hold a
model another family would claim."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint

HOST = "calls ComfyUI's attention without transformer_options"
NEVER = "ToMe's attention override never sees its attention"
# class name -> (the model's name, how its attention runs, so what)
UNREACHED = {"PixArtMS": ("PixArt", HOST), "HunYuanDiT": ("HunyuanDiT", HOST),
             "ErnieImageModel": ("Ernie-Image", HOST),
             "Prism": ("Prism", "runs its video self-attention in its own 3-D block-sparse "
                       "kernel, which bypasses ComfyUI's attention override",
                       "ToMe cannot pool it"),
             "Kandinsky6NativeAVDiT": ("Kandinsky 6", "is called with a joint video and audio "
                                       "latent (a pair, not one tensor)",
                                       "ToMe cannot place its video tokens yet")}
UNREACHED["Kandinsky6"] = UNREACHED["Kandinsky6NativeAVDiT"]  # its base, called alike
NUNCHAKU = ("a Nunchaku (SVDQuant) model", "runs its attention in Nunchaku's own kernels")


def _comfy(module: nn.Module) -> bool:
    return type(module).__module__.startswith("comfy.")


def _nunchaku(module: nn.Module) -> bool:
    """A ComfyUI-nunchaku wrapper: the model, or a module inside it, is ``nunchaku``'s."""
    return any(type(m).__module__.split(".")[0] == "nunchaku" for m in module.modules())


def which(module: nn.Module) -> tuple[str, ...] | None:
    """(the model's name, how its attention runs[, so what]) for a model ToMe cannot reach,
    or None."""
    if _comfy(module):
        return UNREACHED.get(type(module).__name__)
    return NUNCHAKU if _nunchaku(module) else None


@dataclass(frozen=True)
class Unreached(Dit):
    """A DiT whose attention the override never sees: every setting pools nothing, said
    once."""

    model: str = ""
    calls: str = ""
    then: str = NEVER

    def unmergeable(self, layout: Any, config: Any) -> str | None:
        return (f"ToMe: {self.model} {self.calls}, so {self.then} and nothing is pooled in "
                "this model")


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    name, calls, *then = which(model) or ("this model", "runs its attention elsewhere")
    blocks = [b for attr in ("blocks", "layers", "transformer_blocks", "double_blocks",
                             "fusion_blocks", "visual_blocks")
              for b in getattr(model, attr, None) or ()] or [model]
    patch = getattr(model, "patch_size", 2)
    patch = patch[-1] if isinstance(patch, (tuple, list)) else patch
    return Unreached(int(patch or 2), True, 0, 1000.0, False, name, calls, *then), blocks, ()


def spans(model: nn.Module, x: Any, context: Any, conds: dict) -> None:
    return None  # never placed: its attention never reaches the override


FAMILY = Family("comfy unreached", lambda m: which(m) is not None, read,
                host=HostPoint(COMFYUI, spans))
