"""The WebUI layer in SD.Next (``tests/webui_stub/sdnext.py``: its diffusers path, its own
token merging, its log), through the WebUI stand-in switched to SD.Next's contract."""

import sys
import types

import pytest
import torch
from models import diffusers_unet
from webui_stub import sdnext
from webui_stub.harness import WebUI, shared

import tome


@pytest.fixture
def webui():
    sdnext.enter()
    try:
        ui = WebUI(sdnext.Pipeline(diffusers_unet("sd15")))
        sdnext.add_options()
        yield ui
    finally:
        sdnext.leave()


def generate(webui, tome_args=None, **fields):
    fields = {"steps": 3, "width": 64, "height": 64, **fields}
    p = webui.make_p("txt2img", tome_args, **fields)
    try:
        return sdnext.process_images(p)
    finally:
        p.close()


def on(**named):
    return {"enabled": True, "policy": "fixed", **named}


def image(res):
    return res.images[0]


def merged_calls():
    """Per UNet call: the pass and the ratio (or None) the patch on that UNet had."""
    return [(name, None if (r := tome.patch_report(unet)) is None else r.config.ratio)
            for name, unet in sdnext.calls]


def observe(unet):
    seen = []
    unet.register_forward_pre_hook(lambda m, a: seen.append(
        None if (r := tome.patch_report(m)) is None else r.config.ratio))
    return seen


def test_loads_on_the_legacy_path_with_measure_now_in_the_accordion(webui):
    from tome.webui import settings_tab
    assert not settings_tab.html_options()
    assert "tome_measure_now" not in shared.opts.data_labels
    mod = sys.modules.get("token_merging")
    assert mod is None or mod.LEGACY


def test_merging_changes_the_pixels_and_the_same_seed_repeats_them(webui):
    base = generate(webui)
    a, b = generate(webui, on(ratio=0.5)), generate(webui, on(ratio=0.5))
    assert not torch.equal(image(a), image(base)) and torch.equal(image(a), image(b))
    assert not tome.is_patched(shared.sd_model.unet)  # nothing left after the generation
    assert torch.equal(image(generate(webui)), image(base))


def test_each_pass_gets_its_own_setting(webui):
    """SD.Next calls no hook between its passes: the router picks the setting per UNet call."""
    seen = observe(shared.sd_model.unet)
    hires = {"enable_hr": True, "hr_scale": 1.5, "denoising_strength": 0.5}
    both = generate(webui, on(ratio=0.5), **hires)
    assert seen[-6:] == [0.5] * 6
    seen.clear()
    only = generate(webui, on(ratio=0.5, hires_only=True), **hires)
    assert seen[-6:] == [None] * 3 + [0.5] * 3
    assert "ToMe hires only: True" in only.info
    seen.clear()
    other = generate(webui, on(ratio=0.5, hr_ratio=0.25), **hires)
    assert seen[-6:] == [0.5] * 3 + [0.25] * 3 and "ToMe hr ratio: 0.25" in other.info
    none = generate(webui, **hires)
    for a, b in ((only, none), (only, both), (other, both)):
        assert not torch.equal(image(a), image(b))


def test_the_refiner_gets_the_last_pass_setting(webui):
    shared.sd_refiner = sdnext.Pipeline(diffusers_unet("sd15", seed=1))
    seen = observe(shared.sd_refiner.unet)
    generate(webui, on(ratio=0.4))
    assert seen == [0.4, 0.4] and not tome.is_patched(shared.sd_refiner.unet)


@pytest.mark.parametrize("method", ["ToDo", "ToMe"])
def test_its_own_token_merging_is_off_while_ours_runs(webui, monkeypatch, method):
    from tome.webui import narrate
    monkeypatch.setattr(narrate, "_said_builtin", False)  # said once per process
    key = {"ToDo": "todo_ratio", "ToMe": "tome_ratio"}[method]
    builtin = {"token_merging_method": method, key: 0.5}
    alone = generate(webui, override_settings=builtin)
    ours = generate(webui, on(ratio=0.5))
    both = generate(webui, on(ratio=0.5), override_settings=builtin)
    assert not torch.equal(image(alone), image(ours))
    assert torch.equal(image(both), image(ours))  # merged once, by us
    assert f"{method}: 0.5" in alone.info
    assert ", ToMe: " not in both.info and ", ToDo: " not in both.info  # only ours ran
    assert shared.opts.token_merging_method == "None"  # restored afterwards
    assert any("built-in token merging (token_merging_method=" in line for line in sdnext.LOG)


def test_a_foreign_merging_processor_is_left_alone(webui):
    """Where SD.Next's ToDo is on anyway (applied before us), its processors stay and its
    blocks are skipped with one line; nothing fails and its hooks are not taken for tomesd's."""
    shared.opts.token_merging_method, shared.opts.todo_ratio = "ToDo", 0.5
    pipe = shared.sd_model
    sdnext.apply_builtin(pipe)
    try:
        report = tome.patch.apply(pipe.unet, tome.ToMeConfig(ratio=0.5))
        assert report.skipped and "another token merging's attention processor" in \
            report.skipped[0][1]
        assert not report.replaced_tomesd and pipe.unet._tome_info["hooks"]
        tome.remove_patch(pipe.unet)
    finally:
        sdnext.remove_builtin(pipe)


def test_console_lines_go_to_its_log(webui, capsys):
    generate(webui, on(ratio=0.5))
    assert any(line.startswith("ToMe: SD1 (diffusers) first pass ratio 0.5")
               for line in sdnext.LOG)
    assert "ToMe:" not in capsys.readouterr().out


def test_a_bad_setting_stops_the_generation_with_nothing_patched(webui):
    from tome.webui import script_args
    with pytest.raises(script_args.SettingsError):
        generate(webui, on(ratio=2.0))
    assert not tome.is_patched(shared.sd_model.unet)


def test_an_interrupted_generation_leaves_nothing_behind(webui):
    """SD.Next skips ``postprocess`` when interrupted; its ``after_process`` still runs."""
    try:
        generate(webui, on(ratio=0.5), interrupt_after_base=True, enable_hr=True)
    finally:
        shared.state.interrupted = False
    unet = shared.sd_model.unet
    assert not tome.is_patched(unet) and not unet._forward_pre_hooks


def test_the_cache_lands_in_its_folder_without_a_data_dir(webui, monkeypatch, tmp_path):
    from tome.webui import host
    monkeypatch.delenv("TOME_CACHE_DIR", raising=False)
    fake = types.ModuleType("modules.paths_internal")
    fake.data_path, fake.script_path = "", str(tmp_path)
    monkeypatch.setitem(sys.modules, "modules.paths_internal", fake)
    assert host.cache_path() == tmp_path.resolve() / "cache" / "tome" / "measurements.json"


def test_a_dit_pipeline_gets_each_pass_setting_too(monkeypatch):
    """SD.Next's SD3 pipeline: the router switches the transformer's processors per pass
    (removed inside its own call without breaking torch's held hooks), and everything is
    gone afterwards."""
    import diffusers
    sdnext.enter()
    try:
        torch.manual_seed(0)
        sd3 = diffusers.SD3Transformer2DModel(
            sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
            pooled_projection_dim=24, out_channels=4, pos_embed_max_size=32).eval()
        ui = WebUI(sdnext.Pipeline(transformer=sd3))
        sdnext.add_options()
        seen = []
        sd3.register_forward_pre_hook(lambda m, a: seen.append(
            None if (r := tome.patch_report(m)) is None else r.config.downsample_factor))
        hires = {"enable_hr": True, "hr_scale": 1.5, "denoising_strength": 0.5}
        args = {"enabled": True, "method": "downsample", "policy": "fixed", "hires_only": True}
        only = generate(ui, args, **hires)
        assert seen == [None] * 3 + [2] * 3
        assert not tome.is_patched(sd3) and not sd3._forward_pre_hooks.keys() - {
            next(iter(sd3._forward_pre_hooks))}  # only the observer above is left
        none = generate(ui, **hires)
        assert not torch.equal(image(only), image(none))
        seen.clear()  # a pooled pass after a pooled pass: swapped inside the hires call
        both = generate(ui, {**args, "hires_only": False, "hr_ratio": 0.3}, **hires)
        assert seen == [2] * 6 and not tome.is_patched(sd3)
        assert not torch.equal(image(both), image(only))
    finally:
        sdnext.leave()
