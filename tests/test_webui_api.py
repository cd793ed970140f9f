"""``/sdapi/v1/txt2img`` and ``img2img`` argument handling, errors and per-request settings."""

import pytest
from webui_stub.harness import WebUI, api_error, errors, shared

import tome
from tome.config import preset


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
    ({"policy": "smart"}, "policy='smart': must be one of ('fixed', 'auto')"),
    ({"preset": "turbo"}, "preset='turbo': expected one of Custom, Quality, Balanced, Fast"),
    ({"rato": 0.5}, "unknown setting(s) ['rato']"),
    ({"start": 0.9, "end": 0.1}, "start=0.9: must not be after end=0.1"),
])
def test_invalid_values_are_answered_422_with_one_console_line(webui, capsys, args, message):
    r = webui.api("txt2img", request([{"enabled": True, **args}], enable_hr=True))
    assert r["status"] == 422 and r["error"] == "ToMeSettingsError"
    assert message in r["errors"] and r["detail"] == r["errors"]
    assert r["errors"].startswith("ToMe: invalid") or r["errors"].startswith("ToMe: unknown")
    assert not webui.calls and not tome.is_patched(shared.sd_model)
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("ToMe")] == [
        f"{r['errors']}; the generation is stopped"]
    assert "Traceback" not in out + err and not errors.reported


def test_forge_answers_the_same_error_422_under_detail(webui, capsys):
    r = webui.api("txt2img", request([{"enabled": True, "ratio": 2}]), host="forge")
    assert r == {"status": 422, "detail": "ToMe: invalid ratio=2.0: must be in [0, 0.75] for a "
                                          "2x2 stride (1 - 1/(sx*sy))"}
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and not errors.reported


def test_the_stub_answers_other_errors_500_with_a_traceback_like_the_hosts():
    a1111 = api_error(RuntimeError("boom"), "a1111")
    assert a1111 == {"status": 500, "error": "RuntimeError", "detail": "", "body": "",
                     "errors": "boom"}
    forge = api_error(RuntimeError("boom"), "forge")
    assert forge["status"] == 500 and forge["message"] == "boom"
    assert len(errors.reported) == 2


def test_the_ui_shows_the_error_as_a_readable_message(webui):
    html = webui.ui_generate(tome=[True, 0.9])
    assert html.startswith("<div class='error'>ToMeSettingsError: ToMe: invalid ratio=0.9: ")
    assert "must be in [0, 0.75] for a 2x2 stride" in html and not webui.calls


def test_invalid_positional_value(webui):
    r = webui.api("txt2img", request([True, 0.5, "wide"]))
    assert r["status"] == 422 and "sx='wide'" in r["errors"]


def test_invalid_setting_in_override_settings(webui):
    r = webui.api("txt2img", request([{"enabled": True}], enable_hr=True,
                                     override_settings={"tome_hr_ratio": 0.9}))
    assert r["status"] == 422 and "tome_hr_ratio" in r["errors"] and "[0, 0.75]" in r["errors"]
    assert not webui.calls and not tome.is_patched(shared.sd_model)


def test_settings_errors_are_value_errors_even_without_fastapi(monkeypatch):
    import builtins

    from tome.webui import script_args as settings
    real = builtins.__import__

    def no_fastapi(name, *args, **kwargs):
        if name.startswith("fastapi"):
            raise ImportError(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_fastapi)
    monkeypatch.setattr(settings, "_error_classes", [])
    e = settings.invalid(ValueError("ToMe: invalid ratio=2: x"))
    assert type(e) is settings.SettingsError and isinstance(e, ValueError)
    assert str(e) == "ToMe: invalid ratio=2: x" and vars(e)["status_code"] == 422


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
                                           "max_downsample": 2, "policy": "fixed"}]))
    webui.calls.clear()
    again = webui.api("txt2img", {"infotext": first["info"]})
    assert again["status"] == 200
    assert {(c.config.ratio, c.config.use_rand, c.config.max_downsample)
            for c in webui.calls} == {(0.3, False, 2)}
    assert again["images"][0].equal(first["images"][0])


def test_infotext_of_an_auto_image_that_merged_nothing_turns_tome_off(webui):
    first = webui.api("txt2img", request([{"enabled": True, "ratio": 0.3}]))
    assert "ToMe merged: first pass none" in first["info"]
    webui.calls.clear()
    again = webui.api("txt2img", {"infotext": first["info"]})
    assert {c.config for c in webui.calls} == {None}
    assert again["images"][0].equal(first["images"][0])


def test_defaults_use_the_auto_policy(webui):
    webui.api("txt2img", request([{"enabled": True}]))
    assert {c.config.policy for c in webui.calls} == {"auto"}
    webui.calls.clear()
    # a client from before the policy existed: 16 positional values, the rest are defaults
    webui.api("txt2img", request([True, 0.4, 2, 2, "auto", False, 0.0, "merge", 2, 0.0, 1.0,
                                  True, True, False, False, "global"]))
    assert {(c.config.ratio, c.config.policy) for c in webui.calls} == {(0.4, "auto")}
    webui.calls.clear()
    webui.api("txt2img", request([{"enabled": True, "policy": "fixed"}]))
    assert {c.config.policy for c in webui.calls} == {"fixed"}


def test_preset_by_name_with_explicit_keys_overriding_it(webui):
    r = webui.api("txt2img", request([{"enabled": True, "preset": "fast"}]))
    assert r["status"] == 200
    assert {c.config for c in webui.calls} == {preset("fast", seed=1)}
    assert "ToMe preset: fast" in r["info"]

    webui.calls.clear()
    r = webui.api("img2img", request([{"enabled": True, "preset": "Balanced", "ratio": 0.3,
                                       "policy": "fixed"}]))
    assert {c.config for c in webui.calls} == {preset("balanced", ratio=0.3, policy="fixed",
                                                      seed=1)}


def test_positional_preset_wins_over_the_individual_values(webui):
    values = [True, 0.3, 3, 3, "1", False, 0.0, "merge", 2, 0.0, 1.0, True, True, False,
              False, "global", "level", "fixed", "Quality"]
    r = webui.api("txt2img", request(values))
    assert r["status"] == 200 and {c.config for c in webui.calls} == {preset("quality", seed=1)}
    webui.calls.clear()
    webui.api("txt2img", request(values[:-1] + ["Custom"]))
    assert {(c.config.ratio, c.config.sx, c.config.policy) for c in webui.calls} == {
        (0.3, 3, "fixed")}
