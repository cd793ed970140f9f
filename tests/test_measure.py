"""tome.measure: timing levels on the user's device and deciding with a margin (remembering the
answer is ``test_measurements.py``'s).

Real small UNets (ldm and diffusers, random weights, zero-initialised outputs randomised);
decisions are checked with fake clocks, the real CPU clock only has to give positive times.
"""

from __future__ import annotations

import json

import pytest
import torch
from models import TINY_SD15, TINY_SDXL, diffusers_unet, ldm_inputs, ldm_unet
from stubs import FakeClock

import tome
from tome import measure as M
from tome import measurements as C
from tome.config import ToMeConfig
from tome.layout import read as read_layout
from tome.patch import run_block
from tome.plan import Planner


def level_of(model):
    """Every block's level, in the UNet's order."""
    return {b.module: b.level for b in read_layout(model).blocks}


LATENT = (16, 16)


def measure(*args, **kwargs):
    """``measure.measure`` through the hook adapter's runner."""
    return M.measure(*args, runner=run_block, **kwargs)


def row(unmerged, merged, level=1):
    return M.LevelTiming(level, 4096, 1, 1, unmerged, merged)


# ----------------------------------------------------------------------------- deciding

def test_decide_needs_the_margin():
    assert M.MARGIN == 0.05
    assert not M.decide(row(1.04, 1.0))
    assert M.decide(row(1.06, 1.0))
    assert not M.decide(row(1.0, 1.0))
    assert M.decide(row(1.0, 1.0), margin=0.0)
    assert not M.decide(row(1.06, 1.0), margin=0.1)


def test_fake_clock_decisions_and_accounting(sd15):
    """Per level: blocks x block time unmerged; plans x build + blocks x merged time merged.
    The tiny SD1.5 has 5 blocks at ds1/2/4 (2 encoder, 3 decoder) and 1 at ds8 (middle)."""
    ms = 1e-3
    clock = FakeClock([10.4 * ms, 0.0, 10 * ms,      # ds1: 1.04x: not merged
                       10.6 * ms, 0.0, 10 * ms,      # ds2: 1.06x: merged
                       10 * ms, 5 * ms, 4 * ms,      # ds4: 50 / (2*5 + 5*4) = 1.67x
                       1 * ms, 1 * ms, 0.1 * ms])    # ds8: 1 / (1 + 0.1): slower
    m = measure(sd15, LATENT, 2, ToMeConfig(), rounds=1, warmup=0, clock=clock,
                  levels=[8, 4, 2, 1])
    assert clock.calls == 12
    assert [(r.level, r.tokens, r.blocks, r.plans) for r in m.rows] == \
        [(1, 256, 5, 2), (2, 64, 5, 2), (4, 16, 5, 2), (8, 4, 1, 1)]
    ds1, ds2, ds4, ds8 = m.rows
    assert ds1.unmerged_ms == pytest.approx(52) and ds1.merged_ms == pytest.approx(50)
    assert ds4.unmerged_ms == pytest.approx(50) and ds4.merged_ms == pytest.approx(30)
    assert ds8.merged_ms == pytest.approx(1.1)
    assert [r.level for r in m.rows if M.decide(r)] == [2, 4]
    assert [r.level for r in m.rows if M.decide(r, 0.0)] == [1, 2, 4]


def test_stops_early_only_when_the_decision_is_clear(sd15):
    """After ``min_rounds`` a level stops once every round lands clearly on one side of the
    margin; near the margin it takes every round."""
    ms = 1e-3
    clear = FakeClock([10 * ms, 0.0, 5 * ms] * 5)         # 2x every round: 3 rounds
    m = measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=clear, levels=[8])
    assert clear.calls == 9 and m.rows[0].speedup == pytest.approx(2.0)
    costs = FakeClock([5 * ms, 0.0, 6 * ms] * 5)          # 0.83x every round: 3 rounds
    measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=costs, levels=[8])
    assert costs.calls == 9
    barely = FakeClock([10 * ms, 0.0, 10.2 * ms] * 5)     # 0.98x: all 5 rounds
    measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=barely, levels=[8])
    assert barely.calls == 15
    near = FakeClock([10.8 * ms, 0.0, 10 * ms] * 5)       # 1.08x: all 5 rounds
    m = measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=near, levels=[8])
    assert near.calls == 15 and [r.level for r in m.rows if M.decide(r)] == [8]
    mixed = FakeClock([20 * ms, 0.0, 10 * ms, 9 * ms, 0.0, 10 * ms, 20 * ms, 0.0, 10 * ms,
                       20 * ms, 0.0, 10 * ms, 20 * ms, 0.0, 10 * ms])
    measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=mixed, levels=[8],
            retakes=0)
    assert mixed.calls == 15  # one slow round keeps it going


# ----------------------------------------------------------------------------- noisy rounds

# A busy machine near the margin: the rounds alternate 1.15x and 0.96x (unmerged 11.5 ms, merged
# 10 or 12 ms). The fastest of each phase says 1.15x, merged; six fresh readings of one size
# under load gave 0.80x to 1.60x: rounds that disagree about the decision are a coin flip.
NOISY = [11.5e-3, 0.0, 10e-3, 11.5e-3, 0.0, 12e-3]


def test_a_noisy_reading_near_the_margin_is_taken_again_then_uncertain(sd15):
    """Rounds on both sides of the 1.05x line: the level is timed again (``retakes`` times),
    and still disagreeing it is uncertain: not merged, its spread kept (the rounds of every
    take)."""
    noisy = FakeClock(NOISY * 8)
    m = measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=noisy, levels=[8],
                retakes=2)
    assert noisy.calls == 3 * 5 * 3  # three takes of five rounds (none is clear)
    (r,) = m.rows
    assert r.uncertain() and not M.decide(r)
    assert r.speedup == pytest.approx(1.15)  # what was merged before
    assert r.low == pytest.approx(11.5 / 12) and r.high == pytest.approx(1.15)
    assert r.verdict() == "uncertain (rounds 0.96x to 1.15x), not merged"
    # once is enough where the noise passes: a clean re-take is the row, alone
    passing = FakeClock(NOISY * 2 + NOISY[:3] + [12e-3, 0.0, 10e-3] * 5)
    m = measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=passing, levels=[8])
    (r,) = m.rows
    assert passing.calls == 5 * 3 + 3 * 3  # the re-take is clear (1.2x) after three rounds
    assert not r.uncertain() and M.decide(r) and r.speedup == pytest.approx(1.2)
    assert r.low == r.high == pytest.approx(1.2)


def test_a_clean_reading_is_taken_once_and_decides_as_before(sd15):
    """Rounds that agree (near the margin or not) are one take, decided by the margin; their
    spread is kept, and a spread on one side of the line is certain."""
    ms = 1e-3
    for unmerged, merged, calls in ((10.8 * ms, True, 15), (10.2 * ms, False, 15),
                                    (20 * ms, True, 9)):
        clock = FakeClock([unmerged, 0.0, 10 * ms] * 5)
        (r,) = measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=clock,
                       levels=[8]).rows
        assert clock.calls == calls and M.decide(r) is merged and not r.uncertain()
        assert r.low == r.high == pytest.approx(unmerged / (10 * ms))
    # rounds that differ but agree about the decision (1.08x to 1.6x) merge, as they did
    clock = FakeClock([10.8 * ms, 0.0, 10 * ms, 16 * ms, 0.0, 10 * ms] * 3)
    (r,) = measure(sd15, LATENT, 2, ToMeConfig(), rounds=5, warmup=0, clock=clock,
                   levels=[8]).rows
    assert clock.calls == 15 and M.decide(r) and r.speedup == pytest.approx(1.08)
    assert (r.low, r.high) == (pytest.approx(1.08), pytest.approx(1.6))


def test_the_warm_up_round_is_not_timed(sd15):
    """On a GPU the first runs pay for lazy initialisation and kernel selection: the clock
    first sees a phase after every phase has run once untimed, and by default (``measure``,
    the measuring service) there is such a round."""
    runs: list[str] = []

    def runner(block, x, ctx, planner, plan):
        runs.append("unmerged" if plan is None else "merged")
        return run_block(block, x, ctx, planner, plan)

    seen = []

    def clock(phase, fn):
        seen.append((phase, runs.count("unmerged"), runs.count("merged")))
        fn()
        return 1e-3 if phase != "build" else 0.0

    M.measure(sd15, LATENT, 2, ToMeConfig(), runner=runner, rounds=1, clock=clock,
              levels=[8])
    assert runs == ["unmerged", "merged", "merged", "unmerged"]  # warm-up, one timed round
    assert [p for p, _, _ in seen] == ["build", "merged", "unmerged"]  # the second order
    assert seen[0][1:] == (1, 1)  # both runs done before the clock saw anything
    assert C.Measurer().warmup >= 1


def test_from_dict_keeps_the_spread_and_time_and_reads_a_reading_without_them():
    m = M.Measurement("cpu", "float32", (8, 8), 1, "merge",
                      (M.LevelTiming(1, 64, 1, 1, 2.0, 1.0, 0.9, 2.1),), "2026-11-27T11:00:00Z")
    d = json.loads(json.dumps(m.to_dict()))
    assert d["taken"] == "2026-11-27T11:00:00Z" and d["rows"][0]["low"] == 0.9
    assert M.Measurement.from_dict(d) == m
    old = {**d, "rows": [{k: v for k, v in d["rows"][0].items() if k not in ("low", "high")}]}
    del old["taken"]
    back = M.Measurement.from_dict(old)
    assert back.taken is None and back.rows[0].low is None and not back.rows[0].uncertain()
    assert back.to_dict() == old
    for bad in ({**d, "taken": 5}, {**d, "rows": [{**d["rows"][0], "low": 3.0}]},
                {**d, "rows": [{**old["rows"][0], "low": 1.0}]},
                {**d, "rows": [{**d["rows"][0], "high": float("nan")}]}):
        with pytest.raises(ValueError):
            M.Measurement.from_dict(bad)


def test_a_block_another_extension_took_over_stands_for_nothing(sd15):
    """ControlNet reference / SAG replace forwards on instances: measuring uses the first block
    left alone; a level with none left gets no row (the thresholds decide it)."""
    by_level: dict[int, list] = {}
    for b, lv in level_of(sd15).items():
        by_level.setdefault(lv, []).append(b)

    def taken(*args, **kwargs):
        raise AssertionError("measured a block another extension took over")
    shadowed = [by_level[1][0], by_level[1][1].attn1, by_level[8][0]]
    for m in shadowed:
        m.forward = taken
    try:
        assert M.representative(by_level[1], ["attn1"]) is by_level[1][2]
        m = measure(sd15, LATENT, 2, ToMeConfig(), rounds=1, levels=[1, 8])
        assert [r.level for r in m.rows] == [1] and m.rows[0].blocks == 5
    finally:
        for m in shadowed:
            del m.forward


def test_fastest_runs_and_plan_counts(sd15):
    """Each of unmerged, plan build and merged is its fastest run (disturbances only add)."""
    ms = 1e-3
    # Three rounds of the ds8 block (one block, one plan): fastest 5, 0 and 2 ms.
    clock = FakeClock([5 * ms, 1 * ms, 2 * ms, 50 * ms, 9 * ms, 3 * ms, 6 * ms, 0.0, 4 * ms])
    m = measure(sd15, LATENT, 2, ToMeConfig(), rounds=3, warmup=1, clock=clock, levels=[8])
    assert clock.calls == 9
    assert m.rows[0].unmerged_ms == pytest.approx(5) and m.rows[0].merged_ms == pytest.approx(2)
    zero = FakeClock([0.0] * 30)
    # One plan per block with share="block"; one per grid for ToDo.
    assert measure(sd15, LATENT, 2, ToMeConfig(share="block"), rounds=1, clock=zero,
                     levels=[1]).rows[0].plans == 5
    assert measure(sd15, LATENT, 2, ToMeConfig(method="downsample"), rounds=1, clock=zero,
                     levels=[1]).rows[0].plans == 1


def test_default_levels():
    """Up to max_downsample; auto: the first level with transformer blocks."""
    zero = FakeClock([0.0] * 60)
    sd15, sdxl = ldm_unet(TINY_SD15), ldm_unet(TINY_SDXL)
    assert [r.level for r in measure(sd15, LATENT, 1, ToMeConfig(), rounds=1,
                                       clock=zero).rows] == [1]
    assert [r.level for r in measure(sd15, LATENT, 1, ToMeConfig(max_downsample=4),
                                       rounds=1, clock=zero).rows] == [1, 2, 4]
    assert [r.level for r in measure(sdxl, LATENT, 1, ToMeConfig(), rounds=1,
                                       clock=zero).rows] == [2]
    with pytest.raises(ValueError, match="no transformer blocks"):
        measure(sdxl, LATENT, 1, ToMeConfig(), levels=[1])


# ----------------------------------------------------------------------------- the real clock

@pytest.mark.parametrize("family", ["ldm", "diffusers"])
def test_real_clock_table(family, sd15, dif):
    unet = sd15 if family == "ldm" else dif
    m = measure(unet, LATENT, 2, ToMeConfig(), rounds=1, levels=[1, 2, 4, 8])
    assert [r.level for r in m.rows] == [1, 2, 4, 8]
    assert all(r.unmerged_ms > 0 and r.merged_ms > 0 and r.speedup > 0 for r in m.rows)
    assert m.dtype == "float32" and m.latent == LATENT and m.batch == 2 and m.device
    assert M.Measurement.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    todo = measure(unet, LATENT, 2, ToMeConfig(method="downsample"), rounds=1)
    assert todo.method == "downsample" and todo.rows[0].merged_ms > 0


def test_from_dict_rejects_junk():
    good = M.Measurement("cpu", "float32", (8, 8), 1, "merge", (row(2.0, 1.0),)).to_dict()
    for bad in ([], {}, {**good, "rows": [{"level": 1}]}, {**good, "latent": [8]},
                {**good, "extra": 1}, {**good, "rows": [{**good["rows"][0], "merged_ms": -1}]},
                "nope"):
        with pytest.raises(ValueError):
            M.Measurement.from_dict(bad)


# ----------------------------------------------------------------------------- no side effects

def _hooks(model):
    return {name: [list(d.items()) for d in (m._forward_hooks, m._forward_pre_hooks,
                                             m._forward_hooks_with_kwargs,
                                             m._forward_pre_hooks_with_kwargs)]
            for name, m in model.named_modules()}


@pytest.mark.parametrize("family", ["ldm", "diffusers"])
def test_measuring_leaves_the_model_bit_identical(family):
    unet = ldm_unet(TINY_SD15) if family == "ldm" else diffusers_unet("sd15")
    x, t, ctx = ldm_inputs(2, 16, 16)
    if family == "ldm":
        tome.apply_patch(unet, ratio=0.5)  # hooks of a live patch must survive

        def run():
            return unet(x, t, context=ctx)
    else:
        def run():
            return unet(x, t, encoder_hidden_states=ctx, return_dict=False)[0]
    before = run()
    weights = {k: v.clone() for k, v in unet.state_dict().items()}
    hooks = _hooks(unet)
    first = next(iter(level_of(unet)))
    unet.train()
    first.attn1.eval()  # a mixed pattern of flags, restored exactly
    flags = {n: m.training for n, m in unet.named_modules()}
    rng = torch.get_rng_state()

    measure(unet, LATENT, 2, ToMeConfig(method="merge", merge_crossattn=True, merge_mlp=True),
              rounds=1, levels=[1, 8])
    measure(unet, LATENT, 2, ToMeConfig(method="downsample"), rounds=1)

    assert torch.equal(torch.get_rng_state(), rng)
    assert {n: m.training for n, m in unet.named_modules()} == flags
    assert _hooks(unet) == hooks
    after = unet.state_dict()
    assert after.keys() == weights.keys()
    assert all(torch.equal(after[k], v) for k, v in weights.items())
    unet.eval()
    assert torch.equal(run(), before)


@pytest.mark.parametrize("family,method", [("ldm", "merge"), ("ldm", "downsample"),
                                           ("diffusers", "merge")])
def test_merged_run_is_what_the_patch_runs(family, method):
    """The representative block run by ``patch.run_block`` gives the output the patched UNet's
    block gives for the same input."""
    unet = ldm_unet(TINY_SD15) if family == "ldm" else diffusers_unet("sd15")
    block = next(iter(level_of(unet)))
    config = ToMeConfig(method=method, use_rand=False, merge_crossattn=True, max_downsample=1)
    seen = {}

    def pre(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs

    def post(module, args, kwargs, out):
        seen["out"] = out

    x, t, ctx = ldm_inputs(2, 16, 16)
    tome.apply_patch(unet, config=config)
    handles = [block.register_forward_pre_hook(pre, with_kwargs=True),
               block.register_forward_hook(post, with_kwargs=True)]
    if family == "ldm":
        unet(x, t, context=ctx)
    else:
        unet(x, t, encoder_hidden_states=ctx)
    for h in handles:
        h.remove()
    tome.remove_patch(unet)

    planner = Planner(config, 1)
    hidden = seen["args"][0] if seen["args"] else seen["kwargs"]["hidden_states"]
    plan = planner.plan(planner.begin(LATENT, hidden.device, t), hidden, False)
    assert plan is not None
    kw = seen["kwargs"]
    context = kw.get("context", kw.get("encoder_hidden_states"))
    if context is None and len(seen["args"]) > 1:
        context = seen["args"][1]
    out = run_block(block, hidden, context, planner, plan)
    assert torch.equal(out, seen["out"])
    assert not torch.equal(block(*seen["args"], **seen["kwargs"]), out)  # it did merge


# ----------------------------------------------------------------------------- grad modes

@pytest.mark.parametrize("first, then", [(torch.inference_mode, torch.no_grad),
                                         (torch.no_grad, torch.inference_mode)])
def test_measuring_works_whatever_mode_measured_before(tmp_path, monkeypatch, first, then):
    """Forge and ComfyUI sample (and so measure) under inference mode, Measure now under
    no_grad: what measuring keeps between measurements (the cache-flush buffer) must work in
    both orders."""
    monkeypatch.setattr(M, "_flush", {})
    said = []
    service = C.Measurer(C.MeasurementCache(tmp_path / "m.json"), say=said.append, rounds=1,
                         warmup=0)
    unet = ldm_unet(TINY_SD15)
    tome.apply_patch(unet, ratio=0.5, policy="auto", measure=service)
    try:
        with first():
            unet(*ldm_inputs(2, 16, 16))
        with then():
            unet(*ldm_inputs(2, 24, 24))
    finally:
        tome.remove_patch(unet)
    assert [s.split(" in ")[0].split(",")[0] for s in said] == [
        "ToMe: measured 128x128 px", "ToMe: measured 192x192 px"]


# ----------------------------------------------------------------------------- per-call DiTs

def test_the_override_runner_times_the_host_kernel_unpooled_and_through_kvpool(monkeypatch):
    """ComfyUI's and Forge Neo's DiT runner: the host's backend (by module and name) gets
    the whole image's keys unpooled, and keys pooled per cell with the bias as its mask
    through ``kv.pool_call`` (as a generation runs it); every linear layer runs in both."""
    import sys
    import types

    from tome import dit, percall_runner
    seen = []

    def attention_pytorch(q, k, v, heads, mask=None, **kw):
        seen.append((k.shape[1], heads, mask is not None))
        return percall_runner._sdpa(q, k, v, heads, mask)

    host = types.ModuleType("fake_host_attention")
    host.optimized_attention = attention_pytorch
    monkeypatch.setitem(sys.modules, "fake_host_attention", host)
    block = torch.nn.Module()
    block.num_heads = 2
    block.qkv, block.mlp = torch.nn.Linear(32, 96), torch.nn.Linear(128, 32)
    ran = []
    for m in (block.qkv, block.mlp):
        m.register_forward_hook(lambda mod, args, out: ran.append(args[0].shape[-1]))
    run = percall_runner.runner(("fake_host_attention", "optimized_attention"))
    x = torch.randn(2, 8 * 12, 32)
    cfg = ToMeConfig(method="downsample", downsample_factor=2)
    planner = Planner(cfg, 2, method=dit.method_for(cfg))
    plan = planner.plan(planner.begin((16, 24), x.device, 1.0), x)
    assert isinstance(plan, dit.DitPlan) and (plan.h, plan.w) == (8, 12)
    assert run(block, x, None, planner, None).shape == x.shape
    assert run(block, x, None, planner, plan).shape == x.shape
    assert seen == [(96, 2, False), (24, 2, True)] and ran == [32, 128] * 2
    assert M.width(block) == 32 and percall_runner.heads_of(block, 32) == 2


def test_auto_on_forge_neo_dits_measures_through_its_kernel(tmp_path, monkeypatch, capsys):
    """Forge Neo's swap: Flux, Qwen-Image and Wan (a video grid) are timed once per size
    (fake clock) and the auto line names the measured speed-up."""
    from stubs import fake_clock
    from webui_stub.harness import WebUI, neo

    from tome.webui import host
    calls = []
    service = C.Measurer(C.MeasurementCache(tmp_path / "m.json"), rounds=2, warmup=1,
                         clock=fake_clock(1.6, calls))
    monkeypatch.setattr(host, "_services", [service])
    auto = {"enabled": True, "method": "downsample", "downsample_factor": 2, "policy": "auto"}
    for kind in ("flux", "qwen", "wan"):
        webui, calls[:] = WebUI(neo.NeoModel(kind)), []
        res = webui.generate(tome=auto, steps=4)
        again = webui.generate(tome=auto, steps=4)
        out = capsys.readouterr().out
        size = "128x128 px" + (", 9 frames" if kind == "wan" else "")
        assert out.count(f"ToMe: measured {size}, batch 2, downsample, on ") == 1 and calls
        assert f"first pass {size}: ds2 measured 1.60x on " in res.info
        assert "ToMe merged: first pass ds2" in res.info and again.info == res.info
        assert torch.equal(torch.stack(res.images), torch.stack(again.images))
