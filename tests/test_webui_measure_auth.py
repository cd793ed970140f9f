"""Measure now behind the host's login: the Settings button is a gradio event (gradio's login
and queue apply), and ``POST /tome/measure`` exists only where the host serves its API,
registered through the host's API object (its login), JSON only (no cross-site form post).
Against the stand-ins' ``launch()`` (A1111's ``webui.py``, SD.Next's), with real gradio and
FastAPI apps driven over HTTP."""

import pytest
from fastapi.testclient import TestClient
from webui_stub import sdnext
from webui_stub.harness import WebUI, launch, press, sd_models, shared, tiny_model

from tome.webui import measure_now

pytestmark = pytest.mark.measure

BUTTON = "tome_measure_now_button"  # the Settings button's elem_id
MEASURED = 1 + 2 * 3  # the table: a header, 2 methods x 3 sizes x 1 level
SIZES = {"SDXL": (128, 192), "": (64, 96, 128)}  # small: a merge plan at 1024 px takes seconds


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """The WebUI's measuring service with a fake clock (blocks never run, only plans are
    built) and a cache of this test's own; what the clock timed."""
    from stubs import fake_clock

    from tome import memory
    from tome.measurements import MeasurementCache, Measurer
    from tome.webui import host

    timed = []
    service = Measurer(MeasurementCache(tmp_path / "m.json"), progress=host.show_progress,
                       rounds=2, warmup=0, clock=fake_clock(1.5, timed, run_blocks=False))
    monkeypatch.setattr(host, "_services", [service])
    monkeypatch.setattr(memory, "available", lambda device: 1 << 50)
    monkeypatch.setattr(measure_now, "SIZES", SIZES)
    return timed


def tome_routes(app):
    return [r.path for r in app.routes if getattr(r, "path", "").startswith("/tome")]


def login(client, user="u", password="p"):
    r = client.post("/login", data={"username": user, "password": password})
    assert r.status_code == 200, r.text


def answer(response):
    assert response.status_code == 200, response.text
    return response.json()["data"][0]


# ----------------------------------------------------------------------------- A1111, Forge

@pytest.mark.parametrize("flags", [{}, {"gradio_auth": "u:p"}, {"api_auth": "u:p"}])
def test_no_route_without_the_api(calls, flags):
    """Without ``--api`` the host serves no API, so ToMe adds no route (it used to add
    ``/tome/measure`` to every app, answering anyone)."""
    WebUI(**flags)
    app = launch()
    assert tome_routes(app) == []
    assert TestClient(app).post(measure_now.ROUTE, json={}).status_code in (404, 405)
    assert not calls


def test_api_auth_guards_the_route(calls):
    WebUI(api=True, api_auth="u:p")
    client = TestClient(launch())
    for auth in (None, ("u", "wrong"), ("x", "p")):
        r = client.post(measure_now.ROUTE, json={}, auth=auth)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Basic"
    assert not calls
    r = client.post(measure_now.ROUTE, json={}, auth=("u", "p"))
    assert r.status_code == 200 and r.json()["html"].count("<tr>") == MEASURED and calls


def test_nowebui_serves_the_route_behind_api_auth(calls):
    """``--nowebui``: no UI (``demo`` is None), the API alone."""
    WebUI(nowebui=True, api_auth="u:p")
    client = TestClient(launch())
    assert client.post(measure_now.ROUTE, json={}).status_code == 401 and not calls
    assert client.get("/sdapi/v1/sd-models").status_code == 401  # the host's own, alike
    r = client.post(measure_now.ROUTE, json={}, auth=("u", "p"))
    assert r.status_code == 200 and "<svg" in r.json()["html"]


def test_without_api_auth_the_route_is_as_open_as_the_hosts_api(calls):
    """``--api`` alone: the host's API answers anyone, and so does the route (the host's
    choice; ``--api-auth`` closes both)."""
    WebUI(api=True, gradio_auth="u:p")
    client = TestClient(launch())
    assert client.get("/sdapi/v1/sd-models").status_code == 200
    assert client.post(measure_now.ROUTE, json={}).status_code == 200


@pytest.mark.parametrize(("kind", "body"), [
    ("application/x-www-form-urlencoded", "a=1"),
    ("multipart/form-data; boundary=x",
     "--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--\r\n"),
    ("text/plain", "{}"),
    (None, "{}"),  # a fetch with a Blob body sends no content type, and no preflight
])
def test_what_a_cross_site_page_can_post_is_refused(calls, kind, body):
    """A page on another site can make the browser post a form or text without asking (with
    the user's saved Basic credentials): only ``application/json`` is accepted."""
    WebUI(api=True, api_auth="u:p")
    client = TestClient(launch())
    headers = {} if kind is None else {"Content-Type": kind}
    r = client.post(measure_now.ROUTE, content=body, headers=headers, auth=("u", "p"))
    assert r.status_code == 415 and "application/json" in r.json()["detail"]
    assert not calls


@pytest.mark.parametrize(("body", "status", "says"), [
    ("[]", 422, "takes a JSON object"),
    ('{"sizes": [512]}', 422, "unknown setting(s) ['sizes']"),
    ("{", 400, "the body is not JSON"),
])
def test_a_body_that_is_not_an_empty_object_is_refused(calls, body, status, says):
    WebUI(api=True)
    r = TestClient(launch()).post(measure_now.ROUTE, content=body,
                                  headers={"Content-Type": "application/json"})
    assert r.status_code == status and says in r.json()["detail"] and not calls


def test_each_press_measures_again_the_api_may_read_the_cache(calls):
    """Measure now drops the readings it shows and takes them again (a bad reading is not
    kept); ``{"remeasure": false}`` shows the cached ones as they are."""
    WebUI(api=True)
    client = TestClient(launch())
    first = answer(press(client, BUTTON))
    assert calls and first.count("<tr>") == MEASURED
    calls.clear()
    assert answer(press(client, BUTTON)).count("<tr>") == MEASURED and calls
    calls.clear()
    r = client.post(measure_now.ROUTE, json={"remeasure": False})
    assert r.status_code == 200 and r.json()["html"].count("<tr>") == MEASURED and not calls
    r = client.post(measure_now.ROUTE, json={"remeasure": "no"})
    assert r.status_code == 422 and "remeasure='no': expected true or false" in r.text
    assert client.post(measure_now.ROUTE, json={}).status_code == 200 and calls


def test_only_post(calls):
    WebUI(api=True)
    assert TestClient(launch()).get(measure_now.ROUTE).status_code == 405 and not calls


def test_the_settings_button_runs_behind_the_ui_login(calls):
    """``--gradio-auth`` without ``--api``: the button's event answers only a logged-in
    session, and answers it with the table and the plot."""
    WebUI(gradio_auth="u:p")
    client = TestClient(launch())
    assert press(client, BUTTON).status_code == 401 and not calls
    r = client.post("/run/predict", json={"fn_index": 0, "data": [], "session_hash": "s"})
    assert r.status_code == 401 and not calls
    login(client)
    page = answer(press(client, BUTTON))
    assert page.count("<tr>") == MEASURED and "<svg" in page and calls
    assert "128x128</td><td>ds1</td><td>256</td>" in page and "1.50x" in page


def test_the_settings_button_sits_in_settings_with_its_help_text(calls):
    """The option's own component (what "Apply settings" reads back) is the help text; its
    value is never saved."""
    webui = WebUI()
    info = shared.opts.data_labels["tome_measure_now"]
    assert info.do_not_save and "tome_measure_now" not in shared.opts.data
    assert webui.settings["tome_measure_now"].value == measure_now.HELP
    assert not shared.opts.set("tome_measure_now", "<p>other</p>")
    assert "Measured on" in answer(press(TestClient(launch()), BUTTON))


def test_the_answer_escapes_what_it_quotes(calls, monkeypatch, capsys):
    """A message quoted in the page (a checkpoint that failed to load, a failure while
    measuring, a size's reason) is text, never markup."""
    WebUI(gradio_auth="u:p")
    client = TestClient(launch())
    login(client)
    evil = "<img src=x onerror=alert(1)>"

    def fail():
        raise RuntimeError(evil)
    monkeypatch.setattr(sd_models, "forge_model_reload", fail, raising=False)
    page = answer(press(client, BUTTON))
    assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    monkeypatch.delattr(sd_models, "forge_model_reload")

    monkeypatch.setattr(measure_now, "survey", lambda *a, **k: (_ for _ in ()).throw(
        ValueError(evil)))
    page = answer(press(client, BUTTON))
    assert page == ("<p>ToMe: Measure now failed: ValueError: &lt;img src=x onerror=alert(1)"
                    "&gt;</p>")
    assert capsys.readouterr().out.count(f"ToMe: Measure now failed: ValueError: {evil}") == 1

    from tome.survey import Survey
    monkeypatch.setattr(measure_now, "survey", lambda *a, **k: Survey(
        missed=[("merge", 512, f"ToMe: {evil}")]))
    page = answer(press(client, BUTTON))
    assert "<img" not in page and "skipped: &lt;img" in page
    assert shared.sd_model is not None  # the WebUI stays up


# ----------------------------------------------------------------------------- SD.Next

@pytest.fixture
def sdnext_webui():
    sdnext.enter()
    try:
        yield
    finally:
        sdnext.leave()


def sdnext_start(**flags):
    from models import diffusers_unet

    webui = WebUI(sdnext.Pipeline(diffusers_unet("sd15")), **flags)
    sdnext.add_options()
    return webui


def test_sdnext_route_asks_for_its_auth_users(calls, sdnext_webui):
    """SD.Next serves its API always and guards it with ``--auth`` only under ``--api-only``
    (its own routes answer anyone otherwise): the ToMe route asks for those users in both."""
    sdnext_start(auth="u:p")
    client = TestClient(sdnext.launch())
    assert client.get("/sdapi/v1/sd-models").status_code == 200  # SD.Next's own choice
    r = client.post(measure_now.ROUTE, json={})
    assert r.status_code == 401 and not calls
    r = client.post(measure_now.ROUTE, data={"a": "1"}, auth=("u", "p"))
    assert r.status_code == 415 and not calls
    r = client.post(measure_now.ROUTE, json={}, auth=("u", "p"))
    assert r.status_code == 200 and "<svg" in r.json()["html"] and calls


def test_sdnext_api_only_guards_the_route_like_its_own(calls, sdnext_webui):
    sdnext_start(auth="u:p", api_only=True)
    client = TestClient(sdnext.launch())
    shared.sd_model = None  # answers at once: "no model is loaded yet"
    assert client.get("/sdapi/v1/sd-models").status_code == 401
    assert client.post(measure_now.ROUTE, json={}).status_code == 401
    r = client.post(measure_now.ROUTE, json={}, auth=("u", "p"))
    assert r.status_code == 200 and "no model is loaded yet" in r.json()["html"]


def test_sdnext_without_auth_the_route_is_as_open_as_its_api(calls, sdnext_webui):
    sdnext_start()
    shared.sd_model = None
    r = TestClient(sdnext.launch()).post(measure_now.ROUTE, json={})
    assert r.status_code == 200 and "no model is loaded yet" in r.json()["html"]


def test_sdnext_accordion_button_runs_behind_the_login(calls, sdnext_webui):
    """SD.Next's Settings shows no button: the accordion's Measure now, a gradio event, runs
    for a logged-in session only."""
    sdnext_start(auth="u:p")
    client = TestClient(sdnext.launch())
    assert press(client, "Measure now").status_code == 401 and not calls
    login(client)
    page = answer(press(client, "Measure now"))
    assert "<svg" in page and "Measured on" in page and calls


def test_sdnext_button_escapes_a_failure(calls, sdnext_webui, monkeypatch):
    sdnext_start()
    client = TestClient(sdnext.launch())
    monkeypatch.setattr(measure_now, "survey", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("<script>x</script>")))
    page = answer(press(client, "Measure now"))
    assert "<script>" not in page and "&lt;script&gt;x&lt;/script&gt;" in page


def test_no_model_says_so_through_the_button(calls):
    WebUI(tiny_model())
    shared.sd_model = None
    page = answer(press(TestClient(launch()), BUTTON))
    assert page == ("<p>ToMe: no model is loaded yet (select a checkpoint, or generate "
                    "once).</p>") and not calls
