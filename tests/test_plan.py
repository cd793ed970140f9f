"""The plan module (``tome/plan.py``) and the GPU-first properties of the merge path, checked
on the CPU: determinism without atomics, few dispatched ops, one plan per level, counter-based
destinations, coexistence with attention-map users, and random settings (property-based). The
auto policy's tests are in ``test_policy.py``."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import TINY_SD15, diffusers_unet, ldm_inputs, ldm_unet
from torch.utils._python_dispatch import TorchDispatchMode

import tome
from tome import merge, plan
from tome.config import ToMeConfig
from tome.layout import auto_level

# Ops that accumulate with atomics on CUDA (non-deterministic, see the PyTorch docs of
# torch.use_deterministic_algorithms), or that sum floats in a scheduling-dependent order.
ATOMIC = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce",
          "scatter_reduce_", "index_reduce", "index_reduce_", "_index_put_impl_", "put_",
          "bincount", "embedding_bag", "_segment_reduce"}


class Ops(TorchDispatchMode):
    """Counts every ATen op dispatched (each one a kernel launch or a view on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops[func.overloadpacket.__name__] += 1
        self.calls.append((func.overloadpacket.__name__, args, kwargs))
        return func(*args, **kwargs)


def _count(unet, inputs):
    with Ops() as m:
        unet(*inputs)
    return m


def _cumsum_dtypes(calls):
    return {args[0].dtype for name, args, _ in calls if name.startswith("cumsum")}


# ------------------------------------------------------------------------- GPU-first proxies

@pytest.mark.parametrize("kw", [{}, {"matching": "local"}, {"method": "downsample"},
                                {"share": "block"}, {"use_rand": False}])
def test_no_atomic_accumulation_in_the_forward(sd15, inputs, kw):
    tome.apply_patch(sd15, ratio=0.5, **kw)
    try:
        m = _count(sd15, inputs)
    finally:
        tome.remove_patch(sd15)
    assert not ATOMIC & set(m.ops), sorted(ATOMIC & set(m.ops))
    accumulating = [n for n, a, k in m.calls if n.startswith("index_put")
                    and (k.get("accumulate") or (len(a) > 3 and a[3]))]
    assert not accumulating
    # Float prefix sums are scheduling-dependent on CUDA: only integer scans are allowed.
    assert _cumsum_dtypes(m.calls) <= {torch.int64}


def test_dispatched_ops_per_merged_block(sd15, inputs):
    """A CPU proxy of per-block GPU overhead (kernel launches and views). The amortised figure
    is what a block costs beyond the unpatched forward, plan building included."""
    base = sum(_count(sd15, inputs).ops.values())
    per_block = {}
    for name, kw in {"merge": {}, "downsample": {"method": "downsample"},
                     "merge per block": {"share": "block"}}.items():
        tome.apply_patch(sd15, ratio=0.5, **kw)
        try:
            extra = sum(_count(sd15, inputs).ops.values()) - base
            per_block[name] = extra / tome.patch_report(sd15).patched_blocks
        finally:
            tome.remove_patch(sd15)
    # Was 64 (merge) and 173 (local) per block before plans were shared and built on-device;
    # now 17 per block for merge and unmerge plus the amortised plans (two at this level:
    # encoder and decoder): 48. The target of 20 is not met: see docs/speed.md.
    assert per_block["merge"] <= 50, per_block
    assert per_block["downsample"] <= 6, per_block
    assert per_block["merge"] < 0.6 * per_block["merge per block"], per_block


def test_same_input_same_bits_and_order_independent_sum():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24 * 24, 16, generator=g)
    src, dst = merge.partition(24, 24, 2, 2, merge.hashed_cells(24, 24, 2, 2, 7, 500.0, "cpu"))
    p = merge.Plan(x, src, dst, 24 * 12)
    y = torch.randn(2, 24 * 24, 16, generator=g)
    a = p.merge(y)
    # Summing the sources in any order gives the same bits: reverse each segment's order.
    q = merge.Plan(x, src, dst, 24 * 12)
    q.src_rows = torch.cat([q.src_rows[:1]] + [seg.flip(0) for seg in torch.split(
        q.src_rows[1:], (q.ends - q.starts).tolist())])
    assert torch.equal(a, q.merge(y))
    assert torch.equal(a, p.merge(y.clone()))


def test_hashed_cells_are_a_pure_function_of_seed_timestep_and_cell():
    f = merge.hashed_cells
    a = f(16, 24, 2, 2, 1, torch.tensor([500.0, 500.0]), "cpu")
    assert a.shape == (8, 12) and a.dtype == torch.int64
    assert torch.equal(a, f(16, 24, 2, 2, 1, 500.0, "cpu"))        # tensor or number
    assert torch.equal(a, f(16, 24, 2, 2, 1, torch.tensor(500.0), "cpu"))
    assert not torch.equal(a, f(16, 24, 2, 2, 1, 499.0, "cpu"))    # timestep matters
    assert not torch.equal(a, f(16, 24, 2, 2, 2, 500.0, "cpu"))    # seed matters
    counts = torch.bincount(f(64, 64, 2, 2, 3, 10.0, "cpu").reshape(-1), minlength=4)
    assert counts.min() > 0.2 * counts.sum()                       # every position is used
    state = torch.random.get_rng_state()
    f(8, 8, 3, 2, 5, None, "cpu")
    assert torch.equal(state, torch.random.get_rng_state())         # global RNG untouched


def test_one_plan_per_level_side_and_call(sd15, inputs, monkeypatch):
    built = []
    real = merge.Plan.__init__

    def spy(self, *a, **k):
        built.append(a[0].shape)
        real(self, *a, **k)

    monkeypatch.setattr(merge.Plan, "__init__", spy)
    # SD1.5's full-resolution level: 2 encoder blocks share one plan, 3 decoder blocks another.
    for share, expected in (("level", 2), ("block", 5)):
        built.clear()
        tome.apply_patch(sd15, ratio=0.5, share=share)
        try:
            out = sd15(*inputs)
        finally:
            tome.remove_patch(sd15)
        assert len(built) == expected, (share, built)
        assert torch.isfinite(out).all()


def test_level_sharing_changes_the_image_little(sd15, inputs):
    base = sd15(*inputs)
    dev = {}
    for share in ("level", "block"):
        tome.apply_patch(sd15, ratio=0.5, share=share)
        try:
            dev[share] = float((sd15(*inputs) - base).abs().mean() / base.abs().mean())
        finally:
            tome.remove_patch(sd15)
    assert 0 < dev["level"] < 2 * dev["block"], dev


# ------------------------------------------------------------------------- other patchers

def test_attn1_replaced_on_the_instance_is_skipped(inputs):
    """Self-Attention Guidance (A1111 extension) swaps the middle block's attn1.forward to
    record its attention map; merging there would break its reshape."""
    unet = ldm_unet(TINY_SD15)
    mid = [m for m in unet.middle_block.modules() if type(m).__name__ == "BasicTransformerBlock"]
    attn = mid[0].attn1
    attn.forward = attn.forward  # an instance-level override, as SAG does
    with pytest.warns(UserWarning, match="skipped 1 of 16 block"):
        tome.apply_patch(unet, ratio=0.5, max_downsample=8)
    report = tome.patch_report(unet)
    assert any("Self-Attention Guidance" in why for _, why in report.skipped)
    assert report.patched_blocks == report.total_blocks - 1
    out = unet(*inputs)
    tome.remove_patch(unet)
    assert torch.isfinite(out).all()


# ------------------------------------------------------------------------- random settings

def test_grid_smaller_than_one_cell_is_skipped():
    """ratio 0.75, 4x1 stride, max_downsample 8, 192x192 px (24x24 latent): the deepest
    level is 3x3 tokens, narrower than one 4-wide cell. Used to raise IndexError."""
    unet = ldm_unet(TINY_SD15)
    x, t, c = ldm_inputs(1, 24, 24)
    tome.apply_patch(unet, ratio=0.75, sx=4, sy=1, max_downsample=8)
    out = unet(x, t, c)
    tome.remove_patch(unet)
    assert out.shape == x.shape and torch.isfinite(out).all()


_UNET = None


def _unet():
    """A diffusers UNet: it takes any latent size (ldm's needs sizes its levels halve evenly)."""
    global _UNET
    if _UNET is None:
        _UNET = diffusers_unet("sd15")
    return lambda x, t, c: _UNET(x, t, c).sample, _UNET


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(ratio=st.floats(-0.2, 1.0), sx=st.integers(0, 5), sy=st.integers(1, 5),
       max_ds=st.sampled_from([None, 1, 2, 4, 8, 3]), method=st.sampled_from(
           ["merge", "downsample"]), matching=st.sampled_from(["global", "local"]),
       share=st.sampled_from(["level", "block"]), factor=st.integers(1, 5),
       batch=st.integers(1, 3), h=st.integers(3, 26), w=st.integers(3, 26),
       use_rand=st.booleans())
def test_random_settings_either_fail_cleanly_or_run(ratio, sx, sy, max_ds, method, matching,
                                                    share, factor, batch, h, w, use_rand):
    run, unet = _unet()
    x, t, c = ldm_inputs(batch, h, w)
    kw = dict(ratio=ratio, sx=sx, sy=sy, max_downsample=max_ds, method=method,
              matching=matching, share=share, downsample_factor=factor, use_rand=use_rand)
    try:
        cfg = ToMeConfig(**kw)
    except ValueError as e:
        assert str(e).startswith("ToMe: invalid")
        with pytest.raises(ValueError):
            tome.apply_patch(unet, **kw)
        assert not tome.is_patched(unet)
        return
    base = run(x, t, c)
    tome.apply_patch(unet, config=cfg)
    try:
        out = run(x, t, c)
        assert out.shape == x.shape and torch.isfinite(out).all()
        # Each image of a batch is the image alone.
        torch.testing.assert_close(run(x[:1], t[:1], c[:1]), out[:1], rtol=0, atol=1e-5)
    finally:
        tome.remove_patch(unet)
    assert torch.equal(run(x, t, c), base)  # removal is exact


def test_grid_of_and_auto_level():
    assert plan.grid_of(4096, (64, 64), 1) == (1, 64, 64)
    assert plan.grid_of(1024, (64, 64), 1) is None
    assert plan.grid_of(1024, (64, 64), 2) == (2, 32, 32)
    assert auto_level(None, [2, 4]) == 2
    assert auto_level(4, [1]) == 4


def test_a_grid_has_frames_and_an_image_is_one():
    """A call's grid is (frames, height, width): a video DiT's blocks see ``frames`` grids of
    ``h x w`` tokens; an image's (height, width) is one frame, planned as before."""
    from tome import dit
    assert plan.grid_of(3 * 4096, (3, 64, 64), 1) == (1, 64, 64)
    assert plan.grid_of(3 * 1024, (3, 64, 64), 2) == (2, 32, 32)
    assert plan.grid_of(4096, (3, 64, 64), 2) is None     # not frames whole grids
    assert plan.grid_of(2 * 1024, (2, 64, 64), 1) is None  # ds2: deeper than allowed
    cfg = ToMeConfig(method="downsample")
    planner = plan.Planner(cfg, 2, levels=[2], method=dit.method_for(cfg))
    for size in ((8, 12), (1, 8, 12)):
        call = planner.begin(size, torch.device("cpu"), None)
        assert call.size == planner.size == (1, 8, 12) and call.frames == 1
    call = planner.begin((3, 8, 12), torch.device("cpu"), None, 2)
    assert (call.size, call.frames, planner.size) == ((3, 8, 12), 3, (3, 8, 12))
    p = planner.plan(call, torch.zeros(2, 3 * 4 * 6, 1))
    assert (p.grid, p.factor, p.temporal) == ((3, 4, 6), 2, 1)
    assert planner.plan(call, torch.zeros(2, 3 * 4 * 6, 1)) is p  # one per call
    assert planner.tokens[2] == (72, 72 - 3 * 2 * 3)
    assert planner.plan(call, torch.zeros(2, 4 * 6, 1)) is None  # one frame's tokens: no grid


def test_attn1_replaced_after_patching_runs_unmerged(inputs):
    """SAG's "dynamic" target swaps attn1.forward during sampling, after the patch: that
    block must then see every token, once, with a warning, and the others still merge."""
    unet = ldm_unet(TINY_SD15)
    tome.apply_patch(unet, ratio=0.5)
    blocks = [m for m in unet.modules() if type(m).__name__ == "BasicTransformerBlock"]
    attn = blocks[0].attn1
    seen = []
    original = attn.forward

    def recording(x, context=None, mask=None):
        seen.append(x.shape[1])
        return original(x, context, mask)

    attn.forward = recording
    with pytest.warns(UserWarning, match="Self-Attention Guidance"):
        out = unet(*inputs)
    tome.remove_patch(unet)
    assert seen == [32 * 32] and torch.isfinite(out).all()


def test_a_sigma_window_keeps_a_step_on_its_edge():
    """Flux's shifted schedule at 4 steps puts a step exactly on the 0.5 edge; the host hands
    it as float32 while its percent_to_sigma answers in float64 (the real ComfyUI printed
    "merged in 1 of 4 steps" for start 0.5)."""
    import math

    from tome.plan import Window

    def flux_sigma(t: float, shift: float = 1.15) -> float:  # ComfyUI's flux_time_shift
        return math.exp(shift) / (math.exp(shift) + (1 / t - 1)) if t > 0 else 0.0

    sigmas = torch.tensor([flux_sigma(1 - i / 4) for i in range(4)] + [0.0])  # float32
    assert float(sigmas[2]) > flux_sigma(0.5)  # the rounding that dropped it
    assert Window.sigmas(0.5, 1.0, lambda p: flux_sigma(1 - p)).count(sigmas) == (2, 4)
    assert Window.sigmas(0.0, 0.5, lambda p: flux_sigma(1 - p)).count(sigmas) == (3, 4)
    assert Window.sigmas(0.0, 0.25, lambda p: flux_sigma(1 - p)).count(sigmas) == (2, 4)
