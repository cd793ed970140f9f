"""ComfyUI's DiTs whose attention never reaches the attention override (PixArt, HunyuanDiT,
Ernie-Image, Nunchaku's models): the node passes each through with one line naming the model
and why, instead of "not a DiT it can pool" or a patch that would never fire."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from comfy.model_base import BaseModel  # noqa: E402
from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingDiscreteFlow  # noqa: E402
from comfy_node import defaults  # noqa: E402

from tome.comfy import host, nodes  # noqa: E402


def _class(module: str, name: str) -> type:
    """A model class as the host defines it (its module and name are what identify it)."""
    def forward(self, x, *args, **kwargs):
        return self.blocks[0](x)
    return type(name, (nn.Module,), {"__module__": module, "forward": forward})


def _model(module: str, name: str, inner: str | None = None) -> nn.Module:
    model = _class(module, name)()
    model.blocks = nn.ModuleList([nn.Identity()])
    if inner is not None:  # ComfyUI-nunchaku: a wrapper around nunchaku's transformer
        model.model = _class(inner, "NunchakuFluxTransformer2dModel")()
    return model


def settings():
    return defaults(method="downsample", policy="fixed")


@pytest.mark.parametrize("module,name,inner,said", [
    ("comfy.ldm.pixart.pixartms", "PixArtMS", None,
     "PixArt calls ComfyUI's attention without transformer_options"),
    ("comfy.ldm.hydit.models", "HunYuanDiT", None,
     "HunyuanDiT calls ComfyUI's attention without transformer_options"),
    ("comfy.ldm.ernie.model", "ErnieImageModel", None,
     "Ernie-Image calls ComfyUI's attention without transformer_options"),
    ("wrappers.flux", "ComfyFluxWrapper", "nunchaku.models.transformers.transformer_flux",
     "a Nunchaku (SVDQuant) model runs its attention in Nunchaku's own kernels"),
])
def test_a_dit_the_override_never_reaches_passes_through_with_its_line(
        monkeypatch, module, name, inner, said):
    told = []
    monkeypatch.setattr(host, "console", told.append)
    base = ModelPatcher(BaseModel(_model(module, name, inner),
                                  ModelSamplingDiscreteFlow(shift=1.0)))
    (out,) = nodes.ToMePatch().patch(base, **settings())
    assert out is base  # passed through: no clone, no wrapper, no override
    assert not base.wrappers and base.model_options == {"transformer_options": {}}
    ours = [x for x in told if x.startswith("ToMe")]
    assert len(ours) == 1 and said in ours[0] and "nothing is pooled" in ours[0], told


def test_a_comfy_model_of_another_name_is_still_not_supported(monkeypatch):
    """Only the named models are claimed: another ComfyUI model keeps the "not supported"
    line (which names the registered families)."""
    told = []
    monkeypatch.setattr(host, "console", told.append)
    base = ModelPatcher(BaseModel(_model("comfy.ldm.other.model", "OtherDiT"),
                                  ModelSamplingDiscreteFlow(shift=1.0)))
    (out,) = nodes.ToMePatch().patch(base, **settings())
    assert out is base and any("is not a DiT it can pool" in x for x in told), told
