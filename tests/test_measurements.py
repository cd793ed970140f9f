"""tome.measurements: remembering measurements: the cache key (what changes a timing), the
architecture fingerprint, and the cache file (round trip, corrupt or foreign files ignored and
rewritten, unwritable ones harmless)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from models import TINY_SD15, TINY_SDXL, ldm_unet

from tome import measure as M
from tome import measurements as C
from tome import policy, survey
from tome.config import ToMeConfig

LATENT = (16, 16)


# ----------------------------------------------------------------------------- cache keys

def test_cache_key_parts(sd15, dif, monkeypatch):
    c = ToMeConfig()
    key = C.cache_key(sd15, LATENT, 2, c)
    same = [C.cache_key(sd15, LATENT, 2, c.replace(seed=7, start=0.2, end=0.9, policy="auto",
                                                  use_rand=False)),
            C.cache_key(ldm_unet(TINY_SD15, seed=5), LATENT, 2, c)]  # other weights
    assert all(k == key for k in same)
    other = [C.cache_key(sd15, (16, 24), 2, c), C.cache_key(sd15, LATENT, 1, c),
             C.cache_key(copy.deepcopy(sd15).to(torch.bfloat16), LATENT, 2, c),
             C.cache_key(dif, LATENT, 2, c),
             C.cache_key(ldm_unet({**TINY_SD15, "num_heads": 4}), LATENT, 2, c),
             C.cache_key(sd15, LATENT, 2, c.replace(method="downsample")),
             C.cache_key(sd15, LATENT, 2, c.replace(ratio=0.3)),
             C.cache_key(sd15, LATENT, 2, c.replace(max_downsample=2))]
    monkeypatch.setattr(C, "device_name", lambda device: "Some Other CPU")
    other.append(C.cache_key(sd15, LATENT, 2, c))
    assert len({k.digest for k in [key, *other]}) == len(other) + 1
    parts = key.parts
    assert parts["latent"] == [16, 16] and parts["batch"] == 2 and parts["dtype"] == "float32"
    assert parts["torch"] == torch.__version__ and parts["capability"] is None
    assert parts["attention"].endswith("CrossAttention.forward")
    assert "seed" not in parts["config"] and "use_rand" not in parts["config"]
    assert C.cache_key(dif, LATENT, 2, c).parts["attention"].startswith("AttnProcessor")


def test_fingerprint_is_architecture_only(sd15, dif):
    assert C.fingerprint(sd15) == C.fingerprint(ldm_unet(TINY_SD15, seed=3))
    assert len({C.fingerprint(u) for u in (sd15, dif, ldm_unet(TINY_SDXL))}) == 3


# ----------------------------------------------------------------------------- the cache

def _measurement(latent=(16, 16)):
    row = M.LevelTiming(1, 4096, 1, 1, 2.0, 1.0)
    return M.Measurement("Test CPU", "float32", latent, 2, "merge", (row,))


def _key(latent=(16, 16)):
    return C.CacheKey.of({"device": "Test CPU", "dtype": "float32", "latent": list(latent),
                          "batch": 2, "config": {"method": "merge"}})


def test_cache_round_trip(tmp_path):
    said = []
    cache = C.MeasurementCache(tmp_path / "deep" / "m.json", say=said.append)
    assert cache.get(_key()) is None
    assert cache.put(_key(), _measurement())
    assert cache.put(_key((8, 8)), _measurement((8, 8)))
    fresh = C.MeasurementCache(tmp_path / "deep" / "m.json", say=said.append)
    assert fresh.get(_key()) == _measurement()
    assert fresh.get(_key((8, 8))) == _measurement((8, 8))
    assert fresh.get(_key((4, 4))) is None
    data = json.loads((tmp_path / "deep" / "m.json").read_text())
    assert data["format"] == "tome-measurements" and data["version"] == C.VERSION == 2
    assert data["entries"][_key().digest]["parts"]["latent"] == [16, 16]  # readable
    assert said == [] and [p.name for p in (tmp_path / "deep").iterdir()] == ["m.json"]


def test_the_cache_keeps_the_spread_and_when(tmp_path):
    """A reading's rounds' spread and its time go to the file and come back."""
    row = M.LevelTiming(1, 4096, 1, 1, 2.2, 2.0, 0.96, 1.15)
    m = M.Measurement("Test CPU", "float32", (16, 16), 2, "merge", (row,), "2026-11-27T11:00:00Z")
    assert C.MeasurementCache(tmp_path / "m.json", say=print).put(_key(), m)
    back = C.MeasurementCache(tmp_path / "m.json", say=print).get(_key())
    assert back == m and back.rows[0].uncertain() and back.taken == m.taken
    entry = json.loads((tmp_path / "m.json").read_text())["entries"][_key().digest]
    assert entry["measurement"]["rows"][0]["low"] == 0.96
    assert entry["measurement"]["rows"][0]["high"] == 1.15
    assert entry["measurement"]["taken"] == "2026-11-27T11:00:00Z"
    assert C.speedups(back)[1] == policy.LevelSpeed(1.1, "Test CPU", 0.96, 1.15)


def _tampered_parts(path):
    C.MeasurementCache(path, say=print).put(_key(), _measurement())
    data = json.loads(path.read_text())
    data["entries"][_key().digest]["parts"]["batch"] = 99
    return json.dumps(data).encode()


def _other_key(path):
    """A valid entry filed under another key's digest: never used for that key."""
    C.MeasurementCache(path, say=print).put(_key((8, 8)), _measurement((8, 8)))
    data = json.loads(path.read_text())
    entries = data["entries"]
    entries[_key().digest] = entries.pop(_key((8, 8)).digest)
    return json.dumps(data).encode()


def _wrong_measurement(path):
    """Parts intact, measurement of another latent."""
    C.MeasurementCache(path, say=print).put(_key(), _measurement((8, 8)))
    return path.read_bytes()


@pytest.mark.parametrize("content", [
    b"\x00\xff garbage {",
    b'{"format": "something-else", "version": 1, "entries": {}}',
    b'["a", "list"]',
    b'{"format": "tome-measurements", "version": 99, "entries": {}}',
    b'{"format": "tome-measurements", "version": 1, "entries": {"x": {}}}',
    _tampered_parts, _other_key, _wrong_measurement,
], ids=["garbage", "other-format", "list", "newer-version", "older-version", "tampered-parts",
        "other-key", "wrong-measurement"])
def test_bad_cache_file_one_line_then_rewritten(tmp_path, content, capsys):
    path = tmp_path / "m.json"
    path.write_bytes(content(path) if callable(content) else content)
    capsys.readouterr()
    said = []
    cache = C.MeasurementCache(path, say=said.append)
    assert cache.get(_key()) is None
    assert cache.get(_key()) is None
    assert len(said) == 1 and said[0].startswith("ToMe: ")
    assert ("older ToMe" in said[0]) == (b'"tome-measurements", "version": 1,' in path.read_bytes())
    assert cache.put(_key(), _measurement())
    assert len(said) == 1
    data = json.loads(path.read_text())
    assert data["format"] == "tome-measurements" and data["version"] == C.VERSION == 2
    assert C.MeasurementCache(path, say=said.append).get(_key()) == _measurement()
    assert len(said) == 1


def test_unwritable_cache_does_not_crash(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    said = []
    cache = C.MeasurementCache(blocker / "sub" / "m.json", say=said.append)
    assert cache.put(_key(), _measurement()) is False
    assert cache.put(_key(), _measurement()) is False
    assert cache.get(_key()) is None
    assert len(said) == 1 and said[0].startswith("ToMe: ")


def test_default_cache_path(monkeypatch, tmp_path):
    monkeypatch.setenv("TOME_CACHE_DIR", str(tmp_path / "t"))
    assert C.default_cache_path() == tmp_path / "t" / "measurements.json"
    monkeypatch.delenv("TOME_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert C.default_cache_path() == tmp_path / "x" / "tome-sd" / "measurements.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert C.default_cache_path() == tmp_path / "h" / ".cache" / "tome-sd" / "measurements.json"
    assert C.MeasurementCache().path == C.default_cache_path()


# ----------------------------------------------------------------------------- grids in 3-D

def _flux():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24,
        axes_dims_rope=(4, 6, 6)).eval()


# The parts of a key as the code before 3-D grids wrote them, spelled out: the architecture
# fingerprints and config dicts are literals recorded from that code (a UNet's config has no
# DiT field; a DiT's has rope, blocks, proportional and schedule), the machine's parts are read.
OLD = {
    "sd15": ("1286cdceb33e84df", [1], {
        "matching": "global", "merge_attn": True, "merge_crossattn": False, "merge_mlp": False,
        "method": "merge", "ratio": 0.5, "share": "level", "sx": 2, "sy": 2}),
    "flux": ("a42cad62a677b0ef", [2], {
        "blocks": "all", "downsample_factor": 2, "method": "downsample", "proportional": True,
        "rope": "pooled", "schedule": ""}),
}


def _old_parts(model, name, latent, batch):
    unet, levels, config = OLD[name]
    return {"attention": M.attention_backend(model), "batch": batch, "capability": None,
            "config": config, "device": M.device_name(torch.device("cpu")), "dtype": "float32",
            "latent": list(latent), "levels": levels, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "unet": unet}


@pytest.mark.parametrize("name", ["sd15", "flux"])
def test_an_old_cache_file_is_still_read_and_used(sd15, tmp_path, name):
    """A file as the code before 3-D grids wrote it (digest: sha1 of the canonical JSON of
    the parts; entries under format and version), built here by hand: an image's key is the
    same bytes, so the measurement is used, with the latent given as (h, w) or (1, h, w)."""
    import hashlib
    model = sd15 if name == "sd15" else _flux()
    cfg = ToMeConfig() if name == "sd15" else ToMeConfig(method="downsample")
    parts = _old_parts(model, name, (16, 24), 2)
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha1(text.encode()).hexdigest()
    old = {"device": parts["device"], "dtype": "float32", "latent": [16, 24], "batch": 2,
           "method": cfg.method, "rows": [{"level": parts["levels"][0], "tokens": 384,
                                           "blocks": 5, "plans": 1, "unmerged_ms": 3.0,
                                           "merged_ms": 1.5}]}
    path = tmp_path / "measurements.json"
    path.write_text(json.dumps({"format": "tome-measurements", "version": 2,
                                "entries": {digest: {"parts": parts, "measurement": old}}},
                               indent=1, sort_keys=True))
    key = C.cache_key(model, (16, 24), 2, cfg)
    assert (key.digest, key.parts_json) == (digest, text)
    assert C.cache_key(model, (1, 16, 24), 2, cfg) == key

    def clock(phase, fn):
        raise AssertionError("measured again")
    said = []
    service = C.Measurer(C.MeasurementCache(path, say=said.append), say=said.append,
                         clock=clock)
    for latent in ((16, 24), (1, 16, 24)):
        m = service.get(model, latent, 2, cfg, runner=None)
        assert m is not None and m.rows[0].speedup == 2.0 and m.latent == (16, 24)
    # no spread: read as certain (taken the way every reading was then), decided by the margin
    assert said == [] and m.taken is None and m.rows[0].low is None
    assert C.speedups(m) == {parts["levels"][0]: policy.LevelSpeed(2.0, parts["device"])}
    assert policy.decide_level(ToMeConfig(policy="auto"), 2, 384, "cpu",
                               C.speedups(m)[parts["levels"][0]]).merged


def test_a_video_key_names_its_frames_and_an_image_key_does_not(sd15):
    c = ToMeConfig()
    image = C.cache_key(sd15, LATENT, 2, c)
    video = C.cache_key(sd15, (9, *LATENT), 2, c)
    assert "frames" not in image.parts and C.cache_key(sd15, (1, *LATENT), 2, c) == image
    assert video.parts == {**image.parts, "frames": 9} and video.digest != image.digest


def test_a_video_grid_is_not_timed_yet_and_says_so(sd15):
    said = []
    service = C.Measurer(C.MeasurementCache(say=said.append), say=said.append,
                         clock=lambda phase, fn: pytest.fail("timed"))
    assert service.get(sd15, (9, 60, 104), 2, ToMeConfig(), runner=None) is None
    assert said == [service.reason] == ["ToMe: not measured at 832x480 px, 33 frames: video "
                                        "grids are not timed yet; the token thresholds decide"]


def test_the_measuring_lines_name_the_size(sd15, tmp_path):
    said = []
    service = C.Measurer(C.MeasurementCache(tmp_path / "m.json", say=said.append),
                         say=said.append, rounds=1, clock=lambda phase, fn: 1.0)
    progress = []
    service.progress = progress.append
    service.get(sd15, (16, 24), 1, ToMeConfig(), runner=lambda *a: None)
    assert progress == ["ToMe: measuring 192x128 px", None]
    assert said[0].startswith("ToMe: measured 192x128 px, batch 1, merge, on ")


# ----------------------------------------------------------------------------- a bad reading

def _noisy(calls=None):
    """Rounds alternating 1.15x and 0.96x (merged 10 or 12 ms): a busy machine at the margin."""
    def clock(phase, fn):
        if calls is not None:
            calls.append(phase)
        n = sum(1 for c in (calls or []) if c == "merged")
        return {"unmerged": 11.5e-3, "build": 0.0, "merged": 10e-3 if n % 2 else 12e-3}[phase]
    return clock


def test_an_uncertain_reading_says_so_and_does_not_merge(sd15, tmp_path):
    """The console line and the policy's reason (the infotext's ``ToMe auto``) name the
    spread; the planner's decision does not merge."""
    said, calls = [], []
    service = C.Measurer(C.MeasurementCache(tmp_path / "m.json", say=said.append),
                         say=said.append, rounds=4, warmup=0, clock=_noisy(calls))
    m = service.get(sd15, LATENT, 2, ToMeConfig(), runner=lambda *a: None)
    assert len(calls) == 3 * 4 * 3  # re-taken twice
    assert said[0].endswith(": ds1 1.15x uncertain (rounds 0.96x to 1.15x), not merged")
    (d,) = policy.decide(ToMeConfig(policy="auto"), LATENT, [1], "cpu", C.speedups(m))
    assert not d.merged and d.reason.endswith(
        ", uncertain (rounds 0.96x to 1.15x), not merged")
    assert "uncertain (rounds 0.96x to 1.15x)" in policy.summary([d], LATENT)
    rows = survey.Survey([m]).rows()
    assert rows[0][-2:] == ("1.15x (0.96-1.15x)", "uncertain")
    # the cache keeps it uncertain: a fresh service reads it, measures nothing
    again = C.Measurer(C.MeasurementCache(tmp_path / "m.json"), say=said.append,
                       clock=lambda phase, fn: pytest.fail("measured again"))
    assert again.get(sd15, LATENT, 2, ToMeConfig(), runner=None) == m


def test_forget_drops_exactly_the_size(sd15, tmp_path):
    """``forget``: this model, size, batch and config leave memory and the file; every other
    reading stays, and the next ``get`` measures the forgotten one again."""
    path, calls = tmp_path / "m.json", []
    service = C.Measurer(C.MeasurementCache(path), say=lambda line: None, rounds=1, warmup=0,
                         clock=lambda phase, fn: calls.append(phase) or 1.0)
    run, cfg = (lambda *a: None), ToMeConfig()
    readings = [(LATENT, 2, cfg), ((16, 24), 2, cfg), (LATENT, 1, cfg),
                (LATENT, 2, cfg.replace(ratio=0.3))]
    for latent, batch, c in readings:
        service.get(sd15, latent, batch, c, runner=run)
    digests = set(json.loads(path.read_text())["entries"])
    assert len(digests) == 4 and len(calls) == 4 * 3
    assert service.forget(sd15, (1, *LATENT), 2, cfg.replace(seed=9))  # same reading
    gone = C.cache_key(sd15, LATENT, 2, cfg).digest
    assert set(json.loads(path.read_text())["entries"]) == digests - {gone}
    assert gone not in service.results and gone not in service.seen.values()
    assert not service.forget(sd15, LATENT, 2, cfg)  # nothing left to drop
    for latent, batch, c in readings:
        service.get(sd15, latent, batch, c, runner=run)
    assert len(calls) == 5 * 3  # only the forgotten one measured again
    assert set(json.loads(path.read_text())["entries"]) == digests


def test_the_survey_remeasures_what_it_shows(sd15, tmp_path):
    """``survey(..., remeasure=True)``: the sizes it shows are measured again (the WebUI's
    Measure now, ComfyUI's measure node); without it they are read back."""
    from tome.patch import run_block
    calls = []
    service = C.Measurer(C.MeasurementCache(tmp_path / "m.json"), say=lambda line: None,
                         rounds=1, warmup=0, clock=lambda phase, fn: calls.append(phase) or 1.0)
    other = service.get(sd15, (24, 24), 2, ToMeConfig(), runner=run_block)
    first = survey.survey(sd15, [128], service, run_block)
    assert len(first.found) == 2 and len(calls) == 3 * 3  # merge and downsample at 128 px
    assert survey.survey(sd15, [128], service, run_block).found == first.found
    assert len(calls) == 3 * 3
    again = survey.survey(sd15, [128], service, run_block, remeasure=True)
    assert len(again.found) == 2 and len(calls) == 5 * 3
    assert service.get(sd15, (24, 24), 2, ToMeConfig(), runner=None) is other


def test_the_comfy_measure_node_remeasures_on_request(tmp_path, monkeypatch):
    """The measure node's optional ``remeasure`` input: off, sizes already measured are read
    back; on, they are dropped and measured again, every time it is queued."""
    import sys
    from pathlib import Path
    stub = str(Path(__file__).resolve().parent / "comfy_stub")
    if stub not in sys.path:
        sys.path.insert(0, stub)
    import folder_paths
    from comfy.model_patcher import ModelPatcher
    from comfy.model_sampling import ModelSamplingDiscrete
    from comfy.sampling import comfy_blocks

    from tome.comfy import host, nodes
    monkeypatch.delenv("TOME_CACHE_DIR", raising=False)
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path))
    monkeypatch.setattr(host, "_services", [])
    monkeypatch.setattr(host, "console", lambda line: None)
    spec = nodes.ToMeMeasure.INPUT_TYPES()
    assert spec["optional"]["remeasure"][0] == "BOOLEAN"
    assert spec["optional"]["remeasure"][1]["default"] is False
    m = torch.nn.Module()
    m.diffusion_model = comfy_blocks(ldm_unet(TINY_SD15))
    m.model_sampling = ModelSamplingDiscrete()
    model, calls = ModelPatcher(m), []
    service = host.measuring_service()
    service.rounds, service.warmup = 1, 0
    service.clock = lambda phase, fn: calls.append(phase) or {"unmerged": 1.0, "build": 0.0,
                                                              "merged": 0.5}[phase]
    node = nodes.ToMeMeasure()
    text = node.measure(model, "128")["result"][0]
    assert "2.00x" in text and len(calls) == 2 * 3  # merge and downsample
    node.measure(model, "128", remeasure=False)
    assert len(calls) == 2 * 3
    node.measure(model, "128", remeasure=True)
    assert len(calls) == 4 * 3
    assert nodes.ToMeMeasure.IS_CHANGED(sizes="128", remeasure=False) is False
    changed = nodes.ToMeMeasure.IS_CHANGED(sizes="128", remeasure=True)
    assert changed != changed  # NaN: ComfyUI runs the node every time it is queued
