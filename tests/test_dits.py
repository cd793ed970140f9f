"""``tome.dits``: the registry, and proof that a DiT family is one room: a toy DiT (its own
module classes, a diffusers-like attention processor over a joint [text, image] sequence) and
its family are defined and registered in this file alone; ``layout.read`` then reads it,
``tome.apply_patch`` pools it (the auto policy measuring it through the family's inputs) and
``tome.remove_patch`` leaves it bit-identical."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from stubs import fake_clock
from torch import nn

import tome
from tome import attend, dits, kv, layout
from tome.dits.family import text_and_time
from tome.measurements import MeasurementCache, Measurer

TEXT = 6


def heads(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.unflatten(-1, (n, -1)).transpose(1, 2)  # [B, S, C] -> [B, heads, S, D]


class ToyAttnProcessor:
    """The host library's processor: joint attention over [text, image]."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        x = torch.cat([encoder_hidden_states, hidden_states], 1)
        q, k, v = (heads(p(x), attn.heads) for p in (attn.to_q, attn.to_k, attn.to_v))
        out = attn.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))
        n = encoder_hidden_states.shape[1]
        return out[:, n:], out[:, :n]


class ToyAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.heads = n_heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.processor = ToyAttnProcessor()

    def forward(self, hidden_states, encoder_hidden_states=None):
        return self.processor(self, hidden_states, encoder_hidden_states)


class ToyBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(dim), ToyAttention(dim, n_heads)

    def forward(self, hidden_states, encoder_hidden_states, temb):
        img, txt = self.attn(self.norm(hidden_states) + temb[:, None], encoder_hidden_states)
        return hidden_states + img, encoder_hidden_states + txt


class ToyDiT(nn.Module):
    """Called as ``(latent [B, C, H, W], text [B, T, E], timestep 0..1000)``."""

    def __init__(self, channels=4, dim=16, n_heads=2, depth=2, patch=2, text_dim=8):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.text, self.time = nn.Linear(text_dim, dim), nn.Linear(1, dim)
        self.blocks = nn.ModuleList([ToyBlock(dim, n_heads) for _ in range(depth)])
        self.out = nn.Linear(dim, patch * patch * channels)

    def forward(self, latent, text, timestep):
        b, _, hh, ww = latent.shape
        x = self.embed(latent).flatten(2).transpose(1, 2)
        ctx, temb = self.text(text), self.time(timestep.float()[:, None] / 1000)
        for block in self.blocks:
            x, ctx = block(x, ctx, temb)
        p, h, w = self.patch, hh // self.patch, ww // self.patch
        out = self.out(x).view(b, h, w, self.channels, p, p)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(b, self.channels, hh, ww)


# ----------------------------------------------------------------------------- its family

def toy_maths(wrapper, attn, plan, hs, ehs, emb):
    """``ToyAttnProcessor`` with the image keys/values pooled (they start after the text)."""
    n = ehs.shape[1]
    x = torch.cat([ehs, hs], 1)
    q, k, v = (heads(p(x), attn.heads) for p in (attn.to_q, attn.to_k, attn.to_v))
    out = kv.attend_plan(wrapper, attend.sdpa, plan, q, k, v, n, 2)
    out = attn.to_out(out.transpose(1, 2).flatten(2))
    return out[:, n:], out[:, :n]


def toy_inputs(lay, x, size):
    text, temb = text_and_time(x, lay.dit.text_tokens)
    return (), {"hidden_states": x, "encoder_hidden_states": text, "temb": temb}


TOY = dits.Family(
    "toy dit", dits.by_class("ToyDiT"),
    read=lambda m: (dits.Dit(m.patch, True, TEXT, 1.0, False), m.blocks, ()),
    call=dits.latent_call(("latent", 0), ("text", 1), ("timestep", 2)),
    maths={"ToyAttnProcessor": toy_maths}, inputs=toy_inputs)


@pytest.fixture
def toy():
    dits.register(TOY)
    yield TOY
    dits.unregister(TOY.name)


def model_and_inputs():
    torch.manual_seed(0)
    model = ToyDiT().eval()
    g = torch.Generator().manual_seed(1)
    return model, (torch.randn(2, 4, 16, 12, generator=g), torch.randn(2, TEXT, 8, generator=g),
                   torch.full((2,), 500.0))


def run(model, inputs):
    with torch.no_grad():
        return model(*inputs)


def test_an_unregistered_dit_is_not_supported():
    model, _ = model_and_inputs()
    with pytest.raises(layout.UnsupportedModelError, match="ToyDiT"):
        layout.read(model)


def test_layout_reads_the_registered_family(toy):
    model, _ = model_and_inputs()
    read = layout.read(model)
    assert read.family == "toy dit" and read.kind == "DiT" and read.dit.patch == 2
    assert [(b.name, b.level, b.kind) for b in read.blocks] == [
        ("blocks.0", 2, "double"), ("blocks.1", 2, "double")]
    assert dits.find(model) is toy and dits.of(read) is toy
    assert "; toy dit; not other DiTs" in str(layout.not_supported("Other"))  # named there


def pooled_reference(model, inputs, proportional):
    """The toy model's forward written out here, each block's attention over the text keys
    and the image's 2x2 cells (keys and values averaged by loops over the 8x6 token grid,
    row-major), with ``log(tokens in the cell)`` added to the cells' scores where
    ``proportional`` (einsum softmax)."""
    latent, text, timestep = inputs
    b, _, hh, ww = latent.shape
    p, n = model.patch, TEXT
    h, w = hh // p, ww // p
    cells = [[n + i * w + j for i in range(i0, min(i0 + 2, h)) for j in range(j0, min(j0 + 2, w))]
             for i0 in range(0, h, 2) for j0 in range(0, w, 2)]

    def pool(t):  # [B, heads, S, D]: the text rows, then one mean per cell
        return torch.stack([t[:, :, r] for r in range(n)]
                           + [sum(t[:, :, r] for r in c) / len(c) for c in cells], 2)

    def lin(layer, x):
        return x @ layer.weight.T + layer.bias

    with torch.no_grad():
        x = F.conv2d(latent, model.embed.weight, model.embed.bias, stride=p)
        x = x.flatten(2).transpose(1, 2)
        ctx, temb = lin(model.text, text), lin(model.time, timestep.float()[:, None] / 1000)
        for block in model.blocks:
            a = block.attn
            xn = F.layer_norm(x, x.shape[-1:], block.norm.weight, block.norm.bias)
            joint = torch.cat([ctx, xn + temb[:, None]], 1)
            q, k, v = (heads(lin(m, joint), a.heads) for m in (a.to_q, a.to_k, a.to_v))
            kp, vp = pool(k), pool(v)
            bias = torch.tensor([0.0] * n + [math.log(len(c)) if proportional else 0.0
                                             for c in cells])
            scores = torch.einsum("bhqd,bhkd->bhqk", q, kp) / math.sqrt(q.shape[-1]) + bias
            o = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vp)
            o = lin(a.to_out, o.transpose(1, 2).flatten(2))
            x, ctx = x + o[:, n:], ctx + o[:, :n]
        out = lin(model.out, x).view(b, h, w, model.channels, p, p)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(b, model.channels, hh, ww)


@pytest.mark.parametrize("proportional", [True, False])
def test_the_toy_family_pools_and_removal_is_bit_exact(toy, monkeypatch, proportional):
    """A pooled call against the hand-written reference (the recipe's promise), the key
    count, and removal bit for bit."""
    model, inputs = model_and_inputs()
    ref = run(model, inputs)
    keys = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: (
        keys.append(k.shape[2]), sdpa(q, k, v, **kw))[1])
    tome.apply_patch(model, method="downsample", proportional=proportional)
    assert tome.patch_report(model).summary().startswith(
        "ToMe: toy dit DiT, downsample x2; 2/2 blocks pooled")
    out = run(model, inputs)
    assert keys == [TEXT + 4 * 3] * 2  # an 8x6 grid pooled 2x2: 12 image keys
    want = pooled_reference(model, inputs, proportional)
    assert not torch.allclose(want, ref, atol=1e-3)  # the reference pools
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    tome.remove_patch(model)
    assert all(type(b.attn.processor) is ToyAttnProcessor for b in model.blocks)
    assert torch.equal(run(model, inputs), ref)


def test_factor_1_runs_the_family_maths_bit_for_bit(toy):
    model, inputs = model_and_inputs()
    ref = run(model, inputs)
    tome.apply_patch(model, method="downsample", downsample_factor=1)
    try:
        assert torch.equal(run(model, inputs), ref)
    finally:
        tome.remove_patch(model)


def test_the_auto_policy_measures_through_the_family_inputs(toy, tmp_path):
    model, inputs = model_and_inputs()
    ref = run(model, inputs)
    service = Measurer(MeasurementCache(tmp_path / "m.json", say=print), say=print,
                       clock=fake_clock(2.0), rounds=3)
    tome.apply_patch(model, method="downsample", policy="auto", measure=service)
    try:
        run(model, inputs)
        (decision,) = tome.patch_report(model).decisions.values()
        assert decision.merged and "measured 2.00x" in decision.reason
    finally:
        tome.remove_patch(model)
    assert torch.equal(run(model, inputs), ref)


# ----------------------------------------------------------------------------- a ComfyUI family

class ToyComfyDiT(nn.Module):
    """A DiT as a ComfyUI model holds it: called by the model base as ``(x, t, context=,
    transformer_options=)``, every block's joint [text, image] attention through ComfyUI's
    ``optimized_attention`` (the stand-in's) with queries and keys ``[B, heads, S, D]``,
    telling its block in ``transformer_options``."""

    def __init__(self, dim=8, n_heads=2, depth=2, channels=4, patch=2):
        super().__init__()
        self.patch, self.heads, self.channels = patch, n_heads, channels
        self.embed = nn.Conv2d(channels, dim, patch, stride=patch)
        self.text = nn.Linear(12, dim)
        self.qkv = nn.ModuleList([nn.Linear(dim, 3 * dim) for _ in range(depth)])
        self.out = nn.Linear(dim, channels * patch * patch)

    def forward(self, x, timestep, context=None, transformer_options=None, **kwargs):
        from comfy.ldm.modules import attention as comfy_attention
        b, _, hh, ww = x.shape
        p = self.patch
        img = self.embed(x).flatten(2).transpose(1, 2)
        txt = self.text(context)
        for i, layer in enumerate(self.qkv):
            joint = torch.cat([txt, img], 1)
            q, k, v = (heads(t, self.heads) for t in layer(joint).chunk(3, -1))
            o = comfy_attention.optimized_attention(
                q, k, v, self.heads, skip_reshape=True,
                transformer_options={**transformer_options, "block_type": "double",
                                     "block_index": i})
            txt, img = txt + o[:, :txt.shape[1]], img + o[:, txt.shape[1]:]
        out = self.out(img).view(b, hh // p, ww // p, self.channels, p, p)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(b, self.channels, hh, ww)


def toy_spans(model, x, context, conds):
    """Where a model call's tokens sit: the text first, then one frame of the latent's grid."""
    if x.dim() != 4 or context is None:
        return None
    return (context.shape[1], True, 0, 1, x.shape[-2] // model.patch, x.shape[-1] // model.patch,
            0)


TOY_COMFY = dits.Family(
    "toy comfy dit", dits.by_class("ToyComfyDiT"),
    read=lambda m: (dits.Dit(m.patch, True, TEXT, 1000.0, False), list(m.qkv), ()),
    host=dits.HostPoint(dits.COMFYUI, toy_spans))


def comfy_reference(model, x, t, context, proportional):
    """The toy ComfyUI model's forward written out here: each block's attention over the text
    keys and the image's 2x2 cells (loops over the 8x6 token grid, row-major), with
    ``log(tokens in the cell)`` on the cells' scores where ``proportional``."""
    b, _, hh, ww = x.shape
    p, n = model.patch, context.shape[1]
    h, w = hh // p, ww // p
    cells = [[n + i * w + j for i in range(i0, min(i0 + 2, h)) for j in range(j0, min(j0 + 2, w))]
             for i0 in range(0, h, 2) for j0 in range(0, w, 2)]

    def pool(t):
        return torch.stack([t[:, :, r] for r in range(n)]
                           + [sum(t[:, :, r] for r in c) / len(c) for c in cells], 2)

    img = F.conv2d(x, model.embed.weight, model.embed.bias, stride=p).flatten(2).transpose(1, 2)
    txt = context @ model.text.weight.T + model.text.bias
    bias = torch.tensor([0.0] * n + [math.log(len(c)) if proportional else 0.0 for c in cells])
    for layer in model.qkv:
        joint = torch.cat([txt, img], 1)
        q, k, v = (heads(t, model.heads) for t in
                   (joint @ layer.weight.T + layer.bias).chunk(3, -1))
        scores = torch.einsum("bhqd,bhkd->bhqk", q, pool(k)) / math.sqrt(q.shape[-1]) + bias
        o = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), pool(v)).transpose(1, 2)
        o = o.flatten(2)
        txt, img = txt + o[:, :n], img + o[:, n:]
    out = (img @ model.out.weight.T + model.out.bias).view(b, h, w, model.channels, p, p)
    return out.permute(0, 3, 1, 4, 2, 5).reshape(b, model.channels, hh, ww)


@pytest.mark.parametrize("proportional", [True, False])
def test_a_comfyui_family_is_one_file_and_one_registration(monkeypatch, proportional):
    """A ComfyUI family defined and registered here alone (its ``host`` point: how a call
    places its tokens) is pooled by the ToMe node through ComfyUI's attention override in the
    stand-in: one model call against the hand-written reference; the clone without the
    node is untouched."""
    import sys
    from pathlib import Path
    stub = str(Path(__file__).resolve().parent / "comfy_stub")
    monkeypatch.syspath_prepend(stub)
    for name in [m for m in sys.modules if m == "comfy" or m.startswith("comfy.")]:
        if not getattr(sys.modules[name], "__file__", "") or \
                not str(sys.modules[name].__file__).startswith(stub):
            monkeypatch.delitem(sys.modules, name)
    from comfy.model_base import BaseModel
    from comfy.model_patcher import ModelPatcher
    from comfy.model_sampling import ModelSamplingFlux
    from comfy.sampling import dit_sample

    from tome.comfy import nodes
    dits.register(TOY_COMFY)
    try:
        torch.manual_seed(0)
        base = ModelPatcher(BaseModel(ToyComfyDiT().eval(), ModelSamplingFlux(shift=1.0)))
        g = torch.Generator().manual_seed(1)
        noise, ctx = torch.randn(1, 4, 16, 12, generator=g), torch.randn(1, TEXT, 12,
                                                                        generator=g)
        sigmas = torch.tensor([1.0, 0.0])  # one model call at sigma 1: x is the noise
        ref = dit_sample(base, noise, ctx, sigmas)
        (patched,) = nodes.ToMePatch().patch(
            base, preset="custom", method="downsample", downsample_factor=2, policy="fixed",
            proportional=proportional)
        out = dit_sample(patched, noise, ctx, sigmas)
        model = base.model.diffusion_model
        # flow: denoised = x - sigma * out, timestep = sigma * 1000; x = noise at sigma 1
        want = noise - comfy_reference(model, noise, None, ctx, proportional)
        assert not torch.allclose(want, ref, atol=1e-3)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(dit_sample(base, noise, ctx, sigmas), ref)
    finally:
        dits.unregister(TOY_COMFY.name)
