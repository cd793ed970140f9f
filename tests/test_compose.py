"""The ToMe node stacked with what ComfyUI users stack on a DiT (issue 40, item 4), against
the stand-in of ComfyUI (``tests/comfy_stub``): its sampler with the ``predict_noise``,
``calc_cond_batch`` and ``diffusion_model`` wrappers and the ``on_prepare_state`` callbacks;
core's EasyCache and LazyCache (``comfy_extras/nodes_easycache.py``), TorchCompileModel
(``comfy_api/torch_helpers``), an override another node installs (KJNodes' SageAttention
patch, core's ModelAttentionBackend) before or after ours, and current ComfyUI's
BlockSparseAttention (``comfy_extras/nodes_sparse_attention.py``). What is decided:

- caches: residual reuse counts the sampler's steps (the sigma's place in ``sample_sigmas``),
  so whole steps a cache skipped count; a call that was to refresh but that a cache answered
  inside the model leaves its refresh to the next computed call; the line after the
  sampling names the steps a cache skipped;
- compile: the call's state sits outside the compiled model, so pooling and reuse apply;
- another override: chained (it gets our pooled tensors) in either order, said once;
- block-sparse attention: the calls it would take are left to it whole (pooled keys make it
  decline), said once; the others are pooled."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy_extras import nodes_easycache, nodes_sparse_attention  # noqa: E402
from comfy_node import defaults  # noqa: E402

from tome import modelpatcher as mp  # noqa: E402
from tome import override  # noqa: E402
from tome.comfy import host, nodes  # noqa: E402

LATENTS = {"flux": (1, 4, 16, 24), "wan": (1, 4, 3, 16, 24)}
IMAGE_KEYS = {"flux": 5 + 8 * 12, "wan": 3 * 8 * 12}  # keys of a whole call's sequence
BLOCKS = {"flux": 4, "wan": 2}
REUSE = {"method": "downsample", "policy": "fixed", "schedule": "all:4", "reuse": 3}


def dit_model(family="flux", **kw):
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.wan.model import WanModel
    from comfy.model_base import BaseModel
    from comfy.model_sampling import ModelSamplingDiscreteFlow, ModelSamplingFlux
    torch.manual_seed(0)
    net, sampling = {"flux": (Flux, ModelSamplingFlux(shift=1.15)),
                     "wan": (WanModel, ModelSamplingDiscreteFlow(shift=8.0))}[family]
    return ModelPatcher(BaseModel(net(**kw).eval(), sampling))


def sample(patcher, family="flux", steps=12, cfg=2.0, latent=None):
    """A KSampler run (Euler, "simple" sigmas, cfg 2: cond and uncond apart) from seeded
    noise and text."""
    from comfy.model_sampling import simple_sigmas
    from comfy.sampling import dit_sample
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(latent or LATENTS[family], generator=g)
    ctx, uncond = torch.randn(1, 5, 12, generator=g), torch.randn(1, 5, 12, generator=g)
    sigmas = simple_sigmas(patcher.get_model_object("model_sampling"), steps)
    with torch.no_grad():
        return dit_sample(patcher, noise, ctx, sigmas, cfg=cfg, uncond=uncond)


def spy(monkeypatch, family="flux"):
    """(sigma, key length) of each attention call the backend runs."""
    import comfy.ldm.flux.math
    import comfy.ldm.wan.model
    from comfy.ldm.modules import attention as comfy_attention
    seen = []

    @comfy_attention.wrap_attn
    def attention_pytorch(q, k, v, heads, mask=None, **kw):
        sigma = float(kw["transformer_options"]["sigmas"].reshape(-1)[0])
        seen.append((sigma, k.shape[2 if kw.get("skip_reshape") else 1]))
        return comfy_attention.attention_pytorch.__wrapped__(q, k, v, heads, mask, **kw)

    module = {"flux": comfy.ldm.flux.math, "wan": comfy.ldm.wan.model}[family]
    monkeypatch.setattr(module, "optimized_attention", attention_pytorch)
    return seen


def refreshes(skipped, steps, every):
    """The steps that refresh (run the unpooled attention too) when a cache skipped
    ``skipped``: the first computed step, then the first computed step at least ``every``
    sampler steps after the last refresh (hand-written, not the code under test)."""
    out, last = [], None
    for s in range(steps):
        if s not in skipped and (last is None or s - last >= every):
            out.append(s)
            last = s
    return out


def step_index(sigmas, sigma):
    return min(range(len(sigmas)), key=lambda i: abs(float(sigmas[i]) - sigma))


# ----------------------------------------------------------------------------- caches

@pytest.mark.parametrize("family", ["flux", "wan"])
@pytest.mark.parametrize("cache", ["EasyCache", "LazyCache"])
def test_a_cache_that_skips_steps_keeps_reuses_refreshes(lines, monkeypatch, family, cache):
    """EasyCache (skips inside the model: our apply_model wrapper runs, the attention does
    not) and LazyCache (skips before it) stacked with ours, at a threshold where they skip
    steps: refreshes fall on the first computed step at least 3 sampler steps after the last
    (each of cond and uncond: the unpooled keys once per pooled block), so a refresh the
    cache skipped happens at the next computed step and the steps the cache skipped count;
    the graph repeats identically and differs from the cache alone; the line after the
    sampling names the skipped steps and each refresh the cache moved (due -> ran)."""
    from comfy.model_sampling import simple_sigmas
    base = dit_model(family)
    node = getattr(nodes_easycache, cache)()
    (alone,) = node.execute(base, reuse_threshold=1.0)
    without = sample(alone, family)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**REUSE))
    (both,) = node.execute(ours, reuse_threshold=1.0)
    seen = spy(monkeypatch, family)
    told = len(lines)
    out = sample(both, family)
    sigmas = simple_sigmas(base.get_model_object("model_sampling"), 12)
    skipped = {step_index(sigmas, s) for s in nodes_easycache.sample_wrapper.last.skipped}
    full = [step_index(sigmas, s) for s, n in seen if n == IMAGE_KEYS[family]]
    expected = refreshes(skipped, 12, 3)
    assert skipped and any(s not in expected and s in refreshes(set(), 12, 3) for s in skipped)
    assert sorted(set(full)) == expected
    assert all(full.count(s) == 2 * BLOCKS[family] for s in expected)
    assert not {step_index(sigmas, s) for s, _ in seen} & skipped  # no attention there
    where = "inside the model" if cache == "EasyCache" else "before the model call"
    numbers = ", ".join(map(str, sorted(skipped)))
    # a refresh due 3 steps after the last that the cache skipped, and where it ran
    moved = [f"{a + 3}->{b}" for a, b in zip(expected, expected[1:]) if b > a + 3]
    assert moved
    assert lines[told:][-1].endswith(
        f"; steps skipped by a cache {len(skipped)} of 12 ({where}: {numbers}); residual "
        f"reuse refreshed at steps {', '.join(map(str, expected))}; refreshes a cache "
        f"skipped, moved to the next computed step: {', '.join(moved)}")
    assert "model calls not reaching it" not in lines[-1]
    assert torch.isfinite(out).all() and not torch.equal(out, without)
    assert torch.equal(sample(both, family), out)
    assert getattr(ours, mp.MARK).reuse.held_bytes() == 0


def test_the_auto_policy_times_the_refresh_period_a_cache_leaves(lines, monkeypatch):
    """LazyCache skips steps before the model call and reuse's refreshes move to the next
    computed step, so the computed steps refresh more often than every 3: the sampling after
    one the cache skipped in measures again (the runner's period: 3 x the share of the 12
    steps computed, by hand from the cache's own record), the first times the settings' 3."""
    from comfy.model_sampling import simple_sigmas

    from tome import measurements
    periods = []

    def for_model(self, model, config, runner):
        def measured(size, batch, device):
            periods.append(runner.period())
            return {level: (2.0, "test") for level in (1, 2)}  # pooling pays
        return measured
    monkeypatch.setattr(measurements.Measurer, "for_model", for_model)
    base = dit_model()
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**{**REUSE, "policy": "auto"}))
    (both,) = nodes_easycache.LazyCache().execute(ours, reuse_threshold=1.0)
    sample(both)
    sigmas = simple_sigmas(base.get_model_object("model_sampling"), 12)
    skipped = {step_index(sigmas, s) for s in nodes_easycache.sample_wrapper.last.skipped}
    sample(both)
    assert skipped and periods == [3, round(3 * (12 - len(skipped)) / 12, 1)]


def test_the_easycache_stand_in_computes_a_call_it_cannot_answer_whole():
    """As v0.30's EasyCache (``can_apply_cache_diff``, read against the real node, issue 49):
    a step marked skipped is answered from the kept changes only where every condition of the
    call has one; a call with a condition not seen yet is computed."""
    h = nodes_easycache.Holder("EasyCache", 1.0, 0.15, 0.95)
    h.start_sigma, h.end_sigma, h.first, h.skip_now = 10.0, 0.0, "a", True
    h.diffs = {"a": torch.ones(1, 2, 2, 2)}
    x, ran = torch.zeros(2, 2, 2, 2), []
    options = {"sigmas": torch.tensor([1.0]), "uuids": ["a", "b"], "easycache": h}
    out = nodes_easycache.easycache_forward(lambda x, o: ran.append(1) or x + 5, x, options)
    assert ran and torch.equal(out, x + 5)
    options["uuids"] = ["a"]
    # a call of "a" alone is answered from the change just kept (nothing computed)
    assert torch.equal(nodes_easycache.easycache_forward(None, x[:1], options), x[:1] + 5)


def test_reuse_keys_its_steps_on_the_sampler_schedule(lines, monkeypatch):
    """The same settings without a cache refresh at steps 0, 3, 6, 9 of 12 (the sampler's
    own step numbers, read from ``sample_sigmas``)."""
    from comfy.model_sampling import simple_sigmas
    base = dit_model()
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**REUSE))
    seen = spy(monkeypatch)
    sample(ours)
    sigmas = simple_sigmas(base.get_model_object("model_sampling"), 12)
    full = sorted({step_index(sigmas, s) for s, n in seen if n == IMAGE_KEYS["flux"]})
    assert full == [0, 3, 6, 9]
    assert "steps skipped by a cache" not in lines[-1]
    assert lines[-1].endswith("; residual reuse refreshed at steps 0, 3, 6, 9")


# ----------------------------------------------------------------------------- compile

@pytest.mark.parametrize("order", ["tome first", "compile first"])
def test_a_compiled_model_pools_and_reuses_as_eager(lines, order):
    """TorchCompileModel before or after ours, with residual reuse: the compiled sampling
    gives the eager latent (pooled, with reuse: not the latent without reuse)."""
    import torch._dynamo.testing
    from comfy_api.torch_helpers import set_torch_compile_wrapper, skip_torch_compile_dict
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    base = dit_model()

    def compiled(m):
        m = m.clone()
        set_torch_compile_wrapper(m, counter, options={"guard_filter_fn": skip_torch_compile_dict})
        return m

    config = defaults(**REUSE)
    if order == "tome first":
        model = compiled(nodes.ToMePatch().patch(base, **config)[0])
    else:
        model = nodes.ToMePatch().patch(compiled(base), **config)[0]
    (eager,) = nodes.ToMePatch().patch(base, **config)
    (plain,) = nodes.ToMePatch().patch(base, **defaults(**{**REUSE, "reuse": 0}))
    expected = sample(eager, steps=8)
    out = sample(model, steps=8)
    torch.testing.assert_close(out, expected)
    assert not torch.allclose(out, sample(plain, steps=8))
    assert counter.frame_count >= 1


# ----------------------------------------------------------------------------- other overrides

def kjnodes_sage(got):
    """KJNodes' SageAttention patch as it behaves: its override ignores ``func`` and calls
    its kernel (here SDPA that drops masks, as Sage does) with the tensors it is given."""
    from comfy.ldm.modules import attention as comfy_attention

    def attention_override_sage(func, *args, **kwargs):
        got.append(args[1].shape[2])
        return comfy_attention.attention_sage.__wrapped__(*args, **kwargs)
    return attention_override_sage


def attention_backend(got):
    """Core's ModelAttentionBackend (``set_model_optimized_attention``) as it behaves: a lambda
    that drops the fallback and calls the chosen backend."""
    from comfy.ldm.modules import attention as comfy_attention

    def backend(*args, **kwargs):
        got.append(args[1].shape[2])
        return comfy_attention.attention_basic.__wrapped__(*args, **kwargs)
    return lambda _fallback, *args, **kwargs: backend(*args, **kwargs)


@pytest.mark.parametrize("other", [kjnodes_sage, attention_backend])
@pytest.mark.parametrize("order", ["theirs first", "ours first"])
def test_another_override_is_chained_in_either_order(lines, other, order):
    """An override another node writes into the model's options (it ignores the fallback),
    before ours or after ours (on a clone of our clone: the options deep-copied, our wrapper
    carried): ours calls it with the pooled keys every step, the latent is ours alone's, and
    one line says it is chained."""
    got = []
    base = dit_model()
    (alone,) = nodes.ToMePatch().patch(base, **defaults(**REUSE))
    expected = sample(alone, steps=6)
    if order == "theirs first":
        theirs = base.clone()
        theirs.model_options["transformer_options"][override.OVERRIDE] = other(got)
        (model,) = nodes.ToMePatch().patch(theirs, **defaults(**REUSE))
    else:
        model = alone.clone()
        model.model_options["transformer_options"][override.OVERRIDE] = other(got)
    told = len(lines)
    torch.testing.assert_close(sample(model, steps=6), expected, atol=1e-4, rtol=1e-4)
    # 6 steps, cond and uncond, 4 blocks (x4: 2x3 cells); at the refreshes (steps 0, 3) the
    # full keys too
    assert got.count(5 + 2 * 3) == 6 * 2 * 4 and got.count(IMAGE_KEYS["flux"]) == 2 * 2 * 4
    chained = [x for x in lines[told:] if "another attention override is installed" in x]
    assert len(chained) == 1 and chained[0].endswith(
        "; ToMe calls it with the pooled keys and values")
    sample(model, steps=6)
    assert sum("another attention override" in x for x in lines) == 1


# ----------------------------------------------------------------------------- block-sparse

WIDE = {"hidden_size": 128, "num_heads": 1, "axes_dim": (16, 56, 56)}  # head dim 128


@pytest.mark.parametrize("order", ["sparse first", "ours first"])
def test_block_sparse_attention_takes_its_calls_whole(lines, monkeypatch, order):
    """Current ComfyUI's BlockSparseAttention (head dim 128; its window from 0.4, sigma
    0.826: steps 2 and 3 of 1.0, 0.905, 0.760, 0.513; block 1 of each kind dense) before or
    after ours (it re-installs its override every step, so ours always chains it): the calls
    it takes get the full keys (pooled keys make it decline); the calls it declines (outside
    its window, its dense blocks) are pooled; one line says so once; the tally counts them."""
    nodes_sparse_attention.TAKEN.clear()
    base = dit_model(**WIDE)
    config = defaults(method="downsample", policy="fixed", schedule="all:2")

    def sparse(m):
        return nodes_sparse_attention.apply_block_sparse_attention(
            m, start_percent=0.4, min_tokens=0, dense_blocks={1})

    if order == "sparse first":
        (model,) = nodes.ToMePatch().patch(sparse(base), **config)
    else:
        model = sparse(nodes.ToMePatch().patch(base, **config)[0])
    seen = spy(monkeypatch)
    told = len(lines)
    out = sample(model, steps=4)
    whole, pooled = 5 + 8 * 12, 5 + 4 * 6
    taken = nodes_sparse_attention.TAKEN
    # steps 2 and 3 (sigma below its start), cond and uncond, block 0 double and single
    assert len(taken) == 2 * 2 * 2 and {k[2] for _, k in taken} == {whole}
    assert seen.count((seen[0][0], pooled)) == 2 * 4  # step 0: every block pooled
    assert len(seen) == 4 * 2 * 4 - len(taken) and {n for _, n in seen} == {pooled}
    said = lines[told:]
    assert sum("ComfyUI's block-sparse attention takes are left to it unpooled" in x
               for x in said) == 1
    assert said[-1].startswith("ToMe: pooled 24 of 32 attention calls; the rest: ")
    assert "left whole to the chained sparse attention 8" in said[-1]
    assert torch.isfinite(out).all()


def test_block_sparse_attention_is_recognised_by_its_override_object():
    """``host.sparse_patch`` knows the sparse node's override by its module and the settings
    object it holds, not by a name it guesses: another override is not taken for it."""
    base = dit_model()
    m = nodes_sparse_attention.apply_block_sparse_attention(base)
    fn = m.model_options["transformer_options"][override.OVERRIDE]
    assert host.sparse_patch(fn) is not None
    assert host.sparse_patch(kjnodes_sage([])) is None
    assert host.sparse_patch(lambda func, *a, **k: func(*a, **k)) is None
