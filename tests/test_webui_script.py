"""The script as the WebUI loads it: registration, controls (real gradio 3.41), settings, flags."""

import os
import shutil
import subprocess
import sys
import types

import gradio as gr
import pytest
from webui_stub.harness import (
    EXT_ROOT,
    WebUI,
    errors,
    script_callbacks,
    scripts,
    sd_models,
    shared,
    tiny_model,
    xyz_grid,
)

import tome
from tome.config import DIT_FIELDS
from tome.webui import script_args as settings
from tome.webui import ui


@pytest.fixture
def webui():
    return WebUI()


def test_loads_like_the_webui_and_registers_once(webui):
    classes = [d.script_class for d in scripts.scripts_data if d.path.endswith("token_merging.py")]
    assert [c.__name__ for c in classes] == ["ToMeScript"]  # not the Script base class
    for tab in ("txt2img", "img2img"):
        s = webui.script(tab)
        assert s.title() == "ToMe" and s.alwayson and s.section == "accordions"
        assert s.show(tab == "img2img") is scripts.AlwaysVisible
        assert s.args_to - s.args_from == len(settings.ARGS)
    assert not errors.reported
    for kind in ("ui_settings", "before_ui", "model_loaded", "cfg_denoiser", "script_unloaded"):
        assert len(script_callbacks.callbacks[kind]) == 1, kind


def test_controls_follow_the_documented_order_and_types(webui):
    s = webui.script("txt2img")
    values = [c.value for c in s.controls]
    assert values[:21] == [False, 0.5, 2, 2, "auto", False, 0.0, "merge", 2, 0.0, 1.0,
                           True, True, False, False, "global", "level", "auto", "Custom",
                           "pooled", "all"]
    # config fields added later: appended, each with its library default
    assert settings.ARGS[21:] == settings.LATER
    assert values[21:] == [getattr(settings.DEFAULT, n) for n in settings.LATER]
    assert [c.elem_id for c in s.controls[1:3]] == ["script_txt2img_tome_ratio",
                                                    "script_txt2img_tome_sx"]
    assert s.controls[0].accordion_id == "script_txt2img_tome_enabled"
    ratio = s.controls[settings.ARGS.index("ratio")]
    assert ratio.maximum == pytest.approx(0.75) and ratio.minimum == 0
    assert s.controls[settings.ARGS.index("max_downsample")].choices == [
        (c, c) for c in ("auto", "1", "2", "4", "8")]
    assert s.controls[settings.ARGS.index("preset")].choices == [
        (c, c) for c in ("Custom", "Quality", "Balanced", "Fast")]
    assert s.controls[settings.ARGS.index("policy")].choices == [("fixed",) * 2, ("auto",) * 2]
    assert len(s.infotext_fields) == len(settings.ARGS)
    assert all(callable(key) for _, key in s.infotext_fields)


def test_dit_settings_sit_in_their_own_group_with_a_line_on_when_they_matter(webui):
    def inside(block):
        for child in getattr(block, "children", []):
            yield child
            yield from inside(child)

    def group(label, tab="txt2img"):
        (found,) = [b for b in webui.blocks.blocks.values() if isinstance(b, gr.Accordion)
                    and b.label == label and any(f"_{tab}_" in (getattr(c, "elem_id", "") or "")
                                                 for c in inside(b))]
        return list(inside(found))

    for tab in ("txt2img", "img2img"):
        dit = group(ui.DIT_GROUP, tab)
        assert {c.elem_id for c in dit if getattr(c, "elem_id", None)} == {
            f"script_{tab}_tome_{n}" for n in DIT_FIELDS}
        assert [c.value for c in dit if isinstance(c, gr.Markdown)] == [ui.DIT_NOTE]
        unet = {c.elem_id for c in group("Advanced", tab) if getattr(c, "elem_id", None)}
        assert unet and not unet & {f"script_{tab}_tome_{n}" for n in DIT_FIELDS}


def test_ratio_maximum_follows_the_stride(webui):
    clamp = next(f.fn for f in webui.blocks.fns if getattr(f.fn, "__name__", "") == "clamp_ratios")
    r, hr = clamp(4, 4, 0.9, 0.1)
    assert r["maximum"] == pytest.approx(0.9375) and r["value"] == 0.9 and hr["value"] == 0.1
    r, hr = clamp(2, 1, 0.7, 0.6)
    assert r["maximum"] == pytest.approx(0.5) and r["value"] == 0.5 and hr["value"] == 0.5


def test_a_named_preset_shows_its_values_in_greyed_controls(webui):
    show = next(f for f in webui.blocks.fns if getattr(f.fn, "__name__", "") == "show_preset")
    fast = dict(zip(settings.CONFIG_KEYS, show.fn("Fast")))
    assert fast["method"]["value"] == "downsample" and fast["downsample_factor"]["value"] == 4
    assert fast["max_downsample"]["value"] == "2" and fast["policy"]["value"] == "auto"
    assert all(u["interactive"] is False for u in fast.values())
    assert all(u["interactive"] is True and "value" not in u for u in show.fn("Custom"))
    s = webui.script()
    assert show.outputs == [s.controls[settings.ARGS.index(n)] for n in settings.CONFIG_KEYS]


def test_ui_is_free_of_side_effects(webui):
    s = webui.script("img2img")
    before = {k: list(v) for k, v in script_callbacks.callbacks.items()}
    with gr.Blocks():
        again = s.ui(True)
    assert len(again) == len(settings.ARGS)
    assert {k: list(v) for k, v in script_callbacks.callbacks.items()} == before


def test_settings_are_registered_in_their_section(webui):
    for key in ("tome_hires_only", "tome_hr_ratio"):
        assert shared.opts.data_labels[key].section == ("tome", "ToMe")
    assert shared.opts.tome_hires_only is False and shared.opts.tome_hr_ratio == 0.0


def test_xyz_axes_added_once_even_after_reload(webui):
    webui.reload_ui()
    labels = [o.label for o in xyz_grid.axis_options]
    for axis in ("Ratio", "Stride", "Max downsample", "Method", "Hires only", "Enabled", "Preset",
                 "Policy", "Plan sharing"):
        assert labels.count("[ToMe] " + axis) == 1


def test_default_ratio_flag():
    w = WebUI(tome_default_ratio=0.3)
    assert w.script().controls[1].value == 0.3
    assert w.api_defaults["txt2img"][w.script().args_from + 1] == 0.3


def test_bad_default_ratio_flag_is_ignored_with_a_message(capsys):
    w = WebUI(tome_default_ratio=0.9)
    assert w.script().controls[1].value == 0.5
    assert "ignoring --tome-default-ratio 0.9" in capsys.readouterr().out


def test_disable_flag_loads_nothing(capsys):
    w = WebUI(tome_disable=True)
    assert not any(s.title() == "ToMe" for s in w.runners["txt2img"].scripts)
    assert "disabled for this launch" in capsys.readouterr().out
    assert not script_callbacks.callbacks["cfg_denoiser"]
    assert not any(o.label.startswith("[ToMe]") for o in xyz_grid.axis_options)


def test_preload_adds_the_flags():
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("preload.py", os.path.join(EXT_ROOT,
                                                                             "preload.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = argparse.ArgumentParser()
    module.preload(parser)
    ns = parser.parse_args(["--tome-disable", "--tome-default-ratio", "0.4"])
    assert ns.tome_disable is True and ns.tome_default_ratio == 0.4


def test_install_py_is_silent_when_torch_is_new_enough():
    out = subprocess.run([sys.executable, os.path.join(EXT_ROOT, "install.py")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout == "" and out.stderr == ""


def test_another_tome_package_imported_first_is_reported(monkeypatch, tmp_path):
    fake = types.ModuleType("tome")
    fake.__file__ = str(tmp_path / "tome" / "__init__.py")
    monkeypatch.setitem(sys.modules, "tome", fake)
    xyz = scripts.ScriptClassData(xyz_grid.XYZScript, "xyz_grid.py", "", xyz_grid)
    errors.reported.clear()
    scripts.load_scripts([EXT_ROOT], extra=[xyz])
    assert any("was imported from" in r and "pip uninstall tome" in r for r in errors.reported)
    assert not any(d.path.endswith("token_merging.py") for d in scripts.scripts_data)


def test_tooltips_file_is_generated_from_the_metadata():
    with open(os.path.join(EXT_ROOT, "javascript", "tome.js"), encoding="utf-8") as f:
        assert f.read() == ui.tooltips_js(), "regenerate it with tome.webui.ui.tooltips_js()"
    assert set(ui.HELP) == set(settings.ARGS) and all(len(t) > 30 for t in ui.HELP.values())


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed")
def test_tooltips_file_is_valid_javascript():
    subprocess.run(["node", "--check", os.path.join(EXT_ROOT, "javascript", "tome.js")],
                   check=True, timeout=60)


def test_script_file_stays_thin():
    with open(os.path.join(EXT_ROOT, "scripts", "token_merging.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) < 80
    scripts_py = [n for n in os.listdir(os.path.join(EXT_ROOT, "scripts")) if n.endswith(".py")]
    assert scripts_py == ["token_merging.py"]  # the WebUI loads every .py file there


def test_model_loaded_without_a_generation_is_untouched(webui):
    model = tiny_model(seed=3)
    sd_models.load_model(model)
    assert not tome.is_patched(model)
