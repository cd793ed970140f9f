"""The auto policy (``tome/policy.py``) and how the planner applies it: thresholds per device
kind, measured speed-ups with their margin, the reasons the console and infotext show, the
planner's decisions told once per size (``Planner.on_decided``), and compiled graphs that only
read decisions already made."""

from __future__ import annotations

import pytest
import torch
from models import SHALLOW_SD15, ldm_inputs, ldm_unet
from stubs import fake_clock

import tome
from tome import methods, plan, policy
from tome.config import ToMeConfig


def test_auto_policy_merges_only_where_it_pays_on_this_device(sd15):
    # CPU threshold: 4096 tokens. A 16x16 latent has 256 tokens at full resolution.
    assert methods.get("merge").thresholds["cpu"] == 4096
    small = ldm_inputs(2, 16, 16)
    base = sd15(*small)
    tome.apply_patch(sd15, ratio=0.5, policy="auto", measure=False)
    try:
        assert torch.equal(sd15(*small), base)  # not merged: bit-identical
        (d,) = tome.patch_report(sd15).decisions.values()
        assert not d.merged and "below the CPU threshold (4096)" in d.reason
        big = ldm_inputs(1, 64, 64)
        ref_big = None
        out = sd15(*big)
    finally:
        tome.remove_patch(sd15)
    ref_big = sd15(*big)
    assert not torch.equal(out, ref_big)  # 4096 tokens: merged


@pytest.mark.parametrize("speedup, merged", [(2.0, True), (1.04, False), (1.06, True),
                                             (0.8, False)])
def test_auto_policy_decides_from_measurements(sd15, tmp_path, speedup, merged):
    from tome.measurements import MeasurementCache, Measurer

    x = ldm_inputs(2, 16, 16)  # 256 tokens: below every threshold, so only a measurement merges
    base = sd15(*x)
    calls = []
    said = []
    service = Measurer(MeasurementCache(tmp_path / "m.json"), say=said.append, rounds=2,
                       clock=fake_clock(speedup, calls))
    state = torch.get_rng_state()
    tome.apply_patch(sd15, ratio=0.5, policy="auto", measure=service)
    try:
        out = sd15(*x)
        again = sd15(*x)
        (d,) = tome.patch_report(sd15).decisions.values()
    finally:
        tome.remove_patch(sd15)
    assert torch.equal(torch.get_rng_state(), state) and torch.equal(sd15(*x), base)
    assert torch.equal(out, again) and torch.equal(out, base) != merged
    assert d.merged is merged and d.reason.startswith(f"measured {speedup:.2f}x on ")
    assert len(calls) == 3 * 2 and len(said) == 1 and "ToMe: measured 128x128 px" in said[0]
    # a new patch of the same model reads the cache: nothing is measured again
    calls.clear()
    tome.apply_patch(sd15, ratio=0.5, policy="auto", measure=Measurer(
        MeasurementCache(tmp_path / "m.json"), say=said.append, clock=fake_clock(9.0, calls)))
    try:
        sd15(*x)
        (d,) = tome.patch_report(sd15).decisions.values()
    finally:
        tome.remove_patch(sd15)
    assert not calls and d.merged is merged


def test_without_measurement_the_thresholds_decide(sd15, tmp_path):
    from tome.measurements import MeasurementCache, Measurer

    calls = []
    service = Measurer(MeasurementCache(tmp_path / "m.json"), clock=fake_clock(3.0, calls))
    cases = [({"policy": "auto", "measure": False},
              (False, "256 tokens, below the CPU threshold (4096), not merged")),
             ({"policy": "fixed", "measure": service}, (True, "fixed policy"))]
    for kw, expected in cases:
        tome.apply_patch(sd15, ratio=0.5, **kw)
        try:
            sd15(*ldm_inputs(2, 16, 16))
            (d,) = tome.patch_report(sd15).decisions.values()
        finally:
            tome.remove_patch(sd15)
        assert (d.merged, d.reason) == expected, kw
    assert not calls


def test_a_compiled_model_measures_on_the_host_never_in_the_graph(tmp_path):
    """The UNet's pre-hook runs on the host in a compiled model (``graphs.host_side``): a
    size already measured is only read; a new size is measured there, before its graph, as
    an eager call would, and never while dynamo traces (the measurement would be traced)."""
    from tome.graphs import compiling
    from tome.measurements import MeasurementCache, Measurer

    calls, traced = [], []
    clock = fake_clock(2.0, calls)

    def timed(phase, fn):
        traced.append(compiling())
        return clock(phase, fn)

    service = Measurer(MeasurementCache(tmp_path / "m.json"), say=lambda s: None, rounds=1,
                       clock=timed)
    sd15 = ldm_unet(SHALLOW_SD15)  # a compiled TINY_SD15 traces a minute per graph
    x = ldm_inputs(2, 16, 16)
    tome.apply_patch(sd15, ratio=0.5, policy="auto", measure=service)
    try:
        eager = sd15(*x)  # measures
        measured = len(calls)
        torch._dynamo.reset()
        from torch._dynamo.testing import CompileCounter
        counter = CompileCounter()
        compiled = torch.compile(sd15, backend=counter, fullgraph=True)
        out = compiled(*x)
        out2 = compiled(*ldm_inputs(2, 16, 16, seed=5))
        assert len(calls) == measured and counter.frame_count == 1
        torch.testing.assert_close(out, eager)
        assert out2.shape == out.shape
        larger = ldm_inputs(2, 24, 24)
        torch.testing.assert_close(compiled(*larger), sd15(*larger))
        assert len(calls) > measured and not any(traced)
    finally:
        tome.remove_patch(sd15)
        torch._dynamo.reset()


@pytest.mark.parametrize("kind,tokens,merged", [
    ("cuda", 4096, False), ("cuda", 16384, True), ("cpu", 4096, True), ("cpu", 1024, False),
    ("mps", 4096, True), ("xla", 4096, False)])
def test_policy_decisions_per_device_kind(kind, tokens, merged):
    cfg = ToMeConfig(policy="auto")
    assert policy.decide_level(cfg, 1, tokens, policy.device_kind(kind)).merged is merged
    assert policy.decide_level(cfg.replace(policy="fixed"), 1, tokens, kind).merged


def test_a_dit_block_is_decided_by_the_dit_forms_own_thresholds():
    """DitPool's thresholds (CPU 1024 tokens), not the UNet method's (CPU 4096): what the
    planner of every DiT adapter hands ``decide_level``."""
    from tome import dit
    cfg, form = ToMeConfig(method="downsample", policy="auto"), dit.method_for(
        ToMeConfig(method="downsample"))
    d = policy.decide_level(cfg, 2, 1024, "cpu", None, form)
    assert d.merged and d.reason == "1024 tokens, at or above the CPU threshold (1024)"
    assert not policy.decide_level(cfg, 2, 1024, "cpu").merged  # the UNet's 4096
    assert policy.decide(cfg, (64, 64), [2], "cpu", method=form)[0].merged
    p = plan.Planner(cfg, 2, None, [2], method=form)
    assert p.decision(2, 1024, "cpu").merged and not p.decision(2, 1023, "cpu").merged
    assert not p.decision(2, 4096, "cuda").merged  # CUDA: 16384


def test_policy_summary_names_size_tokens_and_device():
    cfg = ToMeConfig(policy="auto")
    line = policy.summary(policy.decide(cfg, (64, 64), [1], "cuda"), (64, 64))
    assert line == "512x512 px: ds1 4096 tokens, below the CUDA threshold (16384), not merged"


def test_a_video_latent_counts_its_frames_and_names_them():
    """(frames, height, width): tokens count every frame; the line names the video's size in
    px and frames (a causal video VAE: the first latent frame is one frame, each later 4)."""
    assert policy.latent_grid((60, 104)) == (1, 60, 104)
    assert policy.latent_grid(torch.Size([9, 60, 104])) == (9, 60, 104)
    assert policy.level_tokens((9, 60, 104), 2) == 9 * 30 * 52
    assert policy.level_tokens((1, 61, 104), 2) == policy.level_tokens((61, 104), 2) == 31 * 52
    assert policy.size_text((64, 64)) == policy.size_text((1, 64, 64)) == "512x512 px"
    assert policy.size_text((9, 60, 104)) == "832x480 px, 33 frames"
    cfg = ToMeConfig(method="downsample", policy="auto")
    line = policy.summary(policy.decide(cfg, (9, 60, 104), [2], "cuda"), (9, 60, 104))
    assert line == ("832x480 px, 33 frames: ds2 14040 tokens, below the CUDA threshold "
                    "(16384), not merged")
    with pytest.raises(ValueError, match="frames, height, width"):
        policy.latent_grid((1, 2, 3, 4))


def test_each_reason_belongs_to_its_decision():
    """Every branch of ``decide_level`` with its exact reason: a swap of two fails."""
    auto = ToMeConfig(policy="auto")
    cases = [
        (auto.replace(policy="fixed"), None, 1024, (True, "fixed policy")),
        (auto, policy.LevelSpeed(1.5, "CPU X"), 1024, (True, "measured 1.50x on CPU X, merged")),
        (auto, policy.LevelSpeed(1.02, "CPU X"), 65536,
         (False, "measured 1.02x on CPU X, not merged")),
        (auto, policy.LevelSpeed(1.15, "CPU X", 0.96, 1.15), 65536,
         (False, "measured 1.15x on CPU X, uncertain (rounds 0.96x to 1.15x), not merged")),
        (auto, policy.LevelSpeed(1.2, "CPU X", 1.06, 1.6), 1024,
         (True, "measured 1.20x on CPU X, merged")),
        (auto, policy.LevelSpeed(1.02, "CPU X", 0.8, 1.04), 65536,
         (False, "measured 1.02x on CPU X, not merged")),
        (auto, (1.5, "CPU X"), 1024, (True, "measured 1.50x on CPU X, merged")),
        (auto, None, 4096, (True, "4096 tokens, at or above the CPU threshold (4096)")),
        (auto, None, 1024, (False, "1024 tokens, below the CPU threshold (4096), not merged")),
    ]
    for cfg, measured, tokens, expected in cases:
        d = policy.decide_level(cfg, 1, tokens, "cpu", measured)
        assert (d.merged, d.reason) == expected


def test_uncertain_is_rounds_on_both_sides_of_the_margin():
    """The slowest round under 1.05x and the fastest at or above it; no spread is certain."""
    assert policy.uncertain(1.04, 1.05) and policy.uncertain(0.5, 2.0)
    assert not policy.uncertain(1.05, 1.6) and not policy.uncertain(0.8, 1.0499)
    assert not policy.uncertain(None, None)
    assert not policy.uncertain(1.0, 1.08, margin=0.1) and policy.uncertain(1.0, 1.1, margin=0.1)
    assert policy.verdict(1.2, 1.1, 1.3) == "merged"
    assert policy.verdict(1.2, 1.0, 1.3) == "uncertain (rounds 1.00x to 1.30x), not merged"
    assert policy.verdict(1.0) == "not merged"
    assert not policy.LevelSpeed(1.2, "X", 1.0, 1.3).merged
    assert policy.LevelSpeed(1.2, "X").merged


def test_the_planner_tells_its_decisions_once_per_size_after_measuring():
    """The narration reads what the planner decided (no polling, no recomputing): told once
    per size, after the size is measured, with the decisions the blocks then use."""
    asked, told = [], []

    def measurer(size, batch, device):
        asked.append(size)
        return {1: policy.LevelSpeed(2.0, "CPU X")}

    planner = plan.Planner(ToMeConfig(policy="auto"), 2, measurer, [1, 2])
    planner.on_decided = lambda size, decisions: told.append((size, decisions))
    planner.announce((16, 16), "cpu")
    assert told == []                        # not measured yet: told after the first call
    t = torch.tensor([500.0])
    call = planner.begin((16, 16), torch.device("cpu"), t, 2)
    planner.begin((16, 16), torch.device("cpu"), t, 2)
    planner.announce((16, 16), "cpu")
    assert asked == [(1, 16, 16)] and len(told) == 1  # the grid: (frames, h, w)
    size, decisions = told[0]
    assert size == (1, 16, 16)
    assert [(d.level, d.merged) for d in decisions] == [(1, True), (2, False)]
    assert decisions[0].reason == "measured 2.00x on CPU X, merged"
    assert decisions[1].reason == "64 tokens, below the CPU threshold (4096), not merged"
    assert planner.decision(1, 256, "cpu", call.measured.get(1)) is decisions[0]


def test_without_measuring_the_planner_tells_at_once():
    told = []
    planner = plan.Planner(ToMeConfig(policy="auto"), 1, None, [1])
    planner.on_decided = lambda size, decisions: told.append(decisions)
    planner.announce((64, 64), "cuda")
    planner.announce((64, 64), "cuda")
    assert [[(d.merged, d.tokens) for d in ds] for ds in told] == [[(False, 4096)]]
