import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(int(os.environ.get("TOME_TEST_THREADS", "1")))


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Measurements go to a fresh folder, never the user's cache."""
    os.environ["TOME_CACHE_DIR"] = str(tmp_path_factory.mktemp("tome-cache"))


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(autouse=True)
def _compiled_again():
    """The eager stance a refreshing call takes (``reuse._Eager``, process-wide) is left
    after each test: unit tests call ``Reuse.begin`` without a host bracket to end it, and a
    later test's compiled model would run eager."""
    yield
    from tome import reuse
    reuse.EAGER.clear()


@pytest.fixture(scope="module")
def sd15():
    """A tiny SD1.5-layout ldm UNet (same levels and 16 blocks), random weights."""
    from models import TINY_SD15, ldm_unet
    return ldm_unet(TINY_SD15)


@pytest.fixture(scope="module")
def dif():
    """A tiny diffusers UNet with SD1.5's layout, random weights."""
    from models import diffusers_unet
    return diffusers_unet("sd15")


@pytest.fixture(scope="module")
def inputs():
    """(x, t, context) for ``sd15``: batch 2, a 32x32 latent."""
    from models import ldm_inputs
    return ldm_inputs(2, 32, 32)


@pytest.fixture(autouse=True)
def _webui_thresholds(request, monkeypatch):
    """WebUI tests decide by the token thresholds (measuring on this CPU takes seconds and
    gives machine-dependent answers); tests marked ``measure`` measure, with a fake clock."""
    if "webui" not in request.node.nodeid or request.node.get_closest_marker("measure"):
        return
    from tome.webui import host
    monkeypatch.setattr(host, "measurer", lambda cfg: None)


@pytest.fixture
def lines(monkeypatch):
    """The console lines of the ComfyUI layer (``tome.comfy.host.console``)."""
    from tome.comfy import host
    said = []
    monkeypatch.setattr(host, "console", said.append)
    return said
