"""The Forge adapter, against a stand-in of Forge's patcher contract (webui-host-contract.md):
``clone()``, ``set_model_attn1_patch(fn(n, k, v, extra))``, ``set_model_attn1_output_patch(fn(n,
extra))``, and a block that calls them around self-attention with ``extra["original_shape"]``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from models import TINY_SD15, ldm_unet

from tome import forge, merge
from tome.config import ToMeConfig


class Patcher:
    """Forge's UnetPatcher as the contract describes it: clones share the model; attn1
    replacements live in ``model_options["transformer_options"]["patches_replace"]``."""

    def __init__(self, diffusion_model):
        self.model = torch.nn.Module()
        self.model.diffusion_model = diffusion_model
        self.patches = {"attn1_patch": [], "attn1_output_patch": []}
        self.model_options = {"transformer_options": {}}

    def clone(self):
        c = copy.copy(self)
        c.patches = {k: list(v) for k, v in self.patches.items()}
        c.model_options = copy.deepcopy(self.model_options)
        return c

    def set_model_attn1_replace(self, fn, block_name, number, index):
        to = self.model_options["transformer_options"]
        to.setdefault("patches_replace", {}).setdefault("attn1", {})[
            (block_name, number, index)] = fn

    def set_model_attn1_patch(self, fn):
        self.patches["attn1_patch"].append(fn)

    def set_model_attn1_output_patch(self, fn):
        self.patches["attn1_output_patch"].append(fn)


def self_attention_block(patcher, x, shape, sigma=1.0, cross=None, block=("input", 1), index=0):
    """What Forge's BasicTransformerBlock does around attn1 (norm, patches, attention or its
    replacement). As in Forge, ``patches_replace`` is not among the patches' ``extra``."""
    n = F.layer_norm(x, x.shape[-1:])
    k = v = n if cross is None else cross
    extra = {"original_shape": list(shape), "sigmas": torch.tensor([sigma]), "block": block,
             "block_index": index}
    for p in patcher.patches["attn1_patch"]:
        n, k, v = p(n, k, v, extra)
    replace = patcher.model_options["transformer_options"].get("patches_replace", {})
    attention = replace.get("attn1", {}).get((*block, index))
    out = attention(n, k, v, extra) if attention else F.scaled_dot_product_attention(n, k, v)
    for p in patcher.patches["attn1_output_patch"]:
        out = p(out, extra)
    return x + out


@pytest.fixture
def patcher():
    return Patcher(ldm_unet(TINY_SD15))


def test_merges_self_attention_like_the_plan(patcher):
    x = torch.randn(2, 16 * 16, 8)
    unet, patch = forge.patch_unet(patcher, ToMeConfig(ratio=0.5, use_rand=False))
    assert patch.max_downsample == 1 and not patcher.patches["attn1_patch"]  # original untouched
    out = self_attention_block(unet, x, (2, 4, 16, 16))
    n = F.layer_norm(x, x.shape[-1:])
    src, dst = merge.partition(16, 16, 2, 2)
    plan = merge.Plan(n, src, dst, 128)
    m = plan.merge(n)
    expected = x + plan.unmerge(F.scaled_dot_product_attention(m, m, m))
    torch.testing.assert_close(out, expected)
    assert patch.tokens == {1: (256, 128)}


def test_deeper_levels_and_cross_attention_attn1(patcher):
    unet, patch = forge.patch_unet(patcher, ToMeConfig(ratio=0.5))
    x = torch.randn(2, 8 * 8, 8)  # a ds2 block of a 16x16 latent: not merged at auto (1)
    base = self_attention_block(Patcher(None), x, (2, 4, 16, 16))
    assert torch.equal(self_attention_block(unet, x, (2, 4, 16, 16)), base)
    ctx = torch.randn(2, 5, 8)  # disable_self_attn: attn1 attends to the context, queries merge
    out = self_attention_block(unet, torch.randn(2, 256, 8), (2, 4, 16, 16), cross=ctx)
    assert out.shape == (2, 256, 8)


def test_downsample_pools_keys_and_values(patcher):
    unet, patch = forge.patch_unet(patcher, ToMeConfig(method="downsample", downsample_factor=2))
    seen = []
    unet.set_model_attn1_patch(lambda n, k, v, e: (seen.append(k.shape), (n, k, v))[1])
    x = torch.randn(2, 256, 8)
    assert self_attention_block(unet, x, (2, 4, 16, 16)).shape == x.shape
    assert seen == [torch.Size([2, 64, 8])]


def test_idempotent_inactive_and_seeded(patcher):
    unet, patch = forge.patch_unet(patcher, ToMeConfig(ratio=0.5, seed=3))
    assert forge.patch_unet(unet, ToMeConfig(ratio=0.5, seed=3)) == (unet, patch)
    assert len(unet.patches["attn1_patch"]) == 1
    assert forge.patch_unet(patcher, ToMeConfig(ratio=0.0)) == (patcher, None)
    x = torch.randn(2, 256, 8)
    state = torch.get_rng_state()
    a = self_attention_block(unet, x, (2, 4, 16, 16), sigma=2.0)
    b = self_attention_block(forge.patch_unet(patcher, ToMeConfig(ratio=0.5, seed=3))[0], x,
                             (2, 4, 16, 16), sigma=2.0)
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), state)


def test_blocks_whose_attn1_another_patch_replaces_are_left_alone(patcher):
    """Forge's Self-Attention Guidance replaces the middle block's attn1 to record its full
    attention map, on a clone of our patcher made after us; with max_downsample 8 merging
    there failed inside SAG (real Forge: HTTP 500 in create_blur_map)."""
    host = {}
    ours, patch = forge.patch_unet(patcher, ToMeConfig(ratio=0.5, max_downsample=8),
                                   lambda: host["unet"])
    seen = []

    def sag_attention(q, k, v, extra):  # records the map, so it needs every token
        seen.append(q.shape[1])
        return F.scaled_dot_product_attention(q, k, v)

    sag = ours.clone()
    sag.set_model_attn1_replace(sag_attention, "middle", 0, 0)
    host["unet"] = sag                    # what the WebUI samples with: SAG's clone
    x = torch.randn(2, 4 * 4, 8)          # the middle block of a 32x32 latent (ds8)
    base = self_attention_block(Patcher(None), x, (2, 4, 32, 32), block=("middle", 0))
    out = self_attention_block(sag, x, (2, 4, 32, 32), block=("middle", 0))
    assert seen == [16] and torch.equal(out, base)
    assert patch.skipped == [(("middle", 0, 0), "attn1 replaced by another patch (e.g. "
                                                "Self-Attention Guidance)")]
    host["unet"] = ours                   # without SAG the middle block merges
    merged = self_attention_block(ours, x, (2, 4, 32, 32), block=("middle", 0))
    assert not torch.equal(merged, base)


def test_a_block_that_would_not_be_merged_is_never_reported_as_skipped(patcher):
    """reForge's SAG replaces the middle block's attn1; with max_downsample 1 that block would
    never be merged, so no 'skipped' note may claim otherwise."""
    ours, patch = forge.patch_unet(patcher, ToMeConfig(ratio=0.5, max_downsample=1))
    ours.set_model_attn1_replace(lambda q, k, v, extra: F.scaled_dot_product_attention(q, k, v),
                                 "middle", 0, 0)
    x = torch.randn(2, 4 * 4, 8)  # the middle block of a 32x32 latent (ds8)
    self_attention_block(ours, x, (2, 4, 32, 32), block=("middle", 0))
    assert patch.skipped == []


def test_a_replacement_keyed_by_block_name_and_number_counts_too(patcher):
    """Forge and ldm_patched look a replacement up by (name, number, index), then (name,
    number)."""
    ours, patch = forge.patch_unet(patcher, ToMeConfig(ratio=0.5, max_downsample=8))
    to = ours.model_options["transformer_options"]
    to.setdefault("patches_replace", {}).setdefault("attn1", {})[("middle", 0)] = print
    assert patch._replaced(("middle", 0, 0), {})


class FluxLike(torch.nn.Module):
    """A stand-in of the DiTs Forge Neo also runs (Flux, Chroma, Qwen-Image, Lumina, Wan,
    Z-Image): transformer blocks that are not ``BasicTransformerBlock`` and never call the
    attn1 patches."""

    def __init__(self):
        super().__init__()
        self.double_blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.single_blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])


def test_a_model_without_a_unet_is_refused_and_left_unpatched():
    dit = Patcher(FluxLike())
    with pytest.raises(forge.UnsupportedModelError, match="FluxLike is not a UNet"):
        forge.patch_unet(dit, ToMeConfig(ratio=0.5))
    assert not dit.patches["attn1_patch"] and getattr(dit, forge.MARK, None) is None


# ----------------------------------------------------------------------------- measuring

def forge_unet():
    """The tiny UNet with Forge's block contract: ``forward(x, context, transformer_options)``
    calling ``patches["attn1_patch"]`` with (n, k, v) right before attn1 and
    ``patches["attn1_output_patch"]`` right after (webui-host-contract.md; Forge Classic's
    ``ldm_patched`` block behaves the same)."""
    from ldm.modules.attention import BasicTransformerBlock

    class ForgeBlock(BasicTransformerBlock):
        def forward(self, x, context=None, transformer_options={}):  # noqa: B006 (as Forge)
            patches = transformer_options.get("patches", {})
            extra = {k: v for k, v in transformer_options.items()
                     if k not in ("patches", "patches_replace")}
            n = self.norm1(x)
            k = v = n
            for p in patches.get("attn1_patch", []):
                n, k, v = p(n, k, v, extra)
            q = self.attn1.to_q(n)
            k, v = self.attn1.to_k(k), self.attn1.to_v(v)
            h = self.attn1.heads
            split = [t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*split).transpose(1, 2).flatten(2)
            out = self.attn1.to_out(out)
            for p in patches.get("attn1_output_patch", []):
                out = p(out, extra)
            x = x + out
            x = self.attn2(self.norm2(x), context=context) + x
            return self.ff(self.norm3(x)) + x

    unet = ldm_unet(TINY_SD15)
    for m in unet.modules():
        if type(m) is BasicTransformerBlock:
            m.__class__ = ForgeBlock
    return unet


def test_run_block_merges_as_the_patched_forge_block_does():
    from tome.plan import Planner

    unet = forge_unet()
    block = next(m for m in unet.modules() if type(m).__name__ == "ForgeBlock")
    x, ctx = torch.randn(2, 256, 32), torch.randn(2, 7, 32)
    cfg = ToMeConfig(ratio=0.5, use_rand=False)
    planner = Planner(cfg, 1)
    plan = planner.plan(planner.begin((16, 16), x.device, None), block.norm1(x))
    ours, patch = forge.patch_unet(Patcher(unet), cfg)
    options = {"patches": ours.patches, "original_shape": [2, 4, 16, 16], "block": ("input", 1),
               "block_index": 0}
    expected = block(x, context=ctx, transformer_options=options)
    torch.testing.assert_close(forge.run_block(block, x, ctx, planner, plan), expected)
    plain = block(x, context=ctx, transformer_options={})
    assert torch.equal(forge.run_block(block, x, ctx, planner, None), plain)


def test_forge_measures_at_the_first_call_of_a_size(tmp_path):
    from test_plan import fake_clock

    from tome.measure import MeasurementCache, Measurer

    calls, said = [], []
    service = Measurer(MeasurementCache(tmp_path / "m.json"), say=said.append, rounds=1,
                       clock=fake_clock(2.0, calls))
    ours, patch = forge.patch_unet(Patcher(forge_unet()), ToMeConfig(policy="auto"),
                                   measurer=service)
    x = torch.randn(2, 256, 8)
    out = self_attention_block(ours, x, (2, 4, 16, 16))
    assert calls and patch.planner.measured[(16, 16)][1][0] == 2.0
    assert len(said) == 1 and "ToMe: measured 128x128 px, batch 2" in said[0]
    assert patch.tokens == {1: (256, 128)}  # 256 tokens: merged because it was measured faster
    calls.clear()
    assert torch.equal(self_attention_block(ours, x, (2, 4, 16, 16)), out) and not calls


def test_forge_measures_under_inference_mode_then_again_under_no_grad(tmp_path, monkeypatch):
    """Forge samples under ``torch.inference_mode``; Settings > ToMe > Measure now runs under
    ``torch.no_grad`` afterwards, through ``run_block``."""
    from tome import measure as M

    monkeypatch.setattr(M, "_flush", {})
    said = []
    service = M.Measurer(M.MeasurementCache(tmp_path / "m.json"), say=said.append, rounds=1,
                         warmup=0)
    unet = forge_unet()
    ours, patch = forge.patch_unet(Patcher(unet), ToMeConfig(policy="auto"), measurer=service)
    with torch.inference_mode():
        self_attention_block(ours, torch.randn(2, 256, 8), (2, 4, 16, 16))
    with torch.no_grad():
        m = service.get(unet, (24, 24), 2, ToMeConfig(), runner=forge.run_block)
    assert m is not None and [s[:26] for s in said] == ["ToMe: measured 128x128 px,",
                                                        "ToMe: measured 192x192 px,"]
