"""The ComfyUI node on bad input, against the stand-in of ComfyUI 0.8.0 (``tests/comfy_stub``):
a ``blocks`` or ``schedule`` that names no block of the DiT passes the model through with a
line saying which setting names nothing (no wrapper installed, the latent bit-identical), and
a value outside its range is a ``ValueError`` naming it before anything is patched."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingFlux  # noqa: E402
from comfy_node import defaults  # noqa: E402

from tome import override  # noqa: E402
from tome import patcher as mp  # noqa: E402
from tome.comfy import nodes  # noqa: E402

FIXED = {"preset": "custom", "method": "downsample", "policy": "fixed"}


def flux_model():
    """ComfyUI 0.8.0's Flux (tiny stand-in: 2 double- and 2 single-stream blocks) behind a
    ModelPatcher, with its model sampling."""
    from comfy.ldm.flux.model import Flux
    from comfy.model_base import BaseModel
    torch.manual_seed(0)
    return ModelPatcher(BaseModel(Flux().eval(), ModelSamplingFlux(shift=1.15)))


def sample(patcher):
    """A 4-step KSampler run (Euler, cfg 1) from seeded noise and text."""
    from comfy.model_sampling import simple_sigmas
    from comfy.sampling import dit_sample
    g = torch.Generator().manual_seed(0)
    noise, ctx = torch.randn(1, 4, 16, 24, generator=g), torch.randn(1, 5, 12, generator=g)
    sigmas = simple_sigmas(patcher.get_model_object("model_sampling"), 4)
    with torch.no_grad():
        return dit_sample(patcher, noise, ctx, sigmas)


NAMES_NONE = ("ToMe: {} names no block of this DiT (it has blocks 0-3, double-stream first); "
              "nothing is pooled")


@pytest.mark.parametrize("settings, why", [
    ({"blocks": "9-12"}, NAMES_NONE.format("blocks='9-12'")),
    ({"schedule": "7-9:4"}, NAMES_NONE.format("schedule='7-9:4'")),
    ({"schedule": "all:1"}, "ToMe: these settings change nothing (every block at x1)"),
])
def test_settings_naming_no_block_pass_through_with_their_line(lines, settings, why):
    base = flux_model()
    ref = sample(base)
    (out,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, **settings))
    assert out is base and not override.carried(base) and getattr(base, mp.MARK, None) is None
    assert lines == [f"{why}; {nodes.PASSES}"]
    assert torch.equal(sample(out), ref)


@pytest.mark.parametrize("settings, message", [
    ({"downsample_factor": 2**40}, "downsample_factor=1099511627776: must be a positive "
                                   "integer in [1, 8]"),
    ({"reuse": 10**30}, "reuse=1000000000000000000000000000000: must be a non-negative "
                        "integer in [0, 20]"),
    ({"schedule": ",".join(["all:2"] * 100_000)}, "100000 items: at most 64"),
    # blocks beside a schedule would do nothing (the schedule names its blocks): refused
    ({"schedule": "double:2", "blocks": "9"}, "blocks='9': schedule='double:2' names the "
                                              "blocks itself"),
])
def test_out_of_range_inputs_fail_before_anything_is_patched(lines, settings, message):
    """ComfyUI's /prompt refuses numbers outside an input's min/max; a graph run another way
    (the node called directly, an API graph not validated) gets the config's error."""
    base = flux_model()
    with pytest.raises(ValueError) as e:
        nodes.ToMePatch().patch(base, **defaults(**FIXED, **settings))
    assert message in str(e.value) and len(str(e.value)) < 400
    assert not override.carried(base) and not lines
