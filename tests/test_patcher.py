"""The ModelPatcher adapter, against a stand-in of the patcher contract the Forge family and
ComfyUI share (docs/webui.md, "What happens during a generation"):
``clone()``, ``set_model_attn1_patch(fn(n, k, v, extra))``, ``set_model_attn1_output_patch(fn(n,
extra))``, and a block that calls them around self-attention with ``extra["original_shape"]``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import TINY_SD15, TINY_SDXL, ldm_unet
from stubs import FluxLike, Patcher, forge_unet, self_attention_block

import tome
from tome import merge
from tome import patcher as mp
from tome.adapters import patch_model_patcher as patch_unet
from tome.config import ToMeConfig


@pytest.fixture
def patcher():
    return Patcher(ldm_unet(TINY_SD15))


def test_merges_self_attention_like_the_plan(patcher):
    x = torch.randn(2, 16 * 16, 8)
    unet, patch = patch_unet(patcher, ToMeConfig(ratio=0.5, use_rand=False))
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
    unet, patch = patch_unet(patcher, ToMeConfig(ratio=0.5))
    x = torch.randn(2, 8 * 8, 8)  # a ds2 block of a 16x16 latent: not merged at auto (1)
    base = self_attention_block(Patcher(None), x, (2, 4, 16, 16))
    assert torch.equal(self_attention_block(unet, x, (2, 4, 16, 16)), base)
    ctx = torch.randn(2, 5, 8)  # disable_self_attn: attn1 attends to the context, queries merge
    out = self_attention_block(unet, torch.randn(2, 256, 8), (2, 4, 16, 16), cross=ctx)
    assert out.shape == (2, 256, 8)


def test_downsample_pools_keys_and_values(patcher):
    unet, patch = patch_unet(patcher, ToMeConfig(method="downsample", downsample_factor=2))
    seen = []
    unet.set_model_attn1_patch(lambda n, k, v, e: (seen.append(k.shape), (n, k, v))[1])
    x = torch.randn(2, 256, 8)
    assert self_attention_block(unet, x, (2, 4, 16, 16)).shape == x.shape
    assert seen == [torch.Size([2, 64, 8])]


def test_idempotent_inactive_and_seeded(patcher):
    unet, patch = patch_unet(patcher, ToMeConfig(ratio=0.5, seed=3))
    assert patch_unet(unet, ToMeConfig(ratio=0.5, seed=3)) == (unet, patch)
    assert len(unet.patches["attn1_patch"]) == 1
    same, report = patch_unet(patcher, ToMeConfig(ratio=0.0))
    assert same is patcher and report.nothing == "ToMe: these settings change nothing"
    x = torch.randn(2, 256, 8)
    state = torch.get_rng_state()
    a = self_attention_block(unet, x, (2, 4, 16, 16), sigma=2.0)
    b = self_attention_block(patch_unet(patcher, ToMeConfig(ratio=0.5, seed=3))[0], x,
                             (2, 4, 16, 16), sigma=2.0)
    assert torch.equal(a, b) and torch.equal(torch.get_rng_state(), state)


def test_blocks_whose_attn1_another_patch_replaces_are_left_alone(patcher):
    """Forge's Self-Attention Guidance replaces the middle block's attn1 to record its full
    attention map, on a clone of our patcher made after us; with max_downsample 8 merging
    there failed inside SAG (real Forge: HTTP 500 in create_blur_map)."""
    host = {}
    ours, patch = patch_unet(patcher, ToMeConfig(ratio=0.5, max_downsample=8),
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
    ours, patch = patch_unet(patcher, ToMeConfig(ratio=0.5, max_downsample=1))
    ours.set_model_attn1_replace(lambda q, k, v, extra: F.scaled_dot_product_attention(q, k, v),
                                 "middle", 0, 0)
    x = torch.randn(2, 4 * 4, 8)  # the middle block of a 32x32 latent (ds8)
    self_attention_block(ours, x, (2, 4, 32, 32), block=("middle", 0))
    assert patch.skipped == []


def test_a_replacement_keyed_by_block_name_and_number_counts_too(patcher):
    """Forge and ldm_patched look a replacement up by (name, number, index), then (name,
    number)."""
    ours, patch = patch_unet(patcher, ToMeConfig(ratio=0.5, max_downsample=8))
    to = ours.model_options["transformer_options"]
    to.setdefault("patches_replace", {}).setdefault("attn1", {})[("middle", 0)] = print
    x = torch.randn(2, 4 * 4, 8)  # the middle block of a 32x32 latent (ds8)
    plain = self_attention_block(patcher, x, (2, 4, 32, 32), block=("middle", 0))
    left = self_attention_block(ours, x, (2, 4, 32, 32), block=("middle", 0))
    assert torch.equal(left, plain)  # the stand-in looks up (name, number, index) only
    assert [block for block, _ in patch.skipped] == [("middle", 0, 0)]


def test_both_adapters_report_alike(patcher):
    """One report from both adapters: the same family, levels and max downsample, and
    settings that merge nothing as data (``nothing``), never an exception on one path and a
    warning on the other."""
    from tome import patch

    for cfg in (ToMeConfig(ratio=0.5), ToMeConfig(ratio=0.5, max_downsample=8)):
        unet = ldm_unet(TINY_SD15)
        hooks = patch.apply(unet, cfg)
        patch.remove(unet)
        _, attn1 = patch_unet(Patcher(ldm_unet(TINY_SD15)), cfg)
        assert type(hooks) is type(attn1) and hooks.nothing is attn1.nothing is None
        fields = ("family", "max_downsample", "levels", "total_blocks", "unmergeable")
        assert [getattr(hooks, f) for f in fields] == [getattr(attn1, f) for f in fields]
        assert hooks.planner.levels == attn1.planner.levels == sorted(hooks.levels)
    deep = ToMeConfig(ratio=0.5, max_downsample=1)
    unet = Patcher(ldm_unet(TINY_SDXL))  # SDXL has no block at full resolution
    same, report = patch_unet(unet, deep)
    assert same is unet and not unet.patches["attn1_patch"]
    assert report.nothing.startswith("ToMe: max_downsample=1 merges nothing on this model")
    hooks = patch.apply(unet.model.diffusion_model, deep)
    patch.remove(unet.model.diffusion_model)
    assert hooks.nothing == report.nothing


def test_a_model_without_a_unet_is_refused_and_left_unpatched():
    dit = Patcher(FluxLike())
    with pytest.raises(tome.UnsupportedModelError, match="FluxLike has no UNet transformer"):
        patch_unet(dit, ToMeConfig(ratio=0.5))
    assert not dit.patches["attn1_patch"] and getattr(dit, mp.MARK, None) is None


# ----------------------------------------------------------------------------- measuring

def test_run_block_merges_as_the_patched_forge_block_does():
    from tome.plan import Planner

    unet = forge_unet()
    block = next(m for m in unet.modules() if type(m).__name__ == "ForgeBlock")
    x, ctx = torch.randn(2, 256, 32), torch.randn(2, 7, 32)
    cfg = ToMeConfig(ratio=0.5, use_rand=False)
    planner = Planner(cfg, 1)
    plan = planner.plan(planner.begin((16, 16), x.device, None), block.norm1(x))
    ours, patch = patch_unet(Patcher(unet), cfg)
    options = {"patches": ours.patches, "original_shape": [2, 4, 16, 16], "block": ("input", 1),
               "block_index": 0}
    expected = block(x, context=ctx, transformer_options=options)
    torch.testing.assert_close(mp.run_block(block, x, ctx, planner, plan), expected)
    plain = block(x, context=ctx, transformer_options={})
    assert torch.equal(mp.run_block(block, x, ctx, planner, None), plain)


def test_forge_measures_at_the_first_call_of_a_size(tmp_path):
    from stubs import fake_clock

    from tome.measurements import MeasurementCache, Measurer

    calls, said = [], []
    service = Measurer(MeasurementCache(tmp_path / "m.json"), say=said.append, rounds=1,
                       clock=fake_clock(2.0, calls))
    ours, patch = patch_unet(Patcher(forge_unet()), ToMeConfig(policy="auto"),
                                   measurer=service)
    x = torch.randn(2, 256, 8)
    out = self_attention_block(ours, x, (2, 4, 16, 16))
    assert calls and patch.planner.measured[(1, 16, 16)][1][0] == 2.0  # (frames, h, w)
    assert len(said) == 1 and "ToMe: measured 128x128 px, batch 2" in said[0]
    assert patch.tokens == {1: (256, 128)}  # 256 tokens: merged because it was measured faster
    calls.clear()
    assert torch.equal(self_attention_block(ours, x, (2, 4, 16, 16)), out) and not calls


def test_forge_measures_under_inference_mode_then_again_under_no_grad(tmp_path, monkeypatch):
    """Forge samples under ``torch.inference_mode``; Settings > ToMe > Measure now runs under
    ``torch.no_grad`` afterwards, through ``run_block``."""
    from tome import measure as M
    from tome import measurements as C

    monkeypatch.setattr(M, "_flush", {})
    said = []
    service = C.Measurer(C.MeasurementCache(tmp_path / "m.json"), say=said.append, rounds=1,
                         warmup=0)
    unet = forge_unet()
    ours, patch = patch_unet(Patcher(unet), ToMeConfig(policy="auto"), measurer=service)
    with torch.inference_mode():
        self_attention_block(ours, torch.randn(2, 256, 8), (2, 4, 16, 16))
    with torch.no_grad():
        m = service.get(unet, (24, 24), 2, ToMeConfig(), runner=mp.run_block)
    assert m is not None and [s[:26] for s in said] == ["ToMe: measured 128x128 px,",
                                                        "ToMe: measured 192x192 px,"]


@pytest.mark.parametrize("predictor", [True, False])
@pytest.mark.parametrize(("start", "end", "expect"), [
    (0.0, 0.5, [True, True, False, False]),
    (0.5, 1.0, [False, False, True, True]),
])
def test_forge_window_in_sigmas(patcher, predictor, start, end, expect):
    """Forge hands the k-diffusion sigma (SD15_SIGMAS: progress 0, 1/3, 2/3, 1): the window is
    converted with the model's ``predictor`` (SD's own schedule where it has none)."""
    from stubs import SD15_SIGMAS
    if not predictor:
        del patcher.model.predictor
    unet, report = patch_unet(patcher, ToMeConfig(ratio=0.5, start=start, end=end))
    x = torch.randn(2, 256, 8)
    merged = [not torch.equal(self_attention_block(unet, x, (2, 4, 16, 16), sigma=s),
                              self_attention_block(Patcher(None), x, (2, 4, 16, 16), sigma=s))
              for s in SD15_SIGMAS[:-1]]
    assert merged == expect
    assert report.steps() == f"steps {start:g}-{end:g}: merged in 2 of 4 steps"
    assert f"steps {start:g}-{end:g} (sigma " in report.summary()
