"""Residual reuse as hosts drive it (``tome.attend.Reuse`` through the processors adapter, on
the shipped tiny DiT: a diffusers Flux at tiny width): compiled blocks, generations that stop
early and the next starting later in the schedule, a transposed grid, batch sizes that
alternate per step, several calls per noise level, steps a host's cache skipped, freeing at a
generation's end, on errors and on removal; and what the report and the help say.

The hosts' calls are stand-ins written from what they hand the model: A1111's CFG denoiser
(cond rows first, the uncond dropped on odd steps below the negative-guidance minimum
sigma), a Heun sampler calling cond, uncond and a third condition separately, and the real
diffusers ``FluxPipeline`` (its scheduler, ``progress_bar``, interrupt flag and callbacks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from stubs import tiny_flux_pipeline

import tome
from tome import config, processors
from tome_lab import tinydit
from tome_lab.tinydit.model import NULL, schedule


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tinydit.build_model().eval()


def _state(m):
    return vars(m.transformer)[processors.STATE_ATTR]


class _Kernels:
    """Counts the attention kernel's calls: pooled (fewer keys than queries) and full."""

    def __init__(self, monkeypatch):
        self.full = self.pooled = 0
        sdpa = F.scaled_dot_product_attention

        def counted(*args, **kwargs):
            q, k = (args + (None, None))[:2] if len(args) >= 2 else (kwargs["query"],
                                                                      kwargs["key"])
            if k.shape[-2] == q.shape[-2]:
                self.full += 1
            else:
                self.pooled += 1
            return sdpa(*args, **kwargs)
        monkeypatch.setattr(F, "scaled_dot_product_attention", counted)


def _euler(m, x, ts, cls, guidance=1.0):
    with torch.no_grad():
        for t, t_next in zip(ts[:-1], ts[1:]):
            tt = torch.full((len(cls),), t)
            if guidance != 1.0:
                v_c, v_u = m(torch.cat([x, x]), torch.cat([tt, tt]),
                             torch.cat([cls, torch.full_like(cls, NULL)])).chunk(2)
                v = v_u + guidance * (v_c - v_u)
            else:
                v = m(x, tt, cls)
            x = x + (t_next - t) * v
    return x


def _noise(h, w, seed=0):
    return torch.randn((1, 3, h, w), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- compile

def test_compiled_blocks_reuse_residuals_as_eager_and_steps_do_not_recompile(model):
    """diffusers' regional compilation (every block compiled with ``fullgraph=True``, as the
    README recommends) on the ``quality`` preset: reuse runs in the graph (the eager latents,
    not the plain x8 pooling's) and, after a warm-up generation, neither steps, refreshes nor
    a new generation recompile."""
    import torch._dynamo.testing

    m = copy.deepcopy(model)
    ts, cls, x = schedule(8).tolist(), torch.tensor([1]), _noise(32, 32)
    tome.apply_patch(m, config=tome.preset("quality", policy="fixed"))
    eager = _euler(m, x, ts, cls)
    tome.apply_patch(m, config=tome.preset("quality", policy="fixed", reuse=0))
    plain = _euler(m, x, ts, cls)
    tome.apply_patch(m, config=tome.preset("quality", policy="fixed"))
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    try:
        for block in [*m.transformer.transformer_blocks, *m.transformer.single_transformer_blocks]:
            block.compile(fullgraph=True, backend=counter)
        warm = _euler(m, x, ts, cls)  # the warm-up: each graph variant compiles once
        frames = counter.frame_count
        with torch._dynamo.config.patch(error_on_recompile=True):
            again = _euler(m, x, ts, cls)
        assert counter.frame_count == frames
    finally:
        torch._dynamo.reset()
        tome.remove_patch(m)
    torch.testing.assert_close(warm, eager)
    torch.testing.assert_close(again, eager)
    assert not torch.allclose(warm, plain, atol=1e-4)


# ----------------------------------------------------------------------------- generations

def test_a_generation_stopped_early_leaves_nothing_to_a_transposed_image_starting_later(model):
    """A patch kept across generations: A (8x12 tokens) stops after 3 of 8 steps; B, its
    transpose (12x8: as many tokens), starts later in the schedule (img2img). B gets exactly
    the latents it gets on a fresh patch: A's residuals do not reach it."""
    m = copy.deepcopy(model)
    ts, cls = schedule(8).tolist(), torch.tensor([2])
    tome.apply_patch(m, method="downsample", downsample_factor=4, reuse=5)
    try:
        fresh = _euler(m, _noise(24, 16, 1), ts[3:], cls)
        _euler(m, _noise(16, 24), ts[:4], cls)       # A: 3 steps, then stopped
        after = _euler(m, _noise(24, 16, 1), ts[3:], cls)  # B: from step 3 on
    finally:
        tome.remove_patch(m)
    assert torch.equal(after, fresh)


def _pipeline(m):
    pipe, embeds = tiny_flux_pipeline(m)

    def generate(steps=6, sigmas=None, seed=0, callback=None):
        return pipe(**embeds, height=128, width=128, num_inference_steps=steps, sigmas=sigmas,
                    output_type="latent", generator=torch.Generator().manual_seed(seed),
                    callback_on_step_end=callback).images
    return pipe, generate


def test_a_diffusers_pipeline_says_after_each_generation_what_its_calls_did(model, capsys):
    """The line the per-call hosts print after each sampling, once per pipeline generation
    (the pipeline's bracket): every attention call pooled (the tiny DiT's 1 + 1 blocks at
    each of 6 steps); an interrupted generation says nothing."""
    m = copy.deepcopy(model)
    pipe, generate = _pipeline(m)
    tome.apply_patch(pipe, method="downsample", policy="fixed")
    try:
        capsys.readouterr()
        generate(6)
        blocks = len(m.transformer.transformer_blocks) + len(
            m.transformer.single_transformer_blocks)
        assert capsys.readouterr().out.splitlines() == [
            f"ToMe: pooled {6 * blocks} of {6 * blocks} attention calls"]

        def interrupt(p, i, t, kw):
            if i == 2:
                p._interrupt = True
            return {}
        generate(callback=interrupt)
        assert capsys.readouterr().out == ""
    finally:
        tome.remove_patch(pipe)


def test_a_diffusers_pipeline_frees_reuse_at_the_end_on_interrupt_and_error(model):
    """The library's normal use: ``apply_patch(pipe)`` once, then generations. What reuse
    keeps lives only inside a generation: freed when it ends, when it is interrupted (the
    pipeline's ``interrupt`` flag) or fails, and a generation starting later in the schedule
    after an interrupted one gets the latents of a fresh patch."""
    m = copy.deepcopy(model)
    pipe, generate = _pipeline(m)
    later = [0.6, 0.5, 0.4, 0.3]  # img2img-like: a schedule that starts later
    tome.apply_patch(pipe, config=tome.preset("quality", policy="fixed"))
    try:
        fresh = generate(4, later, seed=1)
        held = []

        def interrupt(p, i, t, kw):
            held.append(_state(m).reuse.held_bytes())
            if i == 2:
                p._interrupt = True
            return {}
        generate(callback=interrupt)
        assert held[0] > 0 and _state(m).reuse.held_bytes() == 0
        assert torch.equal(generate(4, later, seed=1), fresh)

        def fail(p, i, t, kw):
            raise RuntimeError("out of memory")
        with pytest.raises(RuntimeError):
            generate(callback=fail)
        assert _state(m).reuse.held_bytes() == 0
        generate(2)
        assert _state(m).reuse.held_bytes() == 0
        assert torch.equal(generate(4, later, seed=1), fresh)
        _euler(m, _noise(16, 16), schedule(3).tolist(), torch.tensor([0]))  # a bare call
        assert _state(m).reuse.held_bytes() > 0
        state = _state(m)
    finally:
        tome.remove_patch(pipe)
    assert state.reuse.held_bytes() == 0  # removal frees it
    assert "progress_bar" not in vars(pipe)


# ----------------------------------------------------------------------------- counting

def test_a_batch_that_drops_its_uncond_on_odd_steps_keeps_a_residual_per_call(model,
                                                                              monkeypatch):
    """A1111's negative-guidance minimum sigma: below it, odd steps call the model with the
    cond rows only. Each batch gets its own residuals: of 10 calls only the refreshes run
    full (steps 0 and 6 for the CFG batch, 1 and 7 for the cond-only one), not every call."""
    m = copy.deepcopy(model)
    ts, cls, x = schedule(10).tolist(), torch.tensor([0]), _noise(16, 16)
    tome.apply_patch(m, method="downsample", downsample_factor=2, reuse=5)
    kernels = _Kernels(monkeypatch)
    try:
        with torch.no_grad():
            for i, (t, t_next) in enumerate(zip(ts[:-1], ts[1:])):
                tt = torch.full((1,), t)
                if i % 2:  # the uncond dropped: cond rows only
                    v = m(x, tt, cls)
                else:
                    v_c, v_u = m(torch.cat([x, x]), torch.cat([tt, tt]),
                                 torch.cat([cls, torch.full_like(cls, NULL)])).chunk(2)
                    v = v_u + 3.0 * (v_c - v_u)
                x = x + (t_next - t) * v
    finally:
        tome.remove_patch(m)
    blocks = 6
    assert kernels.full == 4 * blocks and kernels.pooled == 10 * blocks


def test_heun_with_three_calls_per_evaluation_refreshes_every_n_steps(model, monkeypatch):
    """Heun evaluates twice per step and this host calls cond, uncond and a third condition
    apart: six calls at most noise levels. Each call keeps its own residual and refreshes
    every 5 steps (not at every step, as counting calls by order did)."""
    m = copy.deepcopy(model)
    sigmas, x = schedule(10).tolist(), _noise(16, 16)
    conds = [torch.tensor([c]) for c in (0, NULL, 1)]
    tome.apply_patch(m, method="downsample", downsample_factor=2, reuse=5)
    kernels = _Kernels(monkeypatch)
    calls = 0

    def denoise(x, s):
        nonlocal calls
        vs = [m(x, torch.full((1,), s), c) for c in conds]
        calls += len(vs)
        return vs[0] + vs[1] + vs[2]

    try:
        with torch.no_grad():
            for s, s_next in zip(sigmas[:-1], sigmas[1:]):
                d = denoise(x, s)
                x2 = x + (s_next - s) * d
                if s_next > 0:  # Heun's correction at the next noise level
                    x = x + (s_next - s) * (d + denoise(x2, s_next)) / 2
                else:
                    x = x2
    finally:
        tome.remove_patch(m)
    blocks = 6
    assert kernels.pooled == calls * blocks
    # 6 identities (3 calls at a step's start, 3 at the correction), each refreshing at its
    # first call and 5 steps later; the last step has no correction call
    assert kernels.full == 12 * blocks


def test_a_call_a_host_cache_skipped_refreshes_instead_of_extrapolating_far(model,
                                                                          monkeypatch):
    """cond and uncond called apart; a host cache answers the uncond itself on steps 5-8
    (skipping its model calls, the refresh at step 5 among them). The uncond's next call,
    9 steps after its last refresh, refreshes (runs full) instead of stretching the
    extrapolation over 9 steps: 2 refreshes each for cond (0, 5) and uncond (0, 9)."""
    m = copy.deepcopy(model)
    ts, x = schedule(10).tolist(), _noise(16, 16)
    cond, uncond = torch.tensor([3]), torch.tensor([NULL])
    tome.apply_patch(m, method="downsample", downsample_factor=2, reuse=5)
    kernels = _Kernels(monkeypatch)
    try:
        with torch.no_grad():
            for i, t in enumerate(ts[:-1]):
                tt = torch.full((1,), t)
                m(x, tt, cond)
                if not 5 <= i <= 8:
                    m(x, tt, uncond)
    finally:
        tome.remove_patch(m)
    assert kernels.full == 4 * 6


# ----------------------------------------------------------------------------- words

def test_the_report_says_the_schedule_and_reuse_that_run(model):
    m = copy.deepcopy(model)
    tome.apply_patch(m, config=tome.preset("quality", policy="fixed"))
    try:
        text = tome.patch_report(m).summary()
    finally:
        tome.remove_patch(m)
    assert "x8 in all blocks" in text and "residual reuse every 5 steps" in text, text
    tome.apply_patch(m, method="downsample")
    try:  # nothing else set: the method's words, as before
        assert "DiT, downsample x2; 6/6 blocks pooled" in tome.patch_report(m).summary()
    finally:
        tome.remove_patch(m)


def test_the_reuse_help_says_what_is_kept_and_that_memory_is_checked():
    import dataclasses
    text = next(f for f in dataclasses.fields(config.ToMeConfig) if f.name == "reuse") \
        .metadata["help"]
    assert "one attention output" not in text
    assert "per pooled block and per call" in text and "free memory" in text
