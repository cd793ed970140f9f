"""Bad input over the WebUI's API (``/sdapi/v1/txt2img`` through the stand-in): a value
outside the range its message, slider and node input quote, a schedule too long, a mistyped
setting, blocks beside a schedule: HTTP 422 naming it, one console line, nothing patched
and no step run."""

import pytest
from webui_stub.harness import WebUI, errors, shared

import tome


@pytest.fixture
def webui():
    return WebUI()


def request(args, **payload):
    return {"alwayson_scripts": {"ToMe": {"args": args}}, **payload}


@pytest.mark.parametrize("args, message", [
    ({"sx": 10**6}, "ToMe: invalid sx=1000000: must be a positive integer in [1, 8]"),
    ({"sy": "9"}, "ToMe: invalid sy=9: must be a positive integer in [1, 8]"),
    ({"downsample_factor": 2**40}, "ToMe: invalid downsample_factor=1099511627776: must be a "
                                   "positive integer in [1, 8]"),
    ({"reuse": 10**30}, "ToMe: invalid reuse=1000000000000000000000000000000: must be a "
                        "non-negative integer in [0, 20]"),
    ({"end": "1e9"}, "ToMe: invalid end=1000000000.0: must be a number in [0, 1]"),
    ({"schedule": ",".join(["all:2"] * 100_000)}, "(600001 characters): 100000 items: at most "
                                                  "64"),
    ({"ratoi": 0.5}, "ToMe: unknown setting(s) ['ratoi'] (did you mean 'ratio'?); known: "),
    ({"preset": "fast", "reuse": 10**30}, "ToMe: invalid reuse=1000000000000000000000000000000"),
    # blocks beside a schedule would do nothing (issue 47)
    ({"schedule": "all:8", "blocks": "double"}, "ToMe: invalid blocks='double': schedule='all:8' "
                                                "names the blocks itself"),
])
def test_bad_input_is_answered_422_before_anything_changes(webui, capsys, args, message):
    r = webui.api("txt2img", request([{"enabled": True, **args}]))
    assert r["status"] == 422 and r["error"] == "ToMeSettingsError"
    assert message in r["errors"] and len(r["errors"]) < 1000
    assert not webui.calls and not tome.is_patched(shared.sd_model)
    out, err = capsys.readouterr()
    assert [line for line in out.splitlines() if line.startswith("ToMe")] == [
        f"{r['errors']}; the generation is stopped"]
    assert "Traceback" not in out + err and not errors.reported


def test_the_seed_over_the_api_is_still_explained(webui):
    r = webui.api("txt2img", request([{"enabled": True, "seed": 3}]))
    assert r["status"] == 422 and "['seed']" in r["errors"]
    assert r["errors"].endswith("; the seed is the image seed")
