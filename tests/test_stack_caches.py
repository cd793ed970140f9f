"""Residual reuse stacked with step caches (issue 49): a refresh a cache skipped (a whole
step, or some blocks of it) moves to the block's next computed call, on the diffusers path
with diffusers' own cache hooks (FirstBlockCache, MagCache, TaylorSeer) on the shipped tiny
DiT; the after-sampling line says where; refreshes paced to the step count
(``ToMeConfig.refreshes``); the generation bracket resets the caches' state between images.
The ComfyUI caches (EasyCache, LazyCache stand-ins) are in test_compose.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from stubs import tiny_flux_pipeline

import tome
from tome import reuse as reuse_mod
from tome import schedule
from tome_lab import tinydit

diffusers = pytest.importorskip("diffusers")
EVERY = 3
SETTINGS = {"method": "downsample", "schedule": "all:8", "reuse": EVERY, "policy": "fixed"}


@pytest.fixture(scope="module")
def trained():
    """The shipped weights: random weights change too much between steps for a cache to
    skip anything."""
    return tinydit.load_model()


def _fresh(m):
    return tinydit.load_model()


class _Probe:
    """Per block and model call (counted by the transformer's pre-hook): whether the block's
    attention ran, and with all keys (a refresh) or pooled ones."""

    def __init__(self, monkeypatch, m):
        self.step, self.calls = -1, []   # (step, block, full)
        self.block = None
        tr = m.transformer
        self.handles = [tr.register_forward_pre_hook(self._pre)]
        for i, b in enumerate([*tr.transformer_blocks, *tr.single_transformer_blocks]):
            self.handles.append(b.register_forward_pre_hook(self._at(i)))
        sdpa = F.scaled_dot_product_attention

        def counted(*args, **kwargs):
            k = args[1] if len(args) > 1 else kwargs["key"]
            q = args[0] if args else kwargs["query"]
            self.calls.append((self.step, self.block, k.shape[-2] >= q.shape[-2]))
            return sdpa(*args, **kwargs)
        self.monkeypatch = monkeypatch
        monkeypatch.setattr(F, "scaled_dot_product_attention", counted)

    def _pre(self, *_):
        self.step += 1

    def _at(self, i):
        def pre(*_):
            self.block = i
        return pre

    def close(self):
        for h in self.handles:
            h.remove()
        self.monkeypatch.undo()  # a MonkeyPatch made by hand is undone by hand


def _stale(calls, every):
    """Pooled calls reusing a residual ``every`` or more steps old (hand-written reference:
    per block, the steps since its last full call)."""
    ran: dict[tuple, bool] = {}  # (step, block) -> refreshed (a refresh runs both kernels)
    for step, block, full in calls:
        ran[step, block] = ran.get((step, block), False) or full
    last, out = {}, []
    for (step, block), full in ran.items():
        if full:
            last[block] = step
        elif block not in last or step - last[block] >= every:
            out.append((block, step))
    return out


def _sample(m, steps, cls=0, seed=0):
    tr = m.transformer
    ctx = tr.cache_context("t") if tr.is_cache_enabled else contextlib.nullcontext()
    with tome.generation(m), ctx:
        return tinydit.sample(m, [cls], seed=seed, steps=steps)


def _mag(steps):
    from tome_lab.stack_frontier import cache_config
    return cache_config("Mag 0.5", steps)


@pytest.mark.parametrize("cache", ["FBC 0.3", "Mag 0.5"])
def test_a_refresh_a_diffusers_cache_skipped_runs_at_the_blocks_next_computed_call(
        monkeypatch, cache):
    """diffusers' FirstBlockCache (skips blocks 1-5 of a step, computes block 0) and MagCache
    (skips every block of a step) on the tiny DiT with reuse every 3 steps: where the cache
    skipped a block on its refresh step, its next computed call refreshes, so no block ever
    adds a residual 3 or more steps old (shipped reuse recorded the refresh when the step
    began and lost it). The same seed gives the same image."""
    from tome_lab.stack_frontier import cache_config
    m = tinydit.load_model()
    m.transformer.enable_cache(cache_config(cache, 12))
    tome.apply_patch(m, **SETTINGS)
    probe = _Probe(monkeypatch, m)
    try:
        img = _sample(m, 12)
        calls = list(probe.calls)
        assert torch.equal(_sample(m, 12), img)
    finally:
        probe.close()
        tome.remove_patch(m)
    ran = {(s, b) for s, b, _ in calls}
    due = {(s, b) for s in range(0, 12, EVERY) for b in range(6)}
    assert due - ran, "the cache skipped no block on a refresh step: nothing to check"
    assert _stale(calls, EVERY) == []
    assert torch.isfinite(img).all()


def test_a_pipeline_says_which_refreshes_a_cache_moved(capsys):
    """The real FluxPipeline with MagCache: the line after the generation names the steps
    the cache skipped and each refresh it moved (due step -> the step it ran)."""
    m = tinydit.load_model()
    pipe, embeds = tiny_flux_pipeline(m)
    m.transformer.enable_cache(_mag(12))
    tome.apply_patch(pipe, **SETTINGS)
    probe = _Probe(pytest.MonkeyPatch(), m)
    try:
        capsys.readouterr()
        with torch.no_grad():
            pipe(**embeds, height=64, width=64, num_inference_steps=12, output_type="latent",
                 generator=torch.Generator().manual_seed(0))
        out = capsys.readouterr().out.splitlines()
    finally:
        probe.close()
        tome.remove_patch(pipe)
    steps = sorted({s for s, _, _ in probe.calls})
    skipped = [s for s in range(12) if s not in steps]
    full = sorted({s for s, _, f in probe.calls if f})
    # hand-written: the call's schedule (every EVERY steps from its last refresh step, kept
    # when the cache skips it) or a residual EVERY old makes a refresh due; one the cache
    # skipped runs at the next computed step, from the first step it was due
    moved, refreshed, lane, last, pending = [], [], None, None, None
    for s in range(12):
        scheduled = lane is None or s - lane >= EVERY
        lane = s if scheduled else lane
        due = scheduled or pending is not None or s - last >= EVERY
        if s in skipped:
            pending = s if due and pending is None else pending
            continue
        if due:
            if pending is not None:
                moved.append(f"{pending}->{s}")
            refreshed.append(s)
            last, pending = s, None
    assert skipped and moved and full == refreshed
    assert len(out) == 1 and out[0].endswith(
        f"; steps skipped by a cache {len(skipped)} of 12 (inside the model: "
        f"{', '.join(map(str, skipped))}); residual reuse refreshed at steps "
        f"{', '.join(map(str, full))}; refreshes a cache skipped, moved to the next computed "
        f"step: {', '.join(moved)}")


def test_a_block_a_cache_skipped_on_its_refresh_refreshes_at_its_next_call():
    """Two block parts, reuse every 5: the second is skipped (a FirstBlockCache-like cache)
    at steps 5 and 6; it refreshes at 7 (its residual 7 steps old otherwise) and with the
    first at 10; the settled call at 7 says the refresh due at 5 ran at 7."""
    r = reuse_mod.Reuse(5)
    a, b = r.join(0), r.join(1)
    fulls = {a: [], b: []}
    moved = []
    for step in range(12):
        r.begin(step / 12, 1, (1, 2, 2), step=step)
        for part in (a, b):
            if part == b and step in (5, 6):
                continue
            out = torch.zeros(1, 4, 2)
            r.around((r.parts()[part], 2), out,
                     lambda rows=None, part=part, step=step: fulls[part].append(step)
                     or torch.ones(1, 4, 2))
        moved += r.settle().moved
    assert fulls == {a: [0, 5, 10], b: [0, 7, 10]}
    assert moved == [(5, 7)]


def test_a_paced_period_follows_the_square_root_of_the_steps():
    """``paced``: ``reuse`` N is the period at 20 steps, scaled by sqrt(steps / 20), at least
    2; without a step count, unpaced, or with reuse off: N (hand-computed)."""
    assert [schedule.period(5, True, n) for n in (4, 8, 20, 50)] == [2, 3, 5, 8]
    assert [schedule.period(10, True, n) for n in (4, 8, 50)] == [4, 6, 16]
    assert schedule.period(5, True, None) == 5 and schedule.period(5, False, 8) == 5
    assert schedule.period(1, True, 50) == 2 and schedule.period(0, True, 8) == 0
    r = reuse_mod.Reuse(5, paced=True)
    r.pace(50)
    assert r.every == 8
    r.pace(None)
    assert r.every == 5


def test_a_pipeline_paces_refreshes_to_its_step_count(monkeypatch):
    """A pipeline of 8 steps with reuse 5 paced: refreshes at steps 0, 3 and 6 (every 3),
    where unpaced it refreshes at 0 and 5; the quality preset is paced."""
    assert tome.preset("quality").paced and tome.preset("fast").paced
    m = tinydit.load_model()
    pipe, embeds = tiny_flux_pipeline(m)
    fulls = {}
    for paced in (False, True):
        tome.apply_patch(pipe, method="downsample", schedule="all:8", reuse=5, paced=paced,
                         policy="fixed")
        probe = _Probe(monkeypatch, m)
        try:
            with torch.no_grad():
                pipe(**embeds, height=64, width=64, num_inference_steps=8,
                     output_type="latent", generator=torch.Generator().manual_seed(0))
        finally:
            probe.close()
            tome.remove_patch(pipe)
        fulls[paced] = sorted({s for s, _, f in probe.calls if f})
    assert fulls == {False: [0, 5], True: [0, 3, 6]}


def test_the_generation_bracket_resets_diffusers_caches_between_images():
    """TaylorSeer counts steps and keeps features across calls: inside ``tome.generation``
    the second image is the one a fresh cache gives (unpatched, and patched)."""
    from tome_lab.stack_frontier import cache_config
    for patched in (False, True):
        m = tinydit.load_model()
        m.transformer.enable_cache(cache_config("TS 5", 12))
        if patched:
            tome.apply_patch(m, **SETTINGS)
        _sample(m, 12, cls=0, seed=0)
        second = _sample(m, 12, cls=1, seed=1)
        fresh = tinydit.load_model()
        fresh.transformer.enable_cache(cache_config("TS 5", 12))
        if patched:
            tome.apply_patch(fresh, **SETTINGS)
        assert torch.equal(second, _sample(fresh, 12, cls=1, seed=1))


class _Periods:
    """A measuring service (``Measurer.for_model``'s shape) that records the refresh period
    each measurement would time (the runner's ``period``) and answers "pooling pays"."""

    def __init__(self):
        self.periods = []

    def for_model(self, model, config, runner):
        def measured(size, batch, device):
            self.periods.append(runner.period())
            return {level: (2.0, "test") for level in (1, 2)}
        return measured


def test_the_auto_policy_times_the_refresh_period_a_cache_leaves(monkeypatch):
    """MagCache skips steps, and reuse's refreshes it skipped run at the next computed step,
    so the computed steps refresh more often than every 3: the generation after one the
    cache skipped in is measured again, timing every 3 x the share of steps computed (by
    hand: the steps whose blocks ran, from the attention calls seen); the first generation
    times the settings' 3, and a third with the same share measures nothing new."""
    m = tinydit.load_model()
    m.transformer.enable_cache(_mag(12))
    periods = _Periods()
    tome.apply_patch(m, measure=periods, **{**SETTINGS, "policy": "auto"})
    probe = _Probe(monkeypatch, m)
    try:
        _sample(m, 12)
        computed = len({s for s, _, _ in probe.calls})
        _sample(m, 12)
        _sample(m, 12)
    finally:
        probe.close()
        tome.remove_patch(m)
    assert 0 < computed < 12, "the cache skipped no step: nothing to check"
    assert periods.periods == [EVERY, max(1.0, round(EVERY * computed / 12, 1))]
