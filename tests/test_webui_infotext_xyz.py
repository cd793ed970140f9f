"""Infotext written under each image and read back into the controls; XYZ plot axes."""

import pytest
import torch
from webui_stub.harness import PAIR, WebUI, parse_generation_parameters

from tome.webui import infotext
from tome.webui import script_args as settings


@pytest.fixture
def webui():
    return WebUI()


CASES = [
    {"ratio": 0.3},
    {"ratio": 0.6, "sx": 3, "sy": 2, "max_downsample": "2", "use_rand": False,
     "merge_attn": False, "merge_crossattn": True, "merge_mlp": True, "matching": "local"},
    {"ratio": 0.4, "hires_only": True, "hr_ratio": 0.7, "start": 0.1, "end": 0.9},
    {"method": "downsample", "downsample_factor": 3},
    {"ratio": 0.4, "policy": "fixed", "share": "block"},
    {"preset": "Fast", "ratio": 0.7, "sx": 4},  # the preset wins over the controls
    {"preset": "Balanced", "hires_only": True, "hr_ratio": 0.6},
]


def ui_args(**named):
    """The positional args the UI would send, starting from the UI's defaults."""
    base = dict(zip(settings.ARGS, [False, 0.5, 2, 2, "auto", False, 0.0, "merge", 2, 0.0, 1.0,
                                    True, True, False, False, "global", "level", "auto",
                                    "Custom", "pooled", "all"]))
    base.update({n: getattr(settings.DEFAULT, n) for n in settings.LATER})  # later fields
    return [{**base, "enabled": True, **named}[n] for n in settings.ARGS]


@pytest.mark.parametrize("named", CASES)
def test_paste_restores_every_control(webui, named):
    args = ui_args(**named)
    res = webui.generate(tome=args, enable_hr=True)
    last = res.info.split("\n")[-1]
    assert all(k.startswith("ToMe ") for k, _ in PAIR.findall(last)
               if k not in ("Steps", "Seed", "Size", "Denoising strength"))
    blank = webui.paste("txt2img", "a dog\nSteps: 3, Seed: 1")  # off, defaults untouched
    assert blank[0] is False
    pasted = webui.paste("txt2img", res.info)
    original = settings.parse_args(args)
    if named.get("method") == "downsample":  # ratio and stride cannot change such an image
        original = original.replace(config=original.config.replace(ratio=0.5))
    if original.config.policy == "auto":
        # the auto policy merged nothing at these sizes (CPU thresholds): pasting turns ToMe
        # off, which reproduces the image, and restores every other control as it was
        assert "hires pass none" in res.info and "ds1" not in res.info.split("ToMe merged:")[1]
        assert pasted[0] is False
        pasted_on = [True, *pasted[1:]]
        assert settings.parse_args(pasted_on) == original
    else:
        assert settings.parse_args(pasted) == original
    for value, default in zip(pasted, ui_args()):  # the UI turns ints into floats, as here
        assert type(value) is type(default) or (type(value), type(default)) == (float, int)

    webui.calls.clear()
    again = webui.generate(tome=pasted, enable_hr=True)
    assert torch.equal(torch.stack(again.images), torch.stack(res.images))


def test_png_info_send_to_img2img_restores_the_img2img_controls(webui):
    res = webui.generate("img2img", tome=ui_args(ratio=0.35, use_rand=False, policy="fixed"))
    pasted = webui.paste("img2img", res.info)
    assert pasted[settings.ARGS.index("ratio")] == 0.35
    assert pasted[settings.ARGS.index("use_rand")] is False and pasted[0] is True


def test_pasting_an_image_made_without_tome_turns_it_off(webui):
    current = list(webui.api_defaults["txt2img"])
    s = webui.script()
    current[s.args_from] = True
    pasted = webui.paste("txt2img", "a cat\nSteps: 20, Seed: 3, Token merging ratio: 0.5",
                         current)
    assert pasted[0] is False


def test_keys_never_clash_with_the_builtin(webui):
    for key in infotext.ALL_KEYS:
        assert key.startswith("ToMe ") and "Token merging" not in key
        assert PAIR.fullmatch(f"{key}: 1")
    text = "x\nSteps: 3, ToMe skipped: \"1 block(s): forward shadowed, by ControlNet\""
    assert parse_generation_parameters(text)["ToMe skipped"].endswith("by ControlNet")


def test_xyz_cells_each_get_their_own_settings_and_infotext(webui):
    cells = webui.xyz("txt2img", "[ToMe] Ratio", ["0.2", "0.6"], tome=ui_args(enabled=False))
    assert [c.info.split("ToMe ratio: ")[1][:3] for c in cells] == ["0.2", "0.6"]
    assert sorted({c.config.ratio for c in webui.calls}) == [0.2, 0.6]

    webui.calls.clear()
    cells = webui.xyz("txt2img", "[ToMe] Enabled", ["True", "False"], tome=ui_args(ratio=0.4))
    assert "ToMe ratio: 0.4" in cells[0].info and "ToMe" not in cells[1].info
    assert {c.config is None for c in webui.calls} == {True, False}


@pytest.mark.parametrize("label, values, field, expected", [
    ("[ToMe] Stride", ["2x2", "4x2", "3"], ("sx", "sy"), [(2, 2), (4, 2), (3, 3)]),
    ("[ToMe] Max downsample", ["auto", "1", "2"], ("max_downsample",), [(None,), (1,), (2,)]),
    ("[ToMe] Method", ["merge", "downsample"], ("method",), [("merge",), ("downsample",)]),
    ("[ToMe] Matching", ["global", "local"], ("matching",), [("global",), ("local",)]),
    ("[ToMe] Start", ["0", "0.5"], ("start",), [(0.0,), (0.5,)]),
    ("[ToMe] Plan sharing", ["block", "level"], ("share",), [("block",), ("level",)]),
])
def test_xyz_axes(webui, label, values, field, expected):
    webui.xyz("txt2img", label, values)
    got = []
    for c in webui.calls:
        item = tuple(getattr(c.config, f) for f in field)
        if item not in got:
            got.append(item)
    assert got == expected


def test_xyz_hires_axes(webui):
    cells = webui.xyz("txt2img", "[ToMe] Hires only", ["True", "False"],
                      tome=ui_args(ratio=0.3, hr_ratio=0.5), enable_hr=True)
    assert "ToMe hires only: True" in cells[0].info and "hires only" not in cells[1].info
    firsts = [c.config for c in webui.calls if not c.hr]
    assert firsts[0] is None and firsts[-1].ratio == 0.3


@pytest.mark.parametrize("label, values, message", [
    ("[ToMe] Ratio", ["0.5", "1.5"], "ratio=1.5"),
    ("[ToMe] Stride", ["2x2", "0x2"], "sx=0"),
    ("[ToMe] Stride", ["big"], "invalid stride 'big'"),
    ("[ToMe] Method", ["merge", "magic"], "method='magic'"),
    ("[ToMe] Preset", ["Fast", "warp"], "preset=.warp."),
])
def test_xyz_bad_values_fail_before_any_cell(webui, label, values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        webui.xyz("txt2img", label, values)
    assert not webui.calls


@pytest.mark.parametrize("tome, stride", [({"enabled": True}, "2x2"),
                                          ({"enabled": True, "sx": 3, "sy": 2}, "3x2")])
def test_xyz_errors_name_the_request_s_own_stride(webui, tome, stride):
    with pytest.raises(ValueError, match=f"ratio=1.5: must be in .* for a {stride} stride"):
        webui.xyz("txt2img", "[ToMe] Ratio", ["1.5"], tome=tome)


def test_xyz_ratio_that_only_a_stride_axis_allows_waits_for_its_cell(webui):
    webui.xyz("txt2img", "[ToMe] Ratio", ["0.85"], tome={"enabled": True, "sx": 4, "sy": 4})
    with pytest.raises(ValueError, match="ratio=0.85: must be in .* for a 2x2 stride"):
        webui.xyz("txt2img", "[ToMe] Ratio", ["0.85"], tome={"enabled": True})


def test_an_image_from_before_the_policy_pastes_as_fixed(webui):
    old = "a cat\nSteps: 3, Seed: 1, Size: 128x128, ToMe ratio: 0.4, ToMe max downsample: 2"
    pasted = webui.paste("txt2img", old)
    named = dict(zip(settings.ARGS, pasted))
    assert named["policy"] == "fixed" and named["preset"] == "Custom" and named["enabled"]
    cfg = settings.parse_args(pasted).config
    assert (cfg.ratio, cfg.max_downsample, cfg.policy) == (0.4, 2, "fixed")
    # ... while a new image with the UI's defaults records its auto policy
    res = webui.generate(tome=ui_args(ratio=0.4))
    assert "ToMe policy: auto" in res.info
    assert dict(zip(settings.ARGS, webui.paste("txt2img", res.info)))["policy"] == "auto"


def test_a_preset_is_restored_only_while_it_means_the_same_settings(webui):
    res = webui.api("txt2img", {"alwayson_scripts": {"ToMe": {"args": [
        {"enabled": True, "preset": "fast", "max_downsample": 1}]}}})
    assert "ToMe preset: fast" in res["info"] and "ToMe max downsample: 1" in res["info"]
    named = dict(zip(settings.ARGS, webui.paste("txt2img", res["info"])))
    assert named["preset"] == "Custom" and named["max_downsample"] == "1"
    assert named["method"] == "downsample" and named["downsample_factor"] == 4
    line = "x\nSteps: 3, ToMe preset: fast, ToMe method: downsample, ToMe downsample factor: " \
           "4, ToMe max downsample: 2, ToMe policy: auto"
    assert dict(zip(settings.ARGS, webui.paste("txt2img", line)))["preset"] == "Fast"
    assert dict(zip(settings.ARGS, webui.paste("txt2img", "x\nSteps: 3, ToMe preset: warp, "
                                               "ToMe ratio: 0.3")))["preset"] == "Custom"


def test_xyz_preset_and_policy_axes(webui):
    from tome.config import preset

    webui.xyz("txt2img", "[ToMe] Preset", ["Quality", "Fast", "Custom"], tome=ui_args(ratio=0.3))
    got = []
    for c in webui.calls:
        if c.config.replace(seed=0) not in got:
            got.append(c.config.replace(seed=0))
    assert got == [preset("quality"), preset("fast"), settings.DEFAULT.replace(ratio=0.3)]

    webui.calls.clear()
    webui.xyz("txt2img", "[ToMe] Policy", ["fixed", "auto"])
    assert [c.config.policy for c in webui.calls][::3] == ["fixed", "auto"]

    webui.calls.clear()  # an axis value is explicit: it overrides the UI's preset
    webui.xyz("txt2img", "[ToMe] Ratio", ["0.2"], tome=ui_args(preset="Balanced", ratio=0.7))
    assert {c.config.replace(seed=0) for c in webui.calls} == {preset("balanced", ratio=0.2)}
