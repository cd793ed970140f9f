"""The DiT engine as hosts drive it (issue 47): residual reuse that owns its state per call
identity and thread, a generation bracket for loops the library does not know, and the
patch handle hosts hold instead of the adapters' objects.

Stand-ins hand what the hosts hand: ComfyUI's area conditioning (the cond on a crop of the
latent, the uncond on all of it: two grids in one step), ComfyUI's MultiGPU (deep clones of
one patched model sampled in worker threads at once), a hand-written sampling loop stopped
early and the next img2img starting later in the schedule at the same size.
"""

from __future__ import annotations

import copy
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "comfy_stub"))

from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingFlux, simple_sigmas  # noqa: E402
from comfy.sampling import dit_sample  # noqa: E402
from comfy_node import defaults, flux_key_lengths  # noqa: E402

import tome  # noqa: E402
from tome import adapters  # noqa: E402
from tome.comfy import nodes  # noqa: E402
from tome_lab import tinydit  # noqa: E402
from tome_lab.tinydit.model import schedule  # noqa: E402

LATENT = (1, 4, 16, 24)  # Flux: 8 x 12 tokens of 2x2 latent pixels
REUSE = {"method": "downsample", "policy": "fixed", "schedule": "all:2", "reuse": 5}


def flux():
    from comfy.ldm.flux.model import Flux
    from comfy.model_base import BaseModel
    torch.manual_seed(0)
    return ModelPatcher(BaseModel(Flux().eval(), ModelSamplingFlux(shift=1.15)))


def sample(patcher, steps=10, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(LATENT, generator=g)
    ctx, uncond = torch.randn(1, 5, 12, generator=g), torch.randn(1, 5, 12, generator=g)
    sigmas = simple_sigmas(patcher.get_model_object("model_sampling"), steps)
    with torch.no_grad():
        return dit_sample(patcher, noise, ctx, sigmas, cfg=2.0, uncond=uncond, **kw)


def test_area_conditionings_two_grids_keep_their_own_residuals(monkeypatch):
    """Area conditioning (the cond on a 12x16 crop, the uncond on the whole 16x24 latent):
    each grid is its own identity, refreshed at steps 0 and 5 of 10 as the settings say; a
    grid change used to count as a new generation, so every call refreshed (10 of 10 steps
    ran the full attention too: more attention work than without ToMe)."""
    (ours,) = nodes.ToMePatch().patch(flux(), **defaults(**REUSE))
    seen = flux_key_lengths(monkeypatch)
    out = sample(ours, area=(12, 16))
    blocks = 4  # the stand-in Flux's double + single blocks
    text, crop, whole = 5, 6 * 8, 8 * 12
    assert seen.count(text + whole) == 2 * blocks  # the uncond's refreshes: steps 0 and 5
    assert seen.count(text + crop) == 2 * blocks   # the cond's, on its own grid
    assert seen.count(text + whole // 4) == 10 * blocks and seen.count(text + crop // 4) \
        == 10 * blocks  # every step pooled, both grids
    assert torch.isfinite(out).all()
    assert torch.equal(sample(ours, area=(12, 16)), out)  # same seed, same latent


def test_two_threads_sampling_two_clones_each_equal_their_single_threaded_run():
    """ComfyUI's MultiGPU CFG Split samples deep clones of one patched model in worker
    threads at once: each thread's calls read their own call state and keep their own
    residuals (in lockstep here, so every call of one thread falls between two of the
    other's), and each clone gives bit for bit its single-threaded latent."""
    (ours,) = nodes.ToMePatch().patch(flux(), **defaults(**REUSE))
    clones = [copy.deepcopy(ours), copy.deepcopy(ours)]
    alone = [sample(c, seed=i) for i, c in enumerate(clones)]
    got = in_lockstep(clones)
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])
    assert not torch.equal(alone[0], alone[1])


def in_lockstep(clones):
    """Sample two clones in two threads at once (clone ``i`` with seed ``i``), each model
    call waiting for the other thread's: the latents."""
    barrier = threading.Barrier(2)
    for c in clones:
        inner = c.model.apply_model

        def lockstep(*args, _inner=inner, **kwargs):
            barrier.wait(timeout=60)
            return _inner(*args, **kwargs)
        c.model.apply_model = lockstep
    got: list = [None, None]
    errors: list = []

    def run(i):
        try:
            got[i] = sample(clones[i], seed=i)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return got


def _loop(m, x, ts, cls):
    with torch.no_grad():
        for t, t_next in zip(ts[:-1], ts[1:]):
            x = x + (t_next - t) * m(x, torch.full((len(cls),), t), cls)
    return x


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return tinydit.build_model().eval()


def test_the_generation_bracket_keeps_an_interrupted_generation_from_the_next(tiny):
    """A hand-written loop on a bare patched transformer (no pipeline bracket): A stops
    after 3 of 8 steps; B, an img2img at the same size, starts at step 3. Without a bracket
    B inherits A's residuals (progress did not go back: nothing tells the patch a new
    generation began); inside ``tome.generation`` B is exactly what a fresh patch gives."""
    m = copy.deepcopy(tiny)
    ts, cls = schedule(8).tolist(), torch.tensor([2])
    a, b = (torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(s))
            for s in (0, 1))
    tome.apply_patch(m, config=tome.preset("quality", policy="fixed"))
    try:
        fresh = _loop(m, b, ts[3:], cls)
        tome.remove_patch(m)
        tome.apply_patch(m, config=tome.preset("quality", policy="fixed"))
        _loop(m, a, ts[:4], cls)  # A, stopped
        leaked = _loop(m, b, ts[3:], cls)
        with tome.generation(m):
            _loop(m, a, ts[:4], cls)
        with tome.generation(m):
            bracketed = _loop(m, b, ts[3:], cls)
        assert tome.patch_handle(m).held_bytes() == 0  # freed on leaving
    finally:
        tome.remove_patch(m)
    assert torch.equal(bracketed, fresh)
    assert not torch.equal(leaked, fresh)


def test_the_patch_handle_is_what_a_host_holds(monkeypatch):
    """``adapters.patch_model_patcher`` takes the host's callbacks; ``adapters.handle`` gives
    the settings as applied, the limits and the after-sampling line, the same line the node
    prints; hosts never read the adapter's object."""
    said: list[str] = []
    windows: list[dict] = []
    clone, report = adapters.patch_model_patcher(
        flux(), tome.preset("quality", policy="fixed"),
        callbacks=adapters.Callbacks(say=said.append, on_call=windows.append))
    patch = adapters.handle(clone)
    assert patch.per_call and patch.report is report
    assert patch.applied.schedule == "all:8" and patch.applied.rope == "before"
    assert patch.limits == []
    since = patch.since()
    sample(clone, steps=6)
    assert windows, "the host's look at each call's options was handed over"
    line = patch.after(since)
    assert line.startswith("ToMe: pooled ") and "attention calls" in line
    assert patch.held_bytes() == 0  # freed at the run's end (ComfyUI's on_cleanup)



def test_a_worker_thread_that_ended_leaves_nothing_kept_behind():
    """ComfyUI's MultiGPU samples in worker threads: what a finished thread's lane kept is
    dropped when the next thread's lane is made (before: every thread's lane stayed, with its
    residuals, for the patch's life)."""
    from tome.reuse import Reuse

    reuse = Reuse(5)
    pos = reuse.join(0)

    def sample():
        reuse.begin(0.0, 1, (1, 2, 2))
        reuse.around((reuse.parts()[pos], 2), torch.zeros(1, 4, 8), lambda: torch.ones(1, 4, 8))
    worker = threading.Thread(target=sample)
    worker.start()
    worker.join()
    assert reuse.held_bytes() > 0  # the ended thread's residual, until another lane is made
    other = threading.Thread(target=reuse.lane)
    other.start()
    other.join()
    assert reuse.held_bytes() == 0 and len(reuse._lanes) == 1


def test_every_bracket_plans_its_call_through_the_one_planner(tiny, monkeypatch):
    """The processors' pre-hook (diffusers, A1111's SD3) and the per-call core (ComfyUI)
    plan each model call through ``callplan.Planned.plan_call``, their differences handed
    in: the diffusers Flux timestep with its scale (a 0-999 window), ComfyUI's sigma with
    the call's identity. Where the one planner says nothing pools, neither path pools: its
    output is the unpatched model's, bit for bit (before, each path planned on its own)."""
    from tome import callplan

    seen: list = []
    real = callplan.Planned.plan_call

    def spy(self, size, tokens, device, noise, batch, **kw):
        seen.append((type(self).__name__, kw.get("scale"), kw.get("who")))
        return None if off else real(self, size, tokens, device, noise, batch, **kw)
    monkeypatch.setattr(callplan.Planned, "plan_call", spy)
    m = copy.deepcopy(tiny)
    ts, cls = schedule(4).tolist(), torch.tensor([2])
    x = torch.randn((1, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    ref = _loop(m, x, ts, cls)
    unpatched = sample(flux(), steps=3)
    tome.apply_patch(m, config=tome.preset("quality", policy="fixed"))
    (ours,) = nodes.ToMePatch().patch(flux(), **defaults(**REUSE))
    try:
        off = False
        assert not torch.equal(_loop(m, x, ts, cls), ref)
        assert not torch.equal(sample(ours, steps=3), unpatched)
        assert ("_State", 1000.0, None) in seen and ("OverridePatch", None, (0,)) in seen
        off = True
        assert torch.equal(_loop(m, x, ts, cls), ref)
        assert torch.equal(sample(ours, steps=3), unpatched)
    finally:
        tome.remove_patch(m)
