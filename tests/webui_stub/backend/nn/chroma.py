"""``backend.nn.chroma``: Forge Neo's Chroma. What the swap meets is Flux's: Chroma imports
Flux's ``DoubleStreamBlock`` and ``SingleStreamBlock`` from ``backend.nn.flux``, so its blocks
call ``backend.nn.flux.attention``; it takes T5 tokens only (no pooled CLIP vector). Its own
modulation (an approximator network) is left out here."""

from backend.nn.flux import IntegratedFluxTransformer2DModel


class IntegratedChromaTransformer2DModel(IntegratedFluxTransformer2DModel):
    def forward(self, x, timestep, context, guidance=None, control=None,
                transformer_options={}, **kwargs):  # noqa: B006 (as Neo)
        kwargs.pop("y", None)
        return super().forward(x, timestep, context, transformer_options=transformer_options,
                               **kwargs)
