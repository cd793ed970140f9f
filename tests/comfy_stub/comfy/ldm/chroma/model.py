"""``comfy.ldm.chroma.model.Chroma`` as ComfyUI 0.8.0 and v0.30.0 behave (tiny width; written
from its public source's structure and call shapes, not its code): Flux's double and single
blocks and [text, image] joint attention through ``comfy.ldm.flux.math.attention`` (queries
and keys rotated, ``[B, heads, S, D]``, ``block_type`` / ``block_index`` written into
``transformer_options``), called as ``forward(x, timestep, context, guidance, control=None,
transformer_options={}, **kwargs)`` (no pooled text ``y``, no reference latents), its
modulations from one ``distilled_guidance_layer`` (here only present: the stand-in keeps
the Flux stand-in's timestep vector); the
conditioning's ``attention_mask`` reaches attention as the model gets it. (The real class is
no subclass of Flux; this stand-in borrows the Flux stand-in's blocks and packing.)"""

import torch

from comfy.ldm.flux.model import Flux


class Chroma(Flux):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.distilled_guidance_layer = torch.nn.Linear(32, self.time_in.out_features)

    def forward(self, x, timestep, context, guidance=None, control=None,
                transformer_options={}, **kwargs):  # noqa: B006
        return super().forward(x, timestep, context, None, guidance, None, control,
                               transformer_options, **kwargs)
