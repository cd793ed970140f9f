"""DiT key/value pooling (``tome/dit.py``) and the diffusers adapter (``tome/processors.py``) on
real diffusers Flux and SD3 transformers built from tiny configs with random weights."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn.functional as F
from models import randomised, snapshot
from stubs import compiles_like_eager, fake_clock
from torch.utils._python_dispatch import TorchDispatchMode

import tome
from tome import dit, layout, measure, memory, processors, wrappers
from tome.config import ToMeConfig
from tome.dits import sd3 as sd3_family
from tome.measurements import MeasurementCache, Measurer

diffusers = pytest.importorskip("diffusers")
H, W, T = 8, 12, 5   # image token grid and text length of the tiny calls


def _randomise(model):
    return randomised(model)


@pytest.fixture(scope="module")
def flux():
    return _randomise(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24,
        axes_dims_rope=(4, 6, 6)))


@pytest.fixture(scope="module")
def sd3():
    return _randomise(diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
        pooled_projection_dim=24, out_channels=4, pos_embed_max_size=32,
        dual_attention_layers=(0,), qk_norm="rms_norm"))


def _ids(h=H, w=W):
    ids = torch.zeros(h * w, 3)
    ids[:, 1] = torch.arange(h).repeat_interleave(w)
    ids[:, 2] = torch.arange(w).repeat(h)
    return ids


def flux_inputs(seed=0, t=0.7):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, H * W, 16, generator=g),
                encoder_hidden_states=torch.randn(2, T, 32, generator=g),
                pooled_projections=torch.randn(2, 24, generator=g),
                timestep=torch.full((2,), t), img_ids=_ids(), txt_ids=torch.zeros(T, 3))


def sd3_inputs(seed=0, t=500.0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, 4, 2 * H, 2 * W, generator=g),
                encoder_hidden_states=torch.randn(2, T, 32, generator=g),
                pooled_projections=torch.randn(2, 24, generator=g), timestep=torch.full((2,), t))


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


# ----------------------------------------------------------------------------- pooling

def _reference_pool(x, start, h, w, f):
    """Cell means by explicit loops over [B, S, C] (sequence dim 1)."""
    img = x[:, start:start + h * w].reshape(x.shape[0], h, w, -1)
    cells = [img[:, i:i + f, j:j + f].mean((1, 2)) for i in range(0, h, f) for j in range(0, w, f)]
    return torch.cat([x[:, :start], torch.stack(cells, 1), x[:, start + h * w:]], 1)


@pytest.mark.parametrize("h,w,f", [(8, 12, 2), (7, 5, 2), (8, 12, 4), (9, 9, 3), (4, 4, 1)])
def test_pool_span_is_the_cell_mean_and_keeps_the_rest(h, w, f):
    x = torch.randn(2, 3 + h * w + 2, 6)
    out = dit.pool_span(x, 3, h, w, f, dim=1)
    assert out.shape[1] == 3 + dit.pooled_tokens(h, w, f) + 2
    torch.testing.assert_close(out, _reference_pool(x, 3, h, w, f))
    # heads-first layout [B, heads, S, D], the sequence at dim 2
    xh = x.reshape(2, x.shape[1], 2, 3).transpose(1, 2)
    outh = dit.pool_span(xh, 3, h, w, f, dim=2)
    torch.testing.assert_close(outh.transpose(1, 2).reshape(2, -1, 6), out)


@pytest.mark.parametrize("f", [2, 4])
def test_pooled_positions_are_the_cells_mean_positions(flux, f):
    """The normalised mean of a cell's rotations is the rotation by the mean position."""
    ids = torch.cat([torch.zeros(T, 3), _ids()])
    cos, sin = flux.pos_embed(ids)
    pc, ps = dit.pool_cos_sin(cos, sin, T, H, W, f)
    mean_ids = dit.pool_span(ids[None], T, H, W, f, dim=1)[0]
    ec, es = flux.pos_embed(mean_ids)
    torch.testing.assert_close(pc, ec, atol=1e-5, rtol=0)
    torch.testing.assert_close(ps, es, atol=1e-5, rtol=0)
    # ComfyUI's form: rotation matrices [..., S, D/2, 2, 2]
    mats = torch.stack([cos[:, ::2], -sin[:, ::2], sin[:, ::2], cos[:, ::2]], -1)
    pooled = dit.pool_rotations(mats.reshape(1, 1, -1, cos.shape[1] // 2, 2, 2), T, H, W, f)
    torch.testing.assert_close(pooled[0, 0, ..., 0, 0], ec[:, ::2], atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled[0, 0, ..., 1, 0], es[:, ::2], atol=1e-5, rtol=0)


def _rotate(x, cos, sin):
    """RoPE by hand on interleaved pairs: (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2)


@pytest.mark.parametrize("rope", ["before", "pooled", None])
def test_joint_attention_matches_a_hand_written_reference(flux, rope):
    """A Flux double block's attention with pooled image keys/values, against the maths
    written out: projections, RMS norms, [text, image], rotation, pooled K/V, softmax."""
    attn, f = flux.transformer_blocks[0].attn, 2
    g = torch.Generator().manual_seed(1)
    hs, ehs = torch.randn(2, H * W, 32, generator=g), torch.randn(2, T, 32, generator=g)
    emb = flux.pos_embed(torch.cat([torch.zeros(T, 3), _ids()])) if rope else None
    plan = dit.DitPlan(H, W, f, rope or "pooled")
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(plan, T))
    with torch.no_grad():
        out, ctx_out = wrapper(attn, hs, ehs, None, emb)

        def heads(x):
            return x.reshape(2, -1, attn.heads, attn.head_dim)
        q = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(ehs))),
                       attn.norm_q(heads(attn.to_q(hs)))], 1)
        k = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(ehs))),
                       attn.norm_k(heads(attn.to_k(hs)))], 1)
        v = torch.cat([heads(attn.add_v_proj(ehs)), heads(attn.to_v(hs))], 1)
        if rope:
            cos, sin = (e[None, :, None] for e in emb)
            q = _rotate(q, cos, sin)
            if rope == "before":
                k = _rotate(k, cos, sin)
        kp = _reference_pool(k.flatten(2), T, H, W, f)
        vp = _reference_pool(v.flatten(2), T, H, W, f)
        kp, vp = heads(kp), heads(vp)
        if rope == "pooled":
            pc, ps = (_reference_pool(e[None], T, H, W, f)[0] for e in emb)
            r = torch.sqrt(pc ** 2 + ps ** 2)
            kp = _rotate(kp, (pc / r)[None, :, None], (ps / r)[None, :, None])
        assert kp.shape[1] == T + (H // f) * (W // f)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kp) / math.sqrt(attn.head_dim)
        ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vp).flatten(2)
        ref_out = attn.to_out[0](ref[:, T:])
        ref_ctx = attn.to_add_out(ref[:, :T])
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ctx_out, ref_ctx, atol=1e-5, rtol=1e-4)


def test_pooling_by_one_reproduces_the_diffusers_processors_exactly(flux, sd3):
    """The pooled path is diffusers' own maths: with factor 1 it gives the same bits."""
    for model, inputs in ((flux, flux_inputs()), (sd3, sd3_inputs())):
        ref = run(model, inputs)
        tome.apply_patch(model, method="downsample", downsample_factor=1)
        try:
            assert torch.equal(run(model, inputs), ref)
            assert tome.patch_report(model).planner.tokens  # the pooled path ran
        finally:
            tome.remove_patch(model)


# ----------------------------------------------------------------------------- the adapter

@pytest.mark.parametrize("rope", ["before", "pooled"])
def test_flux_pools_and_removal_is_bit_exact(flux, rope):
    inputs = flux_inputs()
    ref = run(flux, inputs)
    modules = dict(flux.named_modules())
    tome.apply_patch(flux, method="downsample", downsample_factor=2, rope=rope)
    report = tome.patch_report(flux)
    assert report.kind == "DiT" and report.patched_blocks == 4
    assert "diffusers flux DiT" in report.summary()
    out = run(flux, inputs)
    assert not torch.equal(out, ref) and torch.isfinite(out).all()
    assert report.tokens == {2: (H * W, H * W - (H // 2) * (W // 2))}
    assert torch.equal(run(flux, inputs), out)  # same inputs, same bits
    tome.remove_patch(flux)
    assert not tome.is_patched(flux)
    assert torch.equal(run(flux, inputs), ref)
    assert dict(flux.named_modules()).keys() == modules.keys()
    assert all(type(b.attn.processor).__name__ == "FluxAttnProcessor"
               for b in [*flux.transformer_blocks, *flux.single_transformer_blocks])


def test_sd3_pools_including_the_dual_attention_and_removal_is_bit_exact(sd3):
    inputs = sd3_inputs()
    ref = run(sd3, inputs)
    tome.apply_patch(sd3, method="downsample", downsample_factor=2)
    assert isinstance(sd3.transformer_blocks[0].attn2.processor, processors.PoolingProcessor)
    out = run(sd3, inputs)
    assert not torch.equal(out, ref) and torch.isfinite(out).all()
    tome.remove_patch(sd3)
    assert torch.equal(run(sd3, inputs), ref)


def test_a_pipeline_is_patched_through_its_transformer(flux):
    class Pipe:
        transformer = flux
    pipe = Pipe()
    tome.apply_patch(pipe, method="downsample")
    assert tome.is_patched(pipe) and tome.is_patched(flux)
    tome.remove_patch(pipe)
    assert not tome.is_patched(flux)


def test_blocks_setting_picks_the_blocks(flux):
    for blocks, wrapped in (("double", [0, 1]), ("1-2", [1, 2]), ("3", [3]),
                            ("all", [0, 1, 2, 3])):
        tome.apply_patch(flux, method="downsample", blocks=blocks)
        attns = [b.attn for b in [*flux.transformer_blocks, *flux.single_transformer_blocks]]
        got = [i for i, a in enumerate(attns)
               if isinstance(a.processor, processors.PoolingProcessor)]
        assert got == wrapped, blocks
        tome.remove_patch(flux)
    with pytest.raises(ValueError, match="blocks"):
        ToMeConfig(method="downsample", blocks="first")
    report = processors.apply(flux, layout.read(flux),
                              ToMeConfig(method="downsample", blocks="9-12"))
    try:
        assert report.nothing and "names no block" in report.nothing
    finally:
        tome.remove_patch(flux)


@pytest.mark.parametrize("settings, named", [
    ({"blocks": "9-12"}, "blocks='9-12'"),
    ({"schedule": "7:4,single:2@0.5-1"}, "schedule='7:4,single:2@0.5-1'"),
])
def test_settings_naming_no_block_install_nothing_and_say_so(sd3, settings, named):
    """SD3 has two joint blocks: ``9-12`` or a schedule of block 7 and single-stream blocks
    names none of them. As settings that change nothing: no patch, the model bit-identical
    (an earlier patch removed), and the report and warning say why."""
    ref, before = run(sd3, sd3_inputs()), snapshot(sd3)
    tome.apply_patch(sd3, method="downsample")  # an earlier patch: replaced
    expected = f"ToMe: {named} names no block of this DiT (it has blocks 0-1, double-stream " \
               "first); nothing is pooled"
    with pytest.warns(UserWarning, match=re.escape(expected)):
        tome.apply_patch(sd3, method="downsample", **settings)
    assert not tome.is_patched(sd3) and snapshot(sd3) == before
    assert torch.equal(run(sd3, sd3_inputs()), ref)
    report = processors.apply(sd3, layout.read(sd3), ToMeConfig(method="downsample", **settings))
    assert report.nothing == expected and not tome.is_patched(sd3)
    assert snapshot(sd3) == before


def test_steps_outside_the_window_run_the_original_processors(flux):
    late, early = flux_inputs(t=0.2), flux_inputs(t=0.9)  # Flux timesteps: 1 = noisiest
    refs = run(flux, late), run(flux, early)
    tome.apply_patch(flux, method="downsample", start=0.0, end=0.5)
    try:
        assert torch.equal(run(flux, late), refs[0])        # progress 0.8: outside
        assert not torch.equal(run(flux, early), refs[1])   # progress 0.1: pooled
    finally:
        tome.remove_patch(flux)


def test_a_foreign_processor_leaves_its_block_unpooled_and_reported(flux):
    class Custom(diffusers.models.transformers.transformer_flux.FluxAttnProcessor):
        pass
    block = flux.single_transformer_blocks[1]
    original = block.attn.processor
    block.attn.processor = Custom()
    try:
        tome.apply_patch(flux, method="downsample")
        report = tome.patch_report(flux)
        assert report.patched_blocks == 3 and "Custom" in report.skipped[0][1]
        assert isinstance(block.attn.processor, Custom)
        tome.remove_patch(flux)
    finally:
        block.attn.processor = original


def test_merge_has_no_dit_form_and_other_dits_are_named():
    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16)
    with pytest.warns(UserWarning, match="merge has no DiT form"):
        tome.apply_patch(model, ratio=0.5)
    assert not tome.is_patched(model)  # nothing installed, as for settings that change nothing

    class QwenLike(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer_blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    with pytest.raises(tome.UnsupportedModelError, match="QwenLike.*reads: diffusers flux, sd3"):
        tome.apply_patch(QwenLike(), method="downsample")


def test_bad_settings_fail_before_anything_changes(flux):
    with pytest.raises(ValueError, match="rope"):
        tome.apply_patch(flux, method="downsample", rope="sideways")
    assert not tome.is_patched(flux)
    assert all(type(b.attn.processor).__name__ == "FluxAttnProcessor"
               for b in flux.transformer_blocks)


# ----------------------------------------------------------------------------- GPU proxies

class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_pooling_adds_few_ops_and_no_host_sync(flux):
    """One Flux double-block attention: pooled against the original processor, counted with a
    TorchDispatchMode: a handful of extra ops (pooling two tensors), none reading back."""
    attn = flux.transformer_blocks[0].attn
    emb = flux.pos_embed(torch.cat([torch.zeros(T, 3), _ids()]))
    hs, ehs = torch.randn(2, H * W, 32), torch.randn(2, T, 32)
    counts = {}
    for rope in ("before", "pooled"):
        wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(
            dit.DitPlan(H, W, 2, rope), T))
        with torch.no_grad():
            wrapper(attn, hs, ehs, None, emb)  # the call's first block pools the positions
            with _Ops() as mode:
                wrapper(attn, hs, ehs, None, emb)
        counts[rope] = mode.ops
    with torch.no_grad(), _Ops() as base:
        attn.processor(attn, hs, ehs, None, emb)
    for rope, ops in counts.items():
        assert not {"_local_scalar_dense", "item", "nonzero"} & set(ops), rope
        assert not [o for o in ops if "scatter" in o or "index_put" in o], rope
        assert len(ops) - len(base.ops) <= 24, (rope, len(ops), len(base.ops))


def test_pooled_attention_compiles_in_one_graph(flux):
    attn = flux.transformer_blocks[0].attn
    emb = flux.pos_embed(torch.cat([torch.zeros(T, 3), _ids()]))
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(
        dit.DitPlan(H, W, 2, "pooled"), T))
    compiles_like_eager(lambda hs, ehs: wrapper(attn, hs, ehs, None, emb),
                        torch.randn(2, H * W, 32), torch.randn(2, T, 32))


def test_compiled_blocks_keep_one_graph_across_steps(flux):
    """diffusers' regional compilation (each block compiled with fullgraph=True) on a patched
    Flux: the same result as eager, and no recompilation from one step to the next (pooled
    positions are not cached by the embedding's identity while tracing)."""
    model = copy.deepcopy(flux)
    tome.apply_patch(model, method="downsample")
    eager = [run(model, flux_inputs(t=t)) for t in (0.9, 0.5, 0.2)]
    torch._dynamo.reset()
    for block in [*model.transformer_blocks, *model.single_transformer_blocks]:
        block.compile(fullgraph=True, backend="eager")
    out = [run(model, flux_inputs(t=0.9))]
    with torch._dynamo.config.patch(error_on_recompile=True):
        out += [run(model, flux_inputs(t=t)) for t in (0.5, 0.2)]
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


@pytest.mark.parametrize("schedule", ["", "all:2@0.3-1"], ids=["pooled", "window"])
def test_a_compiled_sd3_is_one_graph(sd3, schedule):
    """SD3's grid is the latent's shape, so the whole patched transformer compiles as one
    graph (hooks included) and steps do not recompile; with a step window too (an unpooled
    step, then a pooled one: ``torch.cond`` picks, ``wrappers.switch``; SD3's processor
    returns strided slices of one joint output, which cond takes as dense copies)."""
    model = copy.deepcopy(sd3)
    tome.apply_patch(model, method="downsample", schedule=schedule)
    eager = [run(model, sd3_inputs(t=t)) for t in (900.0, 500.0)]
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = [fn(**sd3_inputs(t=900.0)).sample]
        with torch._dynamo.config.patch(error_on_recompile=True):
            out.append(fn(**sd3_inputs(t=500.0)).sample)
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- auto policy

@pytest.mark.parametrize("speedup,merged", [(1.5, True), (1.01, False)])
def test_auto_policy_measures_a_dit_per_size_and_decides(flux, tmp_path, speedup, merged):
    lines = []
    service = Measurer(MeasurementCache(tmp_path / "m.json", say=lines.append),
                       say=lines.append, clock=fake_clock(speedup), rounds=3)
    inputs = flux_inputs()
    ref = run(flux, inputs)
    tome.apply_patch(flux, method="downsample", policy="auto", measure=service)
    try:
        out = run(flux, inputs)
        report = tome.patch_report(flux)
        (decision,) = report.decisions.values()
        assert decision.merged is merged and f"measured {speedup:.2f}x" in decision.reason
        assert torch.equal(out, ref) is not merged
        assert all(isinstance(b.attn.processor, processors.PoolingProcessor)
                   for b in [*flux.transformer_blocks, *flux.single_transformer_blocks])
        row = service.last.rows[0]
        assert (row.level, row.tokens, row.blocks) == (2, H * W, 4)
        assert any("measured" in line for line in lines)
    finally:
        tome.remove_patch(flux)


def test_measuring_a_dit_times_each_kind_of_block_and_leaves_it_as_it_was(flux):
    cfg = ToMeConfig(method="downsample")
    lay = layout.read(flux)
    calls = []

    def clock(phase, fn):
        calls.append(phase)
        fn()
        return {"unmerged": 2.0, "build": 0.0, "merged": 1.0}[phase]
    ref = run(flux, flux_inputs())
    m = measure.measure(flux, (2 * H, 2 * W), 1, cfg, runner=processors.runner(lay),
                        clock=clock, rounds=3, min_rounds=3)
    (row,) = m.rows
    assert row.blocks == 4 and row.speedup == pytest.approx(2.0)
    assert len(calls) == 2 * 3 * 3  # two kinds (double, single) x rounds x phases
    assert torch.equal(run(flux, flux_inputs()), ref)
    assert all(type(b.attn.processor).__name__ == "FluxAttnProcessor"
               for b in [*flux.transformer_blocks, *flux.single_transformer_blocks])


def test_the_memory_check_sees_the_kernel_under_our_processors(flux):
    """Patched, the blocks' kernel is still named by the processor we wrap (diffusers' SDPA
    dispatch): no score matrix is assumed, so large sizes are measured, not skipped."""
    tome.apply_patch(flux, method="downsample")
    try:
        backend = measure.attention_backend(flux)
    finally:
        tome.remove_patch(flux)
    assert backend == "FluxAttnProcessor dispatch_attention_fn:native"
    assert not memory.full_scores(backend)


def test_dit_threshold_policy_without_measuring(flux):
    cfg = ToMeConfig(method="downsample", policy="auto")
    d = dit.method_for(cfg)
    assert d.thresholds["cuda"] > d.thresholds["cpu"]
    # 8x12 image tokens are far below the CPU threshold: not pooled, output unchanged
    inputs = flux_inputs()
    ref = run(flux, inputs)
    tome.apply_patch(flux, config=cfg, measure=False)
    try:
        assert torch.equal(run(flux, inputs), ref)
        (decision,) = tome.patch_report(flux).decisions.values()
        assert not decision.merged and "threshold" in decision.reason
    finally:
        tome.remove_patch(flux)


def test_sdpa_reference_for_sd3_joint_attention(sd3):
    """SD3's joint attention, [image, text], no rotation: pooled K/V against plain SDPA."""
    attn = sd3.transformer_blocks[1].attn
    g = torch.Generator().manual_seed(2)
    hs, ehs = torch.randn(2, H * W, 16, generator=g), torch.randn(2, T, 16, generator=g)
    plan = dit.DitPlan(H, W, 2, "pooled")
    with torch.no_grad():
        out, ctx = sd3_family.joint(attn, plan, hs, ehs)

        def heads(x):
            return x.view(2, -1, attn.heads, 8).transpose(1, 2)
        q = torch.cat([attn.norm_q(heads(attn.to_q(hs))),
                       attn.norm_added_q(heads(attn.add_q_proj(ehs)))], 2)
        k = torch.cat([attn.norm_k(heads(attn.to_k(hs))),
                       attn.norm_added_k(heads(attn.add_k_proj(ehs)))], 2)
        v = torch.cat([heads(attn.to_v(hs)), heads(attn.add_v_proj(ehs))], 2)
        kp = _reference_pool(k.transpose(1, 2).flatten(2), 0, H, W, 2)
        vp = _reference_pool(v.transpose(1, 2).flatten(2), 0, H, W, 2)
        kp, vp = (x.view(2, -1, attn.heads, 8).transpose(1, 2) for x in (kp, vp))
        ref = F.scaled_dot_product_attention(q, kp, vp).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out, attn.to_out[0](ref[:, :H * W]), atol=1e-5, rtol=1e-4)
    if not attn.context_pre_only:
        torch.testing.assert_close(ctx, attn.to_add_out(ref[:, H * W:]), atol=1e-5, rtol=1e-4)


def test_sd3_proportional_pooled_call_matches_a_hand_written_reference(sd3):
    """SD3's joint attention with the bias: 3x3 cells on the 8x12 grid (the bottom row of
    cells 2 tokens high) averaged by loops, log(cell size) on the cells' scores and 0 on the
    text's, an einsum softmax; the reference with the bias negated is far from the output."""
    model = copy.deepcopy(sd3)
    attn = model.transformer_blocks[1].attn
    for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        if norm is not None:  # unit RMS queries and keys: scores of order 1
            torch.nn.init.ones_(norm.weight)
    g = torch.Generator().manual_seed(4)
    hs, ehs = torch.randn(2, H * W, 16, generator=g), torch.randn(2, T, 16, generator=g)
    plan = dit.DitPlan(H, W, 3, "pooled", True)
    counts = torch.tensor([min(3, H - i) * min(3, W - j) for i in range(0, H, 3)
                           for j in range(0, W, 3)], dtype=torch.float)
    with torch.no_grad():
        out, _ = sd3_family.joint(attn, plan, hs, ehs)

        def reference(sign):
            def heads(x, norm=None):
                x = x.view(2, -1, attn.heads, 8)
                return x if norm is None else norm(x)

            def pooled(x):
                return _reference_pool(x.flatten(2), 0, H, W, 3).view(2, -1, attn.heads, 8)
            q = torch.cat([heads(attn.to_q(hs), attn.norm_q),
                           heads(attn.add_q_proj(ehs), attn.norm_added_q)], 1)
            k = torch.cat([pooled(heads(attn.to_k(hs), attn.norm_k)),
                           heads(attn.add_k_proj(ehs), attn.norm_added_k)], 1)
            v = torch.cat([pooled(heads(attn.to_v(hs))), heads(attn.add_v_proj(ehs))], 1)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(8)
            bias = torch.cat([counts.log() * sign, torch.zeros(T)])
            o = torch.einsum("bhqk,bkhd->bqhd", (scores + bias).softmax(-1), v).flatten(2)
            return attn.to_out[0](o[:, :H * W])
        torch.testing.assert_close(out, reference(1.0), atol=1e-5, rtol=1e-4)
        assert (out - reference(-1.0)).abs().max() > 1e-3


def test_coexists_with_diffusers_cache_hooks(flux):
    """diffusers' own block caching (FirstBlockCache hooks) around the blocks, our processors
    inside them: both work, and removing ours leaves the cached model as it was."""
    config = pytest.importorskip("diffusers").FirstBlockCacheConfig(threshold=0.2)
    inputs = flux_inputs()
    ref = run(flux, inputs)
    flux.enable_cache(config)
    try:
        with flux.cache_context("before"):
            cached = run(flux, inputs)
        tome.apply_patch(flux, method="downsample")
        with flux.cache_context("pooled"):
            pooled = run(flux, inputs)
        tome.remove_patch(flux)
        with flux.cache_context("after"):
            after = run(flux, inputs)
    finally:
        flux.disable_cache()
    assert torch.equal(cached, ref) and not torch.equal(pooled, ref)
    assert torch.equal(after, cached) and torch.equal(run(flux, inputs), ref)


# ----------------------------------------------------------------------------- A1111's SD3

def test_a1111_sd3_mmdit_pools_through_pre_attention_and_removal_is_exact(monkeypatch):
    import mmdit_stub
    torch.manual_seed(0)
    model = mmdit_stub.MMDiT().eval()
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(2, 4, 16, 24, generator=g), torch.randn(2, 7, 12, generator=g)
    t = torch.full((2,), 600.0)
    with torch.no_grad():
        ref = model(x, t, context=ctx)
    keys = []
    attention = mmdit_stub.attention
    monkeypatch.setattr(mmdit_stub, "attention", lambda q, k, v, heads: (
        keys.append(k.shape[1]), attention(q, k, v, heads))[1])
    tome.apply_patch(model, method="downsample")
    report = tome.patch_report(model)
    assert report.summary().startswith("ToMe: a1111 sd3 DiT, downsample x2; 2/2 blocks pooled")
    with torch.no_grad():
        out = model(x, t, context=ctx)
    assert not torch.equal(out, ref) and keys == [7 + 4 * 6] * 2
    tome.remove_patch(model)
    assert "pre_attention" not in vars(model.joint_blocks[0].x_block.attn)
    with torch.no_grad():
        assert torch.equal(model(x, t, context=ctx), ref)
    tome.apply_patch(model, method="downsample", start=0.5)  # t=600: progress 0.4, outside
    with torch.no_grad():
        assert torch.equal(model(x, t, context=ctx), ref)
    tome.remove_patch(model)


def _mmdit_reference(model, x, t, ctx, f, sign=1.0):
    """The stand-in MMDiT's forward written out with each joint block's image keys/values
    pooled: the host's own pre-/post-attention (the class methods, past any shadow), the
    image keys and values averaged per f x f cell by loops (``_reference_pool``; partial edge
    cells), ``sign * log(cell size)`` on the cells' scores, text keys whole with 0, an einsum
    softmax over [text, image cells]."""
    import mmdit_stub
    b, _, hh, ww = x.shape
    h, w = hh // model.patch, ww // model.patch
    tokens = model.x_embedder(x)
    c = model.t_embedder(t.float()[:, None] / 1000)
    context = model.context_embedder(ctx)
    counts = torch.tensor([min(f, h - i) * min(f, w - j) for i in range(0, h, f)
                           for j in range(0, w, f)], dtype=torch.float)
    for block in model.joint_blocks:
        cb, xb = block.context_block, block.x_block
        (cq, ck, cv), c_res = mmdit_stub.DismantledBlock.pre_attention(cb, context, c)
        (xq, xk, xv), x_res = mmdit_stub.DismantledBlock.pre_attention(xb, tokens, c)
        cv, xv = cv.flatten(2), xv.flatten(2)  # handed as [B, S, heads, D], as A1111's
        xk, xv = _reference_pool(xk, 0, h, w, f), _reference_pool(xv, 0, h, w, f)
        heads = xb.attn.num_heads

        def split(y, heads=heads):
            return y.unflatten(-1, (heads, -1))
        q, k, v = (split(torch.cat(p, 1)) for p in ((cq, xq), (ck, xk), (cv, xv)))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        bias = torch.cat([torch.zeros(ck.shape[1]), counts.log() * sign])
        out = torch.einsum("bhqk,bkhd->bqhd", (scores + bias).softmax(-1), v).flatten(2)
        n = context.shape[1]
        context = c_res + mmdit_stub.SelfAttention.post_attention(cb.attn, out[:, :n])
        tokens = x_res + mmdit_stub.SelfAttention.post_attention(xb.attn, out[:, n:])
    out = model.final_layer(tokens).view(b, h, w, model.channels, model.patch, model.patch)
    return out.permute(0, 3, 1, 4, 2, 5).reshape(b, model.channels, hh, ww)


@pytest.mark.parametrize("f", [2, 3])
def test_a1111_sd3_pooled_forward_matches_a_hand_written_reference(f):
    """A1111's SD3 through the pre-/post-attention shadows (the bias on an extra channel:
    its kernel takes no mask) against the forward written out (``_mmdit_reference``) on a
    9x11 token grid (partial edge cells); the reference with the bias negated is far from
    it."""
    import mmdit_stub
    torch.manual_seed(0)
    model = mmdit_stub.MMDiT().eval()
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 4, 18, 22, generator=g), torch.randn(2, 7, 12, generator=g)
    t = torch.full((2,), 600.0)
    tome.apply_patch(model, method="downsample", downsample_factor=f, proportional=True,
                     policy="fixed")
    try:
        with torch.no_grad():
            out = model(x, t, context=ctx)
            ref = _mmdit_reference(model, x, t, ctx, f)
            torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
            assert (out - _mmdit_reference(model, x, t, ctx, f, sign=-1.0)).abs().max() > 1e-3
    finally:
        tome.remove_patch(model)


def test_a1111_sd3_auto_policy_measures_its_blocks(tmp_path):
    import mmdit_stub
    model = mmdit_stub.MMDiT().eval()
    service = Measurer(MeasurementCache(tmp_path / "m.json", say=print), say=print,
                       clock=fake_clock(2.0), rounds=3)
    tome.apply_patch(model, method="downsample", policy="auto", measure=service)
    try:
        with torch.no_grad():
            model(torch.randn(1, 4, 16, 16), torch.full((1,), 500.0),
                  context=torch.randn(1, 7, 12))
        (decision,) = tome.patch_report(model).decisions.values()
        assert decision.merged and "measured 2.00x" in decision.reason
    finally:
        tome.remove_patch(model)


def test_a_flux_attention_older_than_the_maths_stays_unpooled(flux, monkeypatch):
    """diffusers before 0.35 (SD.Next pins 0.33.1) lays Flux attention out otherwise: seen in
    the real SD.Next as HTTP 500 ``'Attention' object has no attribute 'head_dim'``. Its
    blocks are skipped with the reason; the model runs as without ToMe."""
    import diffusers.models.embeddings as emb

    def old_apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
        raise AssertionError("never called")
    monkeypatch.setattr(emb, "apply_rotary_emb", old_apply_rotary_emb)
    ref = run(flux, flux_inputs())
    with pytest.warns(UserWarning, match="predates the one ToMe reproduces"):
        tome.apply_patch(flux, method="downsample")
    try:
        assert torch.equal(run(flux, flux_inputs()), ref)
    finally:
        tome.remove_patch(flux)
