"""The patch on the real sgm UNet code (SDXL as the WebUI runs it). Opt-in: sgm is on no
package registry, so point ``TOME_SGM_PATH`` at a checkout of Stability-AI/generative-models
(commit 45c443b, the one the WebUI pins) to run it; CI covers the SDXL layout with ldm."""

from __future__ import annotations

import os
import sys
import types

import pytest
import tomesd
import torch
from models import Wrapper, wake

import tome

SGM = os.environ.get("TOME_SGM_PATH")
pytestmark = pytest.mark.skipif(not SGM, reason="set TOME_SGM_PATH to a generative-models checkout")


@pytest.fixture(scope="module")
def sdxl():
    # sgm's package __init__ files import Lightning and open_clip: stub the packages.
    for name in ("sgm", "sgm.modules", "sgm.modules.diffusionmodules"):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [os.path.join(SGM, *name.split("."))]
            sys.modules[name] = module
    from sgm.modules.diffusionmodules.openaimodel import UNetModel
    torch.manual_seed(0)
    unet = UNetModel(  # sd_xl_base.yaml's layout with narrow channels
        adm_in_channels=32, num_classes="sequential", use_checkpoint=False, in_channels=4,
        out_channels=4, model_channels=32, attention_resolutions=[4, 2], num_res_blocks=2,
        channel_mult=[1, 2, 4], num_head_channels=16, use_linear_in_transformer=True,
        transformer_depth=[1, 2, 10], context_dim=32, use_spatial_transformer=True,
        legacy=False)
    return wake(unet, 0).eval()


def test_sgm_sdxl(sdxl):
    x, t = torch.randn(2, 4, 32, 32), torch.full((2,), 500.0)
    c, y = torch.randn(2, 7, 32), torch.randn(2, 32)
    wrapped = Wrapper(sdxl)
    base = sdxl(x, t, context=c, y=y)
    tomesd.apply_patch(wrapped, ratio=0.5)  # what the WebUI's built-in does: merges nothing
    assert torch.equal(sdxl(x, t, context=c, y=y), base)
    tomesd.remove_patch(wrapped)
    tome.apply_patch(wrapped, ratio=0.5, use_rand=False)
    report = tome.patch_report(wrapped)
    assert (report.family, report.total_blocks, report.levels) == ("sgm", 70, {2: 10})
    ours = sdxl(x, t, context=c, y=y)
    tome.remove_patch(wrapped)
    assert torch.equal(sdxl(x, t, context=c, y=y), base)
    tomesd.apply_patch(wrapped, ratio=0.5, use_rand=False, max_downsample=2)
    ref = sdxl(x, t, context=c, y=y)
    tomesd.remove_patch(wrapped)
    assert not torch.equal(ours, base)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
