"""``/sdapi/v1/txt2img`` and ``img2img`` argument handling, errors and per-request settings."""

import pytest
from webui_stub.harness import WebUI, shared

import tome


@pytest.fixture
def webui():
    return WebUI()


def request(args, **payload):
    return {"alwayson_scripts": {"ToMe": {"args": args}}, **payload}


def ratios(webui):
    return sorted({(c.hr, None if c.config is None else c.config.ratio) for c in webui.calls})


def test_dict_args_with_missing_keys_taking_defaults(webui):
    r = webui.api("txt2img", request([{"enabled": True, "ratio": 0.5, "sx": 2, "sy": 2,
                                       "max_downsample": 1}]))
    assert r["status"] == 200
    assert "ToMe ratio: 0.5" in r["info"] and "ToMe max downsample: 1" in r["info"]
    assert {c.config.max_downsample for c in webui.calls} == {1}

    webui.calls.clear()
    r = webui.api("img2img", request([{"enabled": True}]))
    assert r["status"] == 200 and ratios(webui) == [(False, 0.5)]


def test_positional_args_and_case_insensitive_title(webui):
    r = webui.api("txt2img", {"alwayson_scripts": {"tome": {"args": [True, 0.25, 2, 2, "2"]}}})
    assert r["status"] == 200 and ratios(webui) == [(False, 0.25)]
    assert {c.config.max_downsample for c in webui.calls} == {2}


def test_no_args_means_off(webui):
    r = webui.api("txt2img", {"prompt": "x"})
    assert r["status"] == 200 and ratios(webui) == [(False, None)]


@pytest.mark.parametrize("args, message", [
    ({"ratio": 2}, "ratio=2.0: must be in [0, 0.75] for a 2x2 stride"),
    ({"sx": 0}, "sx=0: must be a positive integer"),
    ({"ratio": "fast"}, "ratio='fast': expected a number"),
    ({"max_downsample": 3}, "max_downsample=3: must be one of (1, 2, 4, 8)"),
    ({"hr_ratio": 0.8}, "hr_ratio=0.8: must be in [0, 0.75]"),
    ({"method": "pool"}, "method='pool': must be one of ('merge', 'downsample')"),
    ({"rato": 0.5}, "unknown setting(s) ['rato']"),
    ({"start": 0.9, "end": 0.1}, "start=0.9: must not be after end=0.1"),
])
def test_invalid_values_fail_the_request_with_a_clear_message(webui, args, message):
    r = webui.api("txt2img", request([{"enabled": True, **args}], enable_hr=True))
    assert r["status"] == 500 and r["error"] == "ValueError"
    assert message in r["errors"]
    assert not webui.calls and not tome.is_patched(shared.sd_model)


def test_invalid_positional_value(webui):
    r = webui.api("txt2img", request([True, 0.5, "wide"]))
    assert r["status"] == 500 and "sx='wide'" in r["errors"]


def test_invalid_setting_in_override_settings(webui):
    r = webui.api("txt2img", request([{"enabled": True}], enable_hr=True,
                                     override_settings={"tome_hr_ratio": 0.9}))
    assert r["status"] == 500 and "tome_hr_ratio" in r["errors"] and "[0, 0.75]" in r["errors"]
    assert not webui.calls and not tome.is_patched(shared.sd_model)


def test_a_disabled_extension_never_fails_a_request(webui):
    r = webui.api("txt2img", request([{"enabled": False, "ratio": 7, "sx": "?"}]))
    assert r["status"] == 200 and ratios(webui) == [(False, None)]


def test_settings_through_override_settings_are_per_request(webui):
    r = webui.api("txt2img", request([{"enabled": True, "ratio": 0.4}], enable_hr=True,
                                     override_settings={"tome_hires_only": True}))
    assert r["status"] == 200 and ratios(webui) == [(False, None), (True, 0.4)]
    assert shared.opts.tome_hires_only is False  # restored, though never saved by the user
    webui.calls.clear()
    webui.api("txt2img", request([{"enabled": True, "ratio": 0.4}], enable_hr=True))
    assert ratios(webui) == [(False, 0.4), (True, 0.4)]


def test_infotext_in_the_request_fills_the_script_args(webui):
    first = webui.api("txt2img", request([{"enabled": True, "ratio": 0.3, "use_rand": False,
                                           "max_downsample": 2}]))
    webui.calls.clear()
    again = webui.api("txt2img", {"infotext": first["info"]})
    assert again["status"] == 200
    assert {(c.config.ratio, c.config.use_rand, c.config.max_downsample)
            for c in webui.calls} == {(0.3, False, 2)}
    assert again["images"][0].equal(first["images"][0])
