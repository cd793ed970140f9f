"""``tome.patch`` (the library's hook adapter) on real ldm and diffusers UNets, against real
tomesd."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import tomesd
import torch
from models import (
    SD15,
    TINY_SD15,
    TINY_SDXL,
    Wrapper,
    diffusers_unet,
    ldm_inputs,
    ldm_unet,
    run,
    snapshot,
)
from torch import nn

import tome
from tome import merge

# --------------------------------------------------------------------------- tomesd oracle

@pytest.mark.parametrize("subs", [dict(), dict(merge_crossattn=True, merge_mlp=True)])
@pytest.mark.parametrize("ratio", [0.3, 0.5, 0.75])
def test_matches_tomesd_ldm(sd15, inputs, ratio, subs):
    wrapped = Wrapper(sd15)
    base = run(sd15, *inputs)
    tome.apply_patch(wrapped, ratio=ratio, use_rand=False, share="block", **subs)
    ours = run(sd15, *inputs)
    tome.remove_patch(wrapped)
    tomesd.apply_patch(wrapped, ratio=ratio, use_rand=False, **subs)
    ref = run(sd15, *inputs)
    tomesd.remove_patch(wrapped)
    assert (ours - base).abs().max() > 1e-3  # merging really changed something
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind,max_ds", [("sd15", 1), ("sdxl", 2)])
def test_matches_tomesd_diffusers(kind, max_ds):
    unet = diffusers_unet(kind)
    x, t, c = ldm_inputs(2, 32, 32)
    base = run(unet, x, t, c)
    tome.apply_patch(unet, ratio=0.5, use_rand=False, max_downsample=max_ds, share="block")
    ours = run(unet, x, t, c)
    tome.remove_patch(unet)
    tomesd.apply_patch(unet, ratio=0.5, use_rand=False, max_downsample=max_ds)
    ref = run(unet, x, t, c)
    tomesd.remove_patch(unet)
    assert (ours - base).abs().max() > 1e-3
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_matches_tomesd_full_sd15_shape():
    """The real SD1.5 UNet (860M parameters, 16 blocks) at a 16x16 latent."""
    unet = ldm_unet(SD15)
    x, t, c = ldm_inputs(2, 16, 16, context_dim=768)
    tome.apply_patch(unet, ratio=0.5, use_rand=False, share="block")
    report = tome.patch_report(unet)
    assert (report.total_blocks, report.levels) == (16, {1: 5})
    ours = run(unet, x, t, c)
    tome.remove_patch(unet)
    wrapped = Wrapper(unet)
    tomesd.apply_patch(wrapped, ratio=0.5, use_rand=False)
    ref = run(unet, x, t, c)
    tomesd.remove_patch(wrapped)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


def test_matching_function_matches_tomesd():
    g = torch.Generator().manual_seed(0)
    metric = torch.randn(2, 24 * 20, 16, generator=g)
    x = torch.randn(2, 24 * 20, 8, generator=g)
    for no_rand in (True, False):
        m1, u1 = merge.bipartite_soft_matching_random2d(
            metric, 20, 24, 2, 2, 200, no_rand, torch.Generator().manual_seed(5))
        m2, u2 = tomesd.merge.bipartite_soft_matching_random2d(
            metric, 20, 24, 2, 2, 200, no_rand, torch.Generator().manual_seed(5))
        torch.testing.assert_close(m1(x).sort(1).values, m2(x).sort(1).values)
        torch.testing.assert_close(u1(m1(x)), u2(m2(x)))


# --------------------------------------------------------------------------- exact restore

def test_ratio_zero_is_bit_identical(sd15, inputs):
    base = run(sd15, *inputs)
    tome.apply_patch(sd15, ratio=0.0)
    assert torch.equal(run(sd15, *inputs), base)
    tome.remove_patch(sd15)


def test_remove_restores_everything(sd15, inputs):
    before, base = snapshot(sd15), run(sd15, *inputs)
    tome.apply_patch(sd15, ratio=0.5, merge_crossattn=True, merge_mlp=True)
    assert tome.is_patched(sd15)
    run(sd15, *inputs)
    tome.remove_patch(sd15)
    assert not tome.is_patched(sd15)
    assert snapshot(sd15) == before
    assert torch.equal(run(sd15, *inputs), base)


def test_patching_twice_is_idempotent(sd15, inputs):
    tome.apply_patch(sd15, ratio=0.5, seed=1)
    once, hooks = run(sd15, *inputs), snapshot(sd15)
    tome.apply_patch(sd15, ratio=0.5, seed=1)
    assert snapshot(sd15) == hooks
    assert torch.equal(run(sd15, *inputs), once)
    tome.remove_patch(sd15)


def test_remove_is_a_noop_when_unpatched(sd15):
    before = snapshot(sd15)
    tome.remove_patch(sd15)
    assert snapshot(sd15) == before


# --------------------------------------------------------------------------- randomness

def test_seeded_and_global_rng_untouched(sd15, inputs):
    tome.apply_patch(sd15, ratio=0.5, seed=7)
    state = torch.get_rng_state()
    a = run(sd15, *inputs)
    assert torch.equal(torch.get_rng_state(), state)
    b = run(sd15, *inputs)  # same call again: same partition, not a drifting generator
    tome.apply_patch(sd15, ratio=0.5, seed=8)
    c = run(sd15, *inputs)
    tome.remove_patch(sd15)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


FRESH = """
import sys, hashlib, torch
sys.path.insert(0, "tests")
torch.set_num_threads(1)
from models import ldm_unet, ldm_inputs
import tome
u = ldm_unet(); x, t, c = ldm_inputs(2, 32, 32)
tome.apply_patch(u, ratio=0.5, seed=123)
with torch.no_grad():
    print(hashlib.sha256(u(x, t, c).numpy().tobytes()).hexdigest())
"""


def test_seed_reproducible_in_fresh_process(sd15, inputs):
    outs = {subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert len(outs) == 1


@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_any_batch_size_matches_per_item(sd15, batch):
    """Each image gets the same merge whatever it is batched with: no odd-batch artifacts."""
    x, t, c = ldm_inputs(batch, 24, 24, seed=batch)
    tome.apply_patch(sd15, ratio=0.5, seed=3)
    together = run(sd15, x, t, c)
    alone = torch.cat([run(sd15, x[i:i + 1], t[i:i + 1], c[i:i + 1]) for i in range(batch)])
    tome.remove_patch(sd15)
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h,w", [(8, 8), (27, 45), (17, 16), (9, 31)])
def test_odd_and_tiny_latents(h, w):
    """diffusers UNets accept any latent size; none of these divide evenly into 2x2 cells."""
    unet = diffusers_unet("sd15")
    x, t, c = ldm_inputs(2, h, w)
    base = run(unet, x, t, c)
    tome.apply_patch(unet, ratio=0.5, seed=0)
    out = run(unet, x, t, c)
    tokens = tome.patch_report(unet).tokens
    tome.remove_patch(unet)
    assert out.shape == base.shape and torch.isfinite(out).all()
    assert tokens[1] == (h * w, int(h * w * 0.5))


@pytest.mark.parametrize("sx,sy,max_ds", [(3, 3, 1), (2, 2, 8), (3, 2, 4)])
def test_strides_that_do_not_divide_the_grid(sd15, sx, sy, max_ds):
    x, t, c = ldm_inputs(2, 40, 24)  # grids 40x24, 20x12, 10x6, 5x3
    tome.apply_patch(sd15, ratio=0.5, sx=sx, sy=sy, max_downsample=max_ds, seed=0)
    out = run(sd15, x, t, c)
    tokens = tome.patch_report(sd15).tokens
    tome.remove_patch(sd15)
    assert torch.isfinite(out).all() and max(tokens) == max_ds


def test_1080p_grid_merge_roundtrip():
    """A 1920x1080 image: a 135x240 latent, not divisible by the stride."""
    h, w = 135, 240
    metric = torch.randn(1, h * w, 8)
    m, u = merge.bipartite_soft_matching_random2d(
        metric, w, h, 2, 2, int(h * w * 0.5), generator=torch.Generator().manual_seed(0))
    merged = m(metric)
    assert merged.shape == (1, h * w - int(h * w * 0.5), 8)
    restored = u(merged)
    assert restored.shape == metric.shape
    same = (restored == metric).all(-1)
    # Untouched tokens come back exactly: the sources left unmerged (16200 kept, of which
    # 67 x 120 destinations), plus destinations no source joined; the same tokens as tomesd's
    # own merge with the same generator.
    import tomesd.merge
    m2, u2 = tomesd.merge.bipartite_soft_matching_random2d(
        metric, w, h, 2, 2, int(h * w * 0.5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(same, (u2(m2(metric)) == metric).all(-1))
    assert same.sum() >= h * w - int(h * w * 0.5) - (h // 2) * (w // 2)


# --------------------------------------------------------------------------- SDXL and levels

def test_sdxl_merges_by_default():
    for unet in (ldm_unet(TINY_SDXL), diffusers_unet("sdxl")):
        x, t, c = ldm_inputs(2, 32, 32)
        base = run(unet, x, t, c)
        tome.apply_patch(unet, ratio=0.5)
        report = tome.patch_report(unet)
        out = run(unet, x, t, c)
        tome.remove_patch(unet)
        assert report.max_downsample == 2 and report.levels.get(2, 0) > 0, report.summary()
        assert 2 in report.tokens and not torch.equal(out, base)


def test_explicit_setting_that_merges_nothing_warns():
    unet = ldm_unet(TINY_SDXL)
    with pytest.warns(UserWarning, match="merges nothing"):
        tome.apply_patch(unet, ratio=0.5, max_downsample=1)
    assert tome.patch_report(unet).patched_blocks == 0
    tome.remove_patch(unet)


def test_sd15_defaults_are_tomesd_defaults(sd15):
    tome.apply_patch(sd15)
    report = tome.patch_report(sd15)
    tome.remove_patch(sd15)
    assert report.max_downsample == 1 and report.config.ratio == 0.5
    assert "5/16 blocks" in report.summary()


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,match", [
    (dict(ratio=0.8), r"\[0, 0.75\]"),
    (dict(ratio=0.95, sx=4, sy=4), r"\[0, 0.9375\]"),
    (dict(ratio=-0.1), "ratio"),
    (dict(ratio=float("nan")), "ratio"),
    (dict(sx=0), "sx"),
    (dict(sy=1.5), "sy"),
    (dict(sx="2"), "sx"),
    (dict(max_downsample=3), "max_downsample"),
    (dict(method="kmeans"), "method"),
    (dict(start=0.8, end=0.2), "start"),
])
def test_bad_settings_fail_early_and_leave_model_untouched(sd15, inputs, kwargs, match):
    before, base = snapshot(sd15), run(sd15, *inputs)
    with pytest.raises(ValueError, match=match):
        tome.apply_patch(sd15, **kwargs)
    assert snapshot(sd15) == before
    assert torch.equal(run(sd15, *inputs), base)


def test_bad_settings_keep_a_previous_patch(sd15, inputs):
    tome.apply_patch(sd15, ratio=0.5, seed=2)
    before = run(sd15, *inputs)
    with pytest.raises(ValueError):
        tome.apply_patch(sd15, ratio=2.0)
    assert torch.equal(run(sd15, *inputs), before)
    tome.remove_patch(sd15)


@pytest.mark.parametrize("obj", [object(), nn.Linear(2, 2), "unet"])
def test_unknown_model_says_what_was_expected(obj):
    with pytest.raises(tome.UnsupportedModelError, match=r"has no UNet transformer blocks to "
                       r"merge and is not a DiT it can pool \(ToMe merges SD1, SD2 and SDXL "
                       r"UNets and pools .*; expected an ldm/sgm"):
        tome.apply_patch(obj)


def test_unet_without_transformer_blocks_is_refused():
    unet = nn.Module()
    unet.input_blocks = nn.ModuleList([nn.Conv2d(4, 4, 3)])
    with pytest.raises(tome.UnsupportedModelError, match="Module has no UNet transformer"):
        tome.apply_patch(unet)
    assert not tome.is_patched(unet)


# --------------------------------------------------------------------------- coexistence

def test_replaces_a_tomesd_patch(sd15, inputs):
    wrapped = Wrapper(sd15)
    tome.apply_patch(sd15, ratio=0.5, use_rand=False)
    ours_only = run(sd15, *inputs)
    tome.remove_patch(sd15)
    tomesd.apply_patch(wrapped, ratio=0.5, use_rand=False)
    with pytest.warns(UserWarning, match="tomesd"):
        tome.apply_patch(wrapped, ratio=0.5, use_rand=False)
    assert not any(type(m).__name__ == "ToMeBlock" for m in sd15.modules())
    assert tome.patch_report(wrapped).replaced_tomesd
    assert torch.equal(run(sd15, *inputs), ours_only)
    tome.remove_patch(wrapped)


def test_tomesd_after_ours_is_never_merged_twice(sd15, inputs):
    wrapped = Wrapper(sd15)
    tomesd.apply_patch(wrapped, ratio=0.5, use_rand=False)
    tomesd_only = run(sd15, *inputs)
    tomesd.remove_patch(wrapped)
    tome.apply_patch(wrapped, ratio=0.5, use_rand=False)
    tomesd.apply_patch(wrapped, ratio=0.5, use_rand=False)  # as the WebUI's built-in would
    with pytest.warns(UserWarning, match="never merged twice"):
        out = run(sd15, *inputs)
    assert torch.equal(out, tomesd_only)
    tomesd.remove_patch(wrapped)  # tomesd's removal leaves our patch in place
    assert tome.is_patched(wrapped)
    tome.remove_patch(wrapped)


def test_shadowed_forward_is_reported(inputs):
    unet = ldm_unet(TINY_SD15)
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    blocks[0]._forward = blocks[0]._forward  # what ControlNet's reference mode leaves behind
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tome.apply_patch(unet, ratio=0.5)
    report = tome.patch_report(unet)
    assert len(report.skipped) == 1 and "shadowed" in report.skipped[0][1]
    assert "skipped" in report.summary()
    assert report.levels == {1: 4}
    run(unet, *inputs)
    tome.remove_patch(unet)


# --------------------------------------------------------------------------- hosts

def test_diffusers_pipeline():
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
    unet = diffusers_unet("sd15")
    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=None, tokenizer=None, unet=unet,
                                   scheduler=DDIMScheduler(steps_offset=1, clip_sample=False),
                                   safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    _, _, c = ldm_inputs(1, 8, 8)

    def generate():
        return pipe(prompt_embeds=c, negative_prompt_embeds=-c, num_inference_steps=2,
                    height=32, width=32, output_type="latent",  # 1-level VAE: latent = image
                    generator=torch.Generator().manual_seed(0)).images

    base = generate()
    tome.apply_patch(pipe, ratio=0.5, seed=1)
    assert tome.patch_report(pipe).levels == {1: 5}
    merged = generate()
    assert torch.equal(generate(), merged)  # reproducible call after call
    tome.remove_patch(pipe)
    assert not torch.equal(merged, base)
    assert torch.equal(generate(), base)


def test_sgm_style_block_signature(inputs):
    """sgm's block: ``_forward(x, context=None, additional_tokens=None, n_times...=0)``."""
    from ldm.modules.attention import BasicTransformerBlock as Ldm

    class BasicTransformerBlock(Ldm):  # noqa: N801 - the name the patch looks for
        def _forward(self, x, context=None, additional_tokens=None,
                     n_times_crossframe_attn_in_self=0):
            return super()._forward(x, context)

    unet = ldm_unet(TINY_SDXL)
    for m in unet.modules():
        if type(m) is Ldm:
            m.__class__ = BasicTransformerBlock
    x, t, c = ldm_inputs(2, 16, 16)
    base = run(unet, x, t, c)
    tome.apply_patch(unet, ratio=0.5)
    assert tome.patch_report(unet).patched_blocks > 0
    assert not torch.equal(run(unet, x, t, c), base)
    tome.remove_patch(unet)
    assert torch.equal(run(unet, x, t, c), base)


# --------------------------------------------------------------------------- other methods

def test_local_matching_runs_in_a_unet_and_changes_little(sd15, inputs):
    x, t, c = inputs
    base = run(sd15, x, t, c)
    out = {}
    for matching in ("global", "local"):
        tome.apply_patch(sd15, ratio=0.5, matching=matching, use_rand=False)
        out[matching] = run(sd15, x, t, c)
        tome.remove_patch(sd15)
    dev = {k: float((v - base).norm() / base.norm()) for k, v in out.items()}
    assert 0 < dev["local"] < 0.5 and 0 < dev["global"] < 0.5
    assert not torch.equal(out["local"], out["global"])  # local matching picks other pairs


def test_downsample_method_reports_and_removes_exactly(sd15, inputs):
    x, t, c = inputs
    base = run(sd15, x, t, c)
    tome.apply_patch(sd15, method="downsample", downsample_factor=2)
    out = run(sd15, x, t, c)
    h, w = x.shape[-2:]
    assert tome.patch_report(sd15).tokens[1] == (h * w, h * w - (h // 2) * (w // 2))
    tome.remove_patch(sd15)
    assert torch.equal(run(sd15, x, t, c), base)
    assert out.shape == base.shape and not torch.equal(out, base)


@pytest.mark.parametrize("method", ["merge", "downsample"])
def test_timestep_window(sd15, inputs, method):
    x, t, c = inputs
    base = run(sd15, x, t, c)                   # t = 500: progress 0.5
    always = None
    for (start, end), inside in {(0.0, 1.0): True, (0.4, 0.6): True, (0.0, 0.3): False,
                                 (0.7, 1.0): False}.items():
        tome.apply_patch(sd15, method=method, start=start, end=end, use_rand=False)
        out = run(sd15, x, t, c)
        tome.remove_patch(sd15)
        assert torch.equal(out, base) != inside, (start, end)
        always = out if always is None else always
        if inside:
            assert torch.equal(out, always)
