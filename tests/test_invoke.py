"""InvokeAI's own Flux (issue 47: a new host as a family file and a choice of parts): the
stand-in ``tests/invoke_stub`` binds ``attention`` by name in its layers module, as InvokeAI
does. ``tome.apply_patch`` on the bare model pools through Forge Neo's interception (the
global swapped per model call) with the module's own ``forward`` as the bracket."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import tome
from tome.config import ToMeConfig

STUB = str(Path(__file__).resolve().parent / "invoke_stub")
H, W, TEXT = 4, 6, 5
CONFIG = ToMeConfig(method="downsample", downsample_factor=2, proportional=False, rope="before",
                    policy="fixed")


@pytest.fixture()
def invoke():
    if STUB not in sys.path:
        sys.path.insert(0, STUB)
    from invokeai.backend.flux import math as fmath
    from invokeai.backend.flux import model
    from invokeai.backend.flux.modules import layers
    torch.manual_seed(0)
    yield model.Flux().eval(), layers, fmath
    layers.attention = fmath.attention


def call(m, b=1, t=0.7):
    g = torch.Generator().manual_seed(1)
    img = torch.randn(b, H * W, 16, generator=g)
    ids = torch.zeros(b, H * W, 3)
    ids[..., 1] = torch.arange(H).repeat_interleave(W).float()
    ids[..., 2] = torch.arange(W).repeat(H).float()
    txt = torch.randn(b, TEXT, 32, generator=g)
    with torch.no_grad():
        return m(img=img, img_ids=ids, txt=txt, txt_ids=torch.zeros(b, TEXT, 3),
                 timesteps=torch.full((b,), t), y=torch.randn(b, 24, generator=g))


def test_invokeai_flux_is_pooled_as_a_hand_written_reference_and_removed_bit_for_bit(invoke):
    """Patched, each attention call's image keys and values are 2x2 cell means of the rotated
    keys (text whole): the model's output equals the same model run with such an attention
    written here; removed, the output is the unpatched one, bit for bit, with nothing left on
    the module or in the layers' globals."""
    m, layers, fmath = invoke
    unpatched = call(m)

    def pooled(q, k, v, pe, attn_mask=None):
        q, k = fmath.apply_rope(q, k, pe)

        def cells(x):  # [B, heads, S, D]: the text rows, then each image cell's mean
            b, heads = x.shape[:2]
            img = x[:, :, TEXT:].unflatten(2, (H, W)).permute(0, 1, 4, 2, 3).flatten(0, 1)
            img = F.avg_pool2d(img, 2).flatten(2).transpose(1, 2).unflatten(0, (b, heads))
            return torch.cat([x[:, :, :TEXT], img], 2)
        out = F.scaled_dot_product_attention(q, cells(k), cells(v))
        return out.transpose(1, 2).flatten(2)

    layers.attention = pooled
    want = call(m)
    layers.attention = fmath.attention

    report = tome.apply_patch(m, config=CONFIG) and tome.patch_report(m)
    assert report.family == "invokeai flux" and report.adapter == "attention swap"
    got = call(m)
    assert layers.attention is fmath.attention  # put back after the call
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, unpatched)

    tome.remove_patch(m)
    assert not tome.is_patched(m) and "forward" not in vars(m)
    assert torch.equal(call(m), unpatched)


def test_the_global_is_restored_when_the_model_raises(invoke):
    m, layers, fmath = invoke
    tome.apply_patch(m, config=CONFIG)

    def fail(module, args):
        assert layers.attention is not fmath.attention  # ours, during the call
        raise RuntimeError("interrupted")
    handle = m.single_blocks[0].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        call(m)
    handle.remove()
    assert layers.attention is fmath.attention
    tome.remove_patch(m)


def test_residual_reuse_refreshes_and_reuses_under_the_bracket(invoke):
    """The quality preset's residual reuse applies per model call as in the other hosts:
    steps of a generation (timesteps 1 to 0) refresh at the first and reuse after it."""
    m, _, _ = invoke
    tome.apply_patch(m, config=tome.preset("quality", policy="fixed"))
    handle = tome.patch_handle(m)
    with tome.generation(m):
        for t in (1.0, 0.8, 0.6):
            call(m, t=t)
        assert handle.held_bytes() > 0  # residuals kept for the steps between refreshes
    assert handle.held_bytes() == 0  # freed with the generation
    tome.remove_patch(m)
