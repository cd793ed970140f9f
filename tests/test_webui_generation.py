"""Whole generations through the WebUI stand-in, on a real (tiny) ldm UNet."""

import pytest
import torch
from webui_stub.harness import WebUI, errors, sd_models, sd_unet, shared, tiny_model

import tome
from tome.webui import host
from tome.webui import script_args as settings


@pytest.fixture
def webui():
    return WebUI()


def on(**named):
    return {"enabled": True, **named}


def passes(webui):
    """(hires pass?, ratio or None) per UNet call, deduplicated in order."""
    seen = []
    for c in webui.calls:
        item = (c.hr, None if c.config is None else c.config.ratio)
        if not seen or seen[-1] != item:
            seen.append(item)
    return seen


def images(res):
    return torch.stack(res.images)


def test_off_is_bit_identical_to_a_webui_without_the_extension(webui):
    base = webui.baseline(enable_hr=True)
    res = webui.generate(enable_hr=True)
    assert torch.equal(images(res), images(base))
    assert res.info == base.info
    assert all(c.config is None and not c.tomesd for c in webui.calls)


def test_txt2img_is_patched_while_sampling_and_restored_after(webui, capsys):
    res = webui.generate(tome=on(ratio=0.4, policy="fixed"))
    assert passes(webui) == [(False, 0.4)]
    assert not tome.is_patched(shared.sd_model)
    assert "ToMe ratio: 0.4" in res.info
    out = capsys.readouterr().out
    assert out.count("ToMe: SD1 (ldm) first pass ratio 0.4; 5/16 blocks patched") == 1
    assert not torch.equal(images(res), images(webui.baseline()))


def test_positional_args_from_the_ui(webui):
    res = webui.generate(tome=[True, 0.3, 2, 2, "auto"])
    assert passes(webui) == [(False, 0.3)]
    assert "ToMe ratio: 0.3" in res.info


@pytest.mark.parametrize("hires_only", [False, True])
def test_hires_fix_gets_its_own_patch(webui, hires_only):
    res = webui.generate(tome=on(ratio=0.3, hr_ratio=0.6, hires_only=hires_only), enable_hr=True)
    first = None if hires_only else 0.3
    assert passes(webui) == [(False, first), (True, 0.6)]
    assert not tome.is_patched(shared.sd_model)
    assert "ToMe hr ratio: 0.6" in res.info
    assert ("ToMe hires only: True" in res.info) == hires_only


def test_hires_settings_through_override_settings(webui):
    res = webui.generate(tome=on(ratio=0.3), enable_hr=True,
                         override_settings={"tome_hires_only": True, "tome_hr_ratio": 0.5})
    assert passes(webui) == [(False, None), (True, 0.5)]
    assert "ToMe hires only: True" in res.info and "ToMe hr ratio: 0.5" in res.info


def test_hires_only_without_hires_fix_merges_nothing(webui, capsys):
    res = webui.generate(tome=on(hires_only=True))
    assert passes(webui) == [(False, None)]
    assert "ToMe" not in res.info.split("\n")[-1]
    assert "hires fix is off: nothing is merged" in capsys.readouterr().out


def test_upscale_button_path_patches_only_the_hires_pass(webui):
    first = torch.randn(1, 4, 16, 16)
    res = webui.generate(tome=on(ratio=0.5, hr_ratio=0.7), enable_hr=True,
                         firstpass_image=first)
    assert passes(webui) == [(True, 0.7)]
    assert not tome.is_patched(shared.sd_model) and "ToMe hr ratio: 0.7" in res.info


def test_img2img_has_its_own_ratio(webui):
    res = webui.generate("img2img", tome=on(ratio=0.5, img2img_ratio=0.25, hires_only=True))
    assert passes(webui) == [(False, 0.25)]  # img2img always merges
    assert "ToMe ratio: 0.25" in res.info and "hires only" not in res.info


def test_failed_run_is_cleared_by_close_or_by_the_next_generation(webui):
    with pytest.raises(RuntimeError, match="simulated"):
        webui.generate(tome=on(), close=False, fail_at_step=(False, 1))
    assert tome.is_patched(shared.sd_model)  # stale: postprocess never ran
    webui.calls.clear()
    res = webui.generate()
    assert all(c.config is None for c in webui.calls)
    assert torch.equal(images(res), images(webui.baseline()))

    with pytest.raises(RuntimeError, match="simulated"):
        webui.generate(tome=on(), fail_at_step=(True, 0), enable_hr=True)
    assert not tome.is_patched(shared.sd_model)  # p.close() restored it


def test_interrupt_between_batches_leaves_nothing_patched(webui):
    shared.state.interrupted = True
    webui.generate(tome=on(), n_iter=2)
    assert not tome.is_patched(shared.sd_model)


def test_model_switch_and_reload_ui_unpatch(webui):
    with pytest.raises(RuntimeError):
        webui.generate(tome=on(), close=False, fail_at_step=(False, 0))
    old = shared.sd_model
    assert tome.is_patched(old)
    sd_models.load_model(tiny_model(seed=5))
    assert not tome.is_patched(old)

    with pytest.raises(RuntimeError):
        webui.generate(tome=on(), close=False, fail_at_step=(False, 0))
    assert tome.is_patched(shared.sd_model)
    webui.reload_ui()
    assert not tome.is_patched(shared.sd_model)
    webui.generate(tome=on(ratio=0.2))  # still works after the reload
    assert passes(webui)[-1] == (False, 0.2)


def test_hires_checkpoint_moves_the_patch(webui):
    first_model = shared.sd_model
    p = webui.make_p("txt2img", on(ratio=0.4), enable_hr=True)
    p.hr_model = tiny_model(seed=7)
    from modules import processing
    processing.process_images(p)
    by_model = {(id(c.model), c.hr, None if c.config is None else c.config.ratio)
                for c in webui.calls}
    assert by_model == {(id(first_model), False, 0.4), (id(p.hr_model), True, 0.4)}
    assert not tome.is_patched(first_model) and not tome.is_patched(p.hr_model)


def test_refiner_switched_in_mid_sampling_is_patched(webui):
    refiner = tiny_model(seed=9)
    webui.generate(tome=on(ratio=0.4), steps=4, refiner_model=refiner, refiner_switch_at=2)
    assert [(c.model is refiner, c.config is not None) for c in webui.calls] == [
        (False, True), (False, True), (True, True), (True, True)]
    assert not tome.is_patched(refiner)


def test_builtin_token_merging_is_taken_over(webui, capsys):
    shared.opts.token_merging_ratio = 0.5
    res = webui.generate()
    assert all(c.tomesd for c in webui.calls) and "Token merging ratio: 0.5" in res.info

    webui.calls.clear()
    res = webui.generate(tome=on(ratio=0.3))
    assert all(not c.tomesd and c.config.ratio == 0.3 for c in webui.calls)
    assert "Token merging ratio" not in res.info and "ToMe ratio: 0.3" in res.info
    assert shared.opts.token_merging_ratio == 0.5  # restored after the generation
    webui.generate(tome=on(ratio=0.3))
    out = capsys.readouterr().out
    assert out.count("built-in token merging (token_merging_ratio=0.5) is off") == 1

    webui.calls.clear()
    res = webui.generate(tome=on(), override_settings_restore_afterwards=False)
    assert all(not c.tomesd for c in webui.calls) and shared.opts.token_merging_ratio == 0.5


def test_same_seed_same_image_and_untouched_global_rng(webui):
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = images(webui.generate(tome=on(ratio=0.6, policy="fixed"), seed=5))
    assert torch.equal(torch.get_rng_state(), state)
    b = images(webui.generate(tome=on(ratio=0.6, policy="fixed"), seed=5))
    c = images(webui.generate(tome=on(ratio=0.6, use_rand=False, policy="fixed"), seed=5))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_each_batch_is_seeded_from_its_first_image(webui):
    webui.generate(tome=on(), n_iter=2, batch_size=2, seed=10)
    seen = sorted({c.config.seed for c in webui.calls})
    assert seen == [10, 12]
    single = images(webui.generate(tome=on(), batch_size=2, seed=12))
    both = webui.generate(tome=on(), n_iter=2, batch_size=2, seed=10)
    assert torch.equal(torch.stack(both.images[2:]), single)


def test_sdxl_layout_merges_with_auto_max_downsample(capsys):
    webui = WebUI(tiny_model("sdxl"))
    webui.generate(tome=on())
    report_line = capsys.readouterr().out
    assert "ToMe: SDXL (ldm)" in report_line
    assert "5/11 blocks patched at downsample <= 2 (ds2: 5)" in report_line
    assert all(c.config is not None and c.config.max_downsample is None for c in webui.calls)


def test_downsample_method_and_step_window(webui, capsys):
    res = webui.generate(tome=on(method="downsample", downsample_factor=2, start=0.2, end=0.8))
    assert "ToMe method: downsample" in res.info and "ToMe start: 0.2" in res.info
    assert "ToMe ratio" not in res.info
    assert "first pass downsample x2" in capsys.readouterr().out


def test_sd_unet_replacement_is_skipped_with_a_note(webui, capsys):
    sd_unet.current_unet = type("TrtUnet", (), {})()
    res = webui.generate(tome=on())
    assert all(c.config is None for c in webui.calls)
    assert "ToMe skipped" in res.info
    assert capsys.readouterr().out.count("ToMe: skipped") == 1


def test_forge_model_is_patched_through_its_patcher(capsys):
    from stubs import Patcher

    from tome import patcher
    model = tiny_model()
    model.forge_objects = type("ForgeObjects", (), {})()
    model.forge_objects.unet = original = Patcher(model.model.diffusion_model)
    webui = WebUI(model)
    res = webui.generate(tome=on(ratio=0.4))
    patched = model.forge_objects.unet
    assert patched is not original and getattr(patched, patcher.MARK).config.ratio == 0.4
    assert not original.patches["attn1_patch"] and not tome.is_patched(model)
    assert "ToMe ratio: 0.4" in res.info
    assert capsys.readouterr().out.count("ToMe: Forge UNet (attn1 patch), first pass") == 1


def test_forge_dit_is_reported_as_not_merged(capsys):
    """Forge Neo also runs Flux, Chroma, ...: their blocks never call the attn1 patches."""
    from stubs import FluxLike, Patcher

    model = tiny_model()
    model.forge_objects = type("ForgeObjects", (), {})()
    model.forge_objects.unet = original = Patcher(FluxLike())
    webui = WebUI(model)
    res = webui.generate(tome=on(ratio=0.4))
    assert model.forge_objects.unet is original and not original.patches["attn1_patch"]
    assert 'ToMe skipped: "FluxLike has no UNet transformer blocks to merge' in res.info
    assert "ToMe ratio" not in res.info and "ToMe auto" not in res.info
    out = capsys.readouterr().out
    assert out.count("ToMe: skipped, the image is generated without merging: FluxLike") == 1
    assert "Forge UNet (attn1 patch)" not in out


def test_model_without_transformer_blocks_is_skipped(capsys):
    dit = torch.nn.Module()
    dit.model = torch.nn.Module()
    dit.model.diffusion_model = DiT()
    dit.context_dim = 32
    webui = WebUI(dit)
    res = webui.generate(tome=on())
    assert "ToMe skipped" in res.info and len(res.images) == 1
    assert "ToMe: skipped, the image is generated without merging" in capsys.readouterr().out


class DiT(torch.nn.Module):
    """A stand-in for SD3's MMDiT: a denoiser with no BasicTransformerBlock."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Conv2d(4, 4, 1)

    def forward(self, x, t, context):
        return self.proj(x)


def _a1111_sd3():
    """An SD3 model object as A1111 1.10 holds it (``sd_model.model.diffusion_model`` is the
    MMDiT), called by the stand-in sampler with the context in third place."""
    from mmdit_stub import MMDiT

    class SampledMMDiT(MMDiT):
        def forward(self, x, t, context=None):
            return super().forward(x, t, context=context)

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.diffusion_model = SampledMMDiT(context_dim=32).eval()
    model.context_dim, model.is_sd3 = 32, True
    return model


def test_sd3_pools_image_keys_with_downsample_and_says_so(capsys):
    webui = WebUI(_a1111_sd3())
    ref = webui.generate(tome=None, seed=3)
    res = webui.generate(tome=on(method="downsample", policy="fixed"), seed=3)
    out = capsys.readouterr().out
    assert "ToMe: SD3 DiT (a1111 sd3) first pass downsample x2; 2/2 blocks pooled" in out, out
    assert "ToMe method: downsample" in res.info and "ToMe skipped" not in res.info
    assert not torch.equal(res.images[0], ref.images[0])
    assert not tome.is_patched(shared.sd_model)
    again = webui.generate(tome=None, seed=3)
    assert torch.equal(again.images[0], ref.images[0])  # removal: bit-identical


def test_sd3_says_after_each_pass_how_many_attention_calls_it_pooled(capsys):
    """A1111's SD3 (processors and shadows) counts its calls as the per-call hosts do: after
    the pass, the line ComfyUI's node and Forge Neo print (every block's joint attention
    pooled at every step: 2 blocks x the stand-in sampler's calls)."""
    webui = WebUI(_a1111_sd3())
    webui.generate(tome=on(method="downsample", policy="fixed"), seed=3)
    lines = [x for x in capsys.readouterr().out.splitlines() if "attention calls" in x]
    assert len(lines) == 1 and lines[0].startswith("ToMe: first pass pooled "), lines
    n = int(lines[0].split()[4])
    assert n > 0 and lines[0] == f"ToMe: first pass pooled {n} of {n} attention calls"


def test_sd3_with_merge_is_skipped_with_the_reason(capsys):
    webui = WebUI(_a1111_sd3())
    res = webui.generate(tome=on(ratio=0.5))
    assert "ToMe skipped" in res.info and "no DiT form" in res.info
    assert "merge has no DiT form" in capsys.readouterr().out


def test_block_shadowed_by_another_extension_is_skipped_with_a_note(webui):
    unet = shared.sd_model.model.diffusion_model
    block = next(m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock")
    block._forward = block._forward  # what ControlNet's reference-only leaves behind
    res = webui.generate(tome=on())
    assert "ToMe skipped: \"1 block(s)" in res.info


def test_webui_before_1_10_patches_per_batch_and_before_hires(monkeypatch):
    from webui_stub.harness import scripts

    monkeypatch.delattr(scripts.Script, "process_before_every_sampling")
    webui = WebUI()
    res = webui.generate(tome=on(ratio=0.3, hr_ratio=0.6), enable_hr=True, n_iter=2)
    assert passes(webui) == [(False, 0.3), (True, 0.6), (False, 0.3), (True, 0.6)]
    assert "ToMe hr ratio: 0.6" in res.info and not tome.is_patched(shared.sd_model)
    webui.calls.clear()
    webui.generate(tome=on(hires_only=True), enable_hr=True)
    assert passes(webui) == [(False, None), (True, 0.5)]
    webui.calls.clear()
    webui.generate("img2img", tome=on(ratio=0.4))
    assert passes(webui) == [(False, 0.4)]


# ----------------------------------------------------------------------------- the auto policy

def test_auto_policy_says_per_pass_what_it_chose_and_why(webui, capsys):
    # CPU threshold: 4096 tokens. 256 px -> 32x32 latent (1024 tokens); hires x2 -> 4096 tokens.
    res = webui.generate(tome=on(ratio=0.5), enable_hr=True, width=256, height=256)
    out = capsys.readouterr().out
    first = "first pass 256x256 px: ds1 1024 tokens, below the CPU threshold (4096), not merged"
    hires = "hires pass 512x512 px: ds1 4096 tokens, at or above the CPU threshold (4096)"
    assert out.count(f"ToMe auto: {first}\n") == 1 and out.count(f"ToMe auto: {hires}\n") == 1
    assert f'ToMe auto: "{first} | {hires}"' in res.info and "ToMe policy: auto" in res.info
    assert {c.config.policy for c in webui.calls} == {"auto"}

    webui.calls.clear()
    alone = webui.generate(tome=on(ratio=0.5))  # 128 px only: auto merges nothing at all
    assert torch.equal(images(alone), images(webui.baseline()))


def test_fixed_policy_writes_no_auto_note(webui, capsys):
    res = webui.generate(tome=on(policy="fixed"))
    assert "ToMe auto" not in res.info and "ToMe policy" not in res.info
    assert "ToMe auto" not in capsys.readouterr().out


def test_auto_note_for_img2img_and_before_webui_1_10(monkeypatch, capsys):
    from webui_stub.harness import scripts

    monkeypatch.delattr(scripts.Script, "process_before_every_sampling")
    webui = WebUI()
    res = webui.generate(tome=on(), enable_hr=True, width=256, height=128, hr_scale=4)
    out = capsys.readouterr().out
    assert "ToMe auto: first pass 256x128 px: ds1 512 tokens, below" in out
    assert "ToMe auto: hires pass 1024x512 px: ds1 8192 tokens, at or above" in out
    assert "hires pass 1024x512 px" in res.info
    res = webui.generate("img2img", tome=on(), width=512, height=512)
    assert "img2img 512x512 px: ds1 4096 tokens, at or above" in res.info


def test_auto_decision_uses_the_device_the_pass_runs_on(webui, monkeypatch):
    from tome.webui import host

    monkeypatch.setattr(host, "compute_device", lambda model, x=None: torch.device("cuda"))
    res = webui.generate(tome=on())
    assert "ds1 256 tokens, below the CUDA threshold (16384), not merged" in res.info


# ----------------------------------------------------------------------------- one pass

def test_arguments_are_parsed_once_and_each_pass_derived_once(webui, monkeypatch):
    from tome.webui import script_args as settings

    counts = {"parse": 0, "passes": 0}
    parse, derive = settings.parse_args, settings.ScriptSettings.passes

    def counting_parse(*a, **k):
        counts["parse"] += 1
        return parse(*a, **k)

    def counting_passes(self, **k):
        counts["passes"] += 1
        return derive(self, **k)
    monkeypatch.setattr(settings, "parse_args", counting_parse)
    monkeypatch.setattr(settings.ScriptSettings, "passes", counting_passes)
    res = webui.generate(tome=on(ratio=0.3, hr_ratio=0.6), enable_hr=True, n_iter=2)
    assert counts == {"parse": 1, "passes": 1}
    assert passes(webui) == [(False, 0.3), (True, 0.6), (False, 0.3), (True, 0.6)]
    assert "ToMe hr ratio: 0.6" in res.info

    counts.update(parse=0, passes=0)
    webui.xyz("txt2img", "[ToMe] Ratio", ["0.2", "0.4"])
    assert counts == {"parse": 2, "passes": 2}  # one per cell


# ----------------------------------------------------------------------------- other patches

def test_self_attention_guidance_block_is_left_alone_with_one_line(webui, capsys, recwarn):
    """The A1111 SAG extension replaces the middle block's attn1.forward on the instance to
    record its attention map, which needs every token."""
    from tome.layout import read as read_layout

    unet = shared.sd_model.model.diffusion_model
    middle = next(b.module for b in read_layout(unet).blocks if b.level == 8)
    seen = []
    original = middle.attn1.forward

    def record(x, *args, **kwargs):
        seen.append(x.shape[1])
        return original(x, *args, **kwargs)
    middle.attn1.forward = record
    res = webui.generate(tome=on(max_downsample="8", policy="fixed"))
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.startswith("ToMe")]
    assert len(lines) == 1 and "1 block(s) skipped: attn1 forward replaced" in lines[0]
    assert 'ToMe skipped: "1 block(s): attn1 forward replaced' in res.info
    assert set(seen) == {4} and len(res.images) == 1  # 16x16 latent at ds8: all 2x2 tokens
    assert "Traceback" not in out + err and not errors.reported
    assert not [w for w in recwarn if "ToMe" in str(w.message)]


def test_a_patch_that_fails_is_one_line_and_an_unmerged_image(webui, monkeypatch, capsys):
    from tome import patch

    def broken(model, config, measurer=None, layout=None):
        raise RuntimeError("unexpected layout")
    monkeypatch.setattr(patch, "apply", broken)
    res = webui.generate(tome=on())
    assert torch.equal(images(res), images(webui.baseline()))
    assert "ToMe skipped: \"patching failed (RuntimeError: unexpected layout)\"" in res.info
    out, err = capsys.readouterr()
    assert out.count("ToMe: skipped, the image is generated without merging: patching failed")\
        == 1 and not errors.reported


def test_forge_blocks_replaced_by_another_patch_are_reported_once(capsys):
    from stubs import Patcher
    from webui_stub.harness import processing

    from tome import patcher

    model = tiny_model()
    model.forge_objects = type("ForgeObjects", (), {})()
    model.forge_objects.unet = Patcher(model.model.diffusion_model)
    webui = WebUI(model)

    def sag_in_forge(p, m):  # what the Forge patch learns while the UNet runs
        patch = getattr(m.forge_objects.unet, patcher.MARK)
        if not patch.skipped:
            patch.skipped.append((("middle", 0, 0), "attn1 replaced by another patch (e.g. "
                                                    "Self-Attention Guidance)"))
    processing.unet_call_observers.append(sag_in_forge)
    res = webui.generate(tome=on(ratio=0.4), enable_hr=True, steps=1)
    out = capsys.readouterr().out
    assert out.count("ToMe: 1 block(s) skipped: attn1 replaced by another patch") == 1
    assert 'ToMe skipped: "1 block(s): attn1 replaced by another patch' in res.info
    assert "ToMe auto: first pass 128x128 px: ds1 256 tokens, below the CPU threshold" in out


def test_settings_that_merge_nothing_say_so_and_claim_no_merge(capsys, recwarn):
    webui = WebUI(tiny_model("sdxl"))
    res = webui.generate(tome=on(max_downsample="1"), n_iter=2)
    out = capsys.readouterr().out
    assert out.count("ToMe: skipped, the image is generated without merging: max_downsample=1 "
                     "merges nothing on this model (its transformer blocks are at downsample "
                     "[2, 4])") == 1
    assert "ToMe skipped: \"max_downsample=1 merges nothing" in res.info
    assert "ToMe ratio" not in res.info and not tome.is_patched(shared.sd_model)
    assert not [w for w in recwarn if "ToMe" in str(w.message)]


def test_forge_settings_that_merge_nothing_say_so():
    from stubs import Patcher

    model = tiny_model("sdxl")
    model.forge_objects = type("ForgeObjects", (), {})()
    model.forge_objects.unet = original = Patcher(model.model.diffusion_model)
    res = WebUI(model).generate(tome=on(max_downsample="1"))
    assert model.forge_objects.unet is original
    assert "ToMe skipped: \"max_downsample=1 merges nothing" in res.info


# ----------------------------------------------------------------------------- measuring

def _fake_measurer(monkeypatch, tmp_path, speedup, run_blocks=True):
    """The WebUI's measuring service with a fake clock and a cache of this test's own."""
    from stubs import fake_clock

    from tome.measurements import MeasurementCache, Measurer
    from tome.webui import host

    calls = []
    service = Measurer(MeasurementCache(tmp_path / "m.json"), progress=host.show_progress,
                       rounds=2, warmup=int(run_blocks),
                       clock=fake_clock(speedup, calls, run_blocks))
    monkeypatch.setattr(host, "_services", [service])
    if not run_blocks:  # blocks never run: whatever this machine has free, they would fit
        from tome import memory
        monkeypatch.setattr(memory, "available", lambda device: 1 << 50)
    return calls


@pytest.mark.measure
def test_first_generation_at_a_size_measures_and_says_so(monkeypatch, tmp_path, capsys):
    calls = _fake_measurer(monkeypatch, tmp_path, 2.0)
    from tome.webui import host

    webui = WebUI()
    progress = []
    host._services[0].progress = lambda text: (progress.append(text), host.show_progress(text))
    res = webui.generate(tome=on(), seed=4)
    out = capsys.readouterr().out
    assert out.count("ToMe: measured 128x128 px, batch 2, merge, on ") == 1 and calls
    line = "first pass 128x128 px: ds1 measured 2.00x on "
    assert out.count(f"ToMe auto: {line}") == 1 and line in res.info
    assert "ToMe merged: first pass ds1" in res.info
    assert progress == ["ToMe: measuring 128x128 px", None]
    assert passes(webui) == [(False, 0.5)]
    # the next generation reuses the measurement: no new timing, no new line, same image
    calls.clear()
    again = webui.generate(tome=on(), seed=4)
    assert not calls and "ToMe: measured" not in capsys.readouterr().out
    assert torch.equal(images(again), images(res)) and again.info == res.info


@pytest.mark.measure
def test_measured_slower_is_not_merged_and_pastes_back_as_off(monkeypatch, tmp_path, capsys):
    _fake_measurer(monkeypatch, tmp_path, 0.9)
    webui = WebUI()
    res = webui.generate(tome=on(), seed=4)
    assert "ds1 measured 0.90x on " in res.info and "not merged" in res.info
    assert "ToMe merged: first pass none" in res.info
    assert torch.equal(images(res), images(webui.baseline(seed=4)))
    pasted = dict(zip(settings.ARGS, webui.paste("txt2img", res.info)))
    assert pasted["enabled"] is False


@pytest.mark.measure
def test_pasting_a_measured_image_reproduces_it_without_measuring(monkeypatch, tmp_path):
    calls = _fake_measurer(monkeypatch, tmp_path, 2.0)
    webui = WebUI()
    res = webui.generate(tome=on(), seed=4, enable_hr=True)
    assert "ToMe merged: first pass ds1 | hires pass ds1" in res.info
    pasted = webui.paste("txt2img", res.info)
    cfg = settings.parse_args(pasted).config
    assert (cfg.policy, cfg.max_downsample) == ("fixed", 1)
    calls.clear()
    again = webui.generate(tome=pasted, seed=4, enable_hr=True)
    assert not calls and torch.equal(images(again), images(res))


@pytest.mark.measure
def test_measuring_off_in_the_settings_uses_the_thresholds(monkeypatch, tmp_path):
    calls = _fake_measurer(monkeypatch, tmp_path, 2.0)
    webui = WebUI()
    shared.opts.tome_measure = False
    res = webui.generate(tome=on())
    assert not calls and "below the CPU threshold (4096), not merged" in res.info


@pytest.mark.measure
def test_measure_now_in_the_settings(monkeypatch, tmp_path):
    from webui_stub.harness import launch

    from tome.webui import measure_now

    calls = _fake_measurer(monkeypatch, tmp_path, 1.5, run_blocks=False)
    WebUI()
    app = launch()  # no --api: the button's gradio event, no route
    assert measure_now.ROUTE not in [getattr(r, "path", None) for r in app.routes]
    page = _measure_now(app)
    assert page.count("<tr>") == 1 + 2 * 3  # header, 2 methods x 3 sizes x 1 level
    assert "1024x1024</td><td>ds1</td><td>16384</td>" in page and "1.50x" in page
    assert "<svg" in page and page.count("<polyline") == 2
    # the generations read what Measure now measured: nothing is timed again at 512 px
    calls.clear()
    res = WebUI().generate(tome={"enabled": True}, width=512, height=512, steps=1)
    assert not calls and "ds1 measured 1.50x on " in res.info
    assert host.measuring_service().last is not None
    assert "tome_measure_now" in shared.opts.data_labels


def _measure_now(app=None):
    """Settings > ToMe > Measure now, as the page runs it (its gradio event)."""
    from fastapi.testclient import TestClient
    from webui_stub.harness import launch, press

    r = press(TestClient(app or launch()), "tome_measure_now_button")
    assert r.status_code == 200, r.text
    return r.json()["data"][0]


@pytest.mark.measure
@pytest.mark.parametrize("sampling", [torch.inference_mode, torch.no_grad])
def test_measure_now_after_a_generation_that_measured(monkeypatch, tmp_path, capsys, sampling):
    """Forge samples (and so first measures) under inference mode, A1111 under no_grad;
    Measure now afterwards gives its table either way."""
    from webui_stub.harness import processing

    from tome import measure as M

    monkeypatch.setattr(M, "_flush", {})
    _fake_measurer(monkeypatch, tmp_path, 2.0, run_blocks=False)
    webui = WebUI()
    processing.sampling_mode = sampling
    res = webui.generate(tome=on(), seed=4)
    assert "ds1 measured 2.00x on " in res.info
    page = _measure_now()
    assert page.count("<tr>") == 1 + 2 * 3 and "skipped" not in page
    out = capsys.readouterr().out
    assert "could not measure" not in out


@pytest.mark.measure
@pytest.mark.parametrize("reload", [False, True])
def test_measure_now_before_any_model_is_loaded(monkeypatch, tmp_path, capsys, reload):
    """Forge Neo's ``shared.sd_model`` is a ``FakeInitialModel`` until a generation loads the
    checkpoint (``sd_models.forge_model_reload``): Measure now loads it the same way, or says
    that no model is loaded."""
    calls = _fake_measurer(monkeypatch, tmp_path, 1.5, run_blocks=False)
    model = tiny_model()
    WebUI(model)
    shared.sd_model = type("FakeInitialModel", (), {})()
    if reload:
        monkeypatch.setattr(sd_models, "forge_model_reload",
                            lambda: (sd_models.load_model(model), True), raising=False)
    page = _measure_now()
    out = capsys.readouterr().out
    if reload:
        assert page.count("<tr>") == 1 + 2 * 3 and calls and shared.sd_model is model
    else:
        assert page == ("<p>ToMe: no model is loaded yet (select a checkpoint, or generate "
                        "once).</p>") and not calls
        assert out.count("ToMe: Measure now: no model is loaded yet") == 1


@pytest.mark.measure
def test_measure_now_names_a_model_it_cannot_measure(monkeypatch, tmp_path, capsys):
    from stubs import FluxLike, Patcher

    _fake_measurer(monkeypatch, tmp_path, 1.5, run_blocks=False)
    model = tiny_model()
    model.forge_objects = type("ForgeObjects", (), {})()
    model.forge_objects.unet = Patcher(FluxLike())
    WebUI(model)
    page = _measure_now()
    from tome.layout import dits_read
    assert page == ("<p>ToMe: FluxLike has no UNet transformer blocks to merge and is not a "
                    "DiT it can pool (ToMe merges SD1, SD2 and SDXL UNets and pools image "
                    f"keys/values in the DiTs it reads: {dits_read()}; not other DiTs, nor "
                    "compiled or replaced models); nothing to measure.</p>")
    assert "ToMe: Measure now: FluxLike has no UNet" in capsys.readouterr().out


@pytest.mark.measure
def test_measure_now_skips_sizes_that_do_not_fit_in_memory(monkeypatch, tmp_path, capsys):
    """The guard of ``tome/memory.py`` with a small reported memory: each size is skipped with
    one console line and a table row saying why; the WebUI stays up."""
    from collections import namedtuple

    import psutil

    calls = _fake_measurer(monkeypatch, tmp_path, 1.5)
    WebUI()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: namedtuple("VM", "available")(1 << 20))
    page = _measure_now()
    out = capsys.readouterr().out
    assert not calls and page.count("<td colspan='6'>skipped: not measured at ") == 2 * 3
    assert "Nothing measured" in page and "<svg" not in page
    assert out.count("ToMe: not measured at 1024x1024 px, batch 2: timing the unmerged block "
                     "needs about ") == 2


def test_console_lines_start_on_their_own_line_under_a_progress_bar(capsys):
    """The measuring line used to continue the bar's (``0/4 [00:00<?, ?it/s]ToMe: ...``)."""
    import sys

    from tqdm import tqdm

    from tome.webui import narrate

    narrate.console("ToMe: before")
    with tqdm(total=2, file=sys.stderr) as bar:
        bar.update()
        narrate.console("ToMe: during")
    out, err = capsys.readouterr()
    assert out == "ToMe: before\nToMe: during\n"
    assert err.split("1/2")[1].split("\r")[0].endswith("\n")  # the bar line was finished


@pytest.mark.parametrize(("start", "end"), [(0.0, 0.5), (0.5, 1.0)])
def test_the_window_says_which_steps_it_merged(webui, capsys, start, end):
    """4 steps at timesteps 999, 666, 333, 0 (progress 0, 1/3, 2/3, 1): each half merges 2."""
    res = webui.generate(tome=on(ratio=0.5, policy="fixed", start=start, end=end), steps=4)
    full = webui.generate(tome=on(ratio=0.5, policy="fixed"), steps=4)
    base = webui.baseline(steps=4)
    assert not torch.equal(images(res), images(base))
    assert not torch.equal(images(res), images(full))
    assert "ToMe steps: first pass 2 of 4" in res.info
    text = f"ToMe: first pass steps {start:g}-{end:g}: merged in 2 of 4 steps"
    assert capsys.readouterr().out.count(text) == 1


@pytest.mark.measure
def test_measure_now_on_a1111_sd3_times_its_blocks(monkeypatch, tmp_path, capsys):
    """A1111's SD3 (an MMDiT): downsample is timed through its own blocks; merge, which has no
    DiT form, gets a row saying so; the page renders (it used to raise on an empty plot)."""
    import mmdit_stub

    calls = _fake_measurer(monkeypatch, tmp_path, 1.5, run_blocks=True)
    model = tiny_model()
    model.model.diffusion_model = mmdit_stub.MMDiT().eval()
    WebUI(model)
    page = _measure_now()
    assert calls
    assert page.count("<tr><td>downsample</td>") == 3 and "<svg" in page
    assert page.count("<tr><td>merge</td>") == 3
    assert page.count("skipped: merge has no DiT form (a1111 sd3); use method downsample") == 3
    assert "Traceback" not in capsys.readouterr().out


def test_measure_now_plot_of_nothing_is_empty():
    from tome.survey import Survey
    from tome.webui import measure_now
    assert measure_now.plot(Survey()) == ""
    page = measure_now.render(Survey(missed=[("merge", 512, "ToMe: why")]))
    assert "Nothing measured" in page and "skipped: why" in page and "<svg" not in page


def test_a_preset_on_sd3_says_what_it_resolved_to_and_pastes_back(capsys):
    """A preset is one config for every model kind: on a DiT its DiT point (schedule, reuse,
    proportional attention), said in the console and the infotext; a DiT image always lists
    ``proportional``, so a DiT image without it (made before it existed) pastes back off."""
    webui = WebUI(_a1111_sd3())
    res = webui.generate(tome={"enabled": True, "preset": "quality"}, seed=3)
    out = capsys.readouterr().out
    assert out.count("ToMe DiT: first pass x8 in all blocks") == 1, out
    assert "ToMe DiT: first pass x8 in all blocks" in res.info
    assert "rope" not in res.info.split("ToMe DiT: ")[1].split(",")[0]  # SD3 has no RoPE
    assert "ToMe proportional: True" in res.info and "ToMe reuse: " in res.info
    named = dict(zip(settings.ARGS, webui.paste("txt2img", res.info)))
    assert named["proportional"] is True and named["preset"] == "Quality"
    old = "x\nSteps: 3, ToMe method: downsample, ToMe rope: before"  # a DiT image, older
    assert dict(zip(settings.ARGS, webui.paste("txt2img", old)))["proportional"] is False
    unet = "x\nSteps: 3, ToMe method: downsample"  # no DiT key: a UNet image, bias irrelevant
    assert dict(zip(settings.ARGS, webui.paste("txt2img", unet)))["proportional"] is True


def test_a_unet_image_lists_no_dit_field(webui):
    res = webui.generate(tome=on(preset="fast"))
    assert "ToMe preset: fast" in res.info
    for key in ("ToMe schedule", "ToMe reuse", "ToMe proportional", "ToMe rope"):
        assert key not in res.info
    assert dict(zip(settings.ARGS, webui.paste("txt2img", res.info)))["preset"] == "Fast"
