"""diffusers' Wan (video) and Qwen-Image as DiT families (``tome/dits/wan.py``,
``tome/dits/qwen_image.py``) on tiny models built from configs with random weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from models import randomised
from stubs import fake_clock

import tome
from tome import dit, layout, processors, wrappers
from tome.measurements import MeasurementCache, Measurer

diffusers = pytest.importorskip("diffusers")
F_, H, W, T = 3, 8, 12, 5   # latent frames, token grid per frame, text length


def _randomise(model):
    return randomised(model)


@pytest.fixture(scope="module")
def wan():
    return _randomise(diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64))


@pytest.fixture(scope="module")
def qwen():
    return _randomise(diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6)))


def wan_inputs(seed=0, t=700.0, frames=F_, per_token=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 4, frames, 2 * H, 2 * W, generator=g)
    ts = torch.full((2,), t)
    if per_token:  # Wan 2.2 TI2V image-to-video: the first frame is the condition (t = 0)
        ts = torch.full((2, frames * H * W), t)
        ts[:, :H * W] = 0
    return dict(hidden_states=x, timestep=ts,
                encoder_hidden_states=torch.randn(2, 7, 16, generator=g))


def qwen_inputs(seed=0, t=0.7, mask=False, reference=False):
    g = torch.Generator().manual_seed(seed)
    shapes = [[(1, H, W)] + ([(1, 4, 6)] if reference else [])] * 2
    n = H * W + (24 if reference else 0)
    out = dict(hidden_states=torch.randn(2, n, 16, generator=g),
               encoder_hidden_states=torch.randn(2, T, 24, generator=g),
               timestep=torch.full((2,), t), img_shapes=shapes)
    if mask:  # a batch of prompts of different lengths
        out["encoder_hidden_states_mask"] = torch.tensor([[1] * T, [1] * (T - 2) + [0] * 2])
    return out


def run(model, inputs):
    with torch.no_grad():
        return model(**inputs).sample


class _Keys:
    """Counts the key lengths of every attention kernel call (diffusers' native backend and
    ToMe's both end in PyTorch's SDPA)."""

    def __init__(self, monkeypatch):
        self.lengths: list[int] = []
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(query, key, value, *args, **kwargs):
            self.lengths.append(key.shape[-2])
            return real(query, key, value, *args, **kwargs)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


# ----------------------------------------------------------------------------- Wan

def test_wan_is_read_as_a_video_dit(wan):
    lay = layout.read(wan)
    assert lay.family == "diffusers wan" and lay.dit.patch == 2 and lay.dit.rope
    assert [b.name for b in lay.blocks] == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize("rope", ["pooled", "before"])
def test_wan_pools_self_attention_only_and_removal_is_bit_exact(wan, rope, monkeypatch):
    inputs = wan_inputs()
    ref = run(wan, inputs)
    tome.apply_patch(wan, method="downsample", downsample_factor=2, rope=rope)
    try:
        report = tome.patch_report(wan)
        assert report.kind == "DiT" and report.patched_blocks == 2
        assert all(isinstance(b.attn1.processor, processors.PoolingProcessor)
                   and not isinstance(b.attn2.processor, processors.PoolingProcessor)
                   for b in wan.blocks)
        keys = _Keys(monkeypatch)
        out = run(wan, inputs)
        # self-attention: 3 frames of 4x6 pooled keys; cross-attention: the 7 text tokens
        assert keys.lengths == [F_ * (H // 2) * (W // 2), 7] * 2
        assert report.tokens == {2: (F_ * H * W, F_ * H * W - F_ * (H // 2) * (W // 2))}
        assert not torch.equal(out, ref) and torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=0.05 * ref.abs().max().item(), rtol=0)
        assert torch.equal(run(wan, inputs), out)  # same inputs, same bits
    finally:
        tome.remove_patch(wan)
    assert torch.equal(run(wan, inputs), ref)
    assert all(type(b.attn1.processor).__name__ == "WanAttnProcessor" for b in wan.blocks)


def test_wan_factor_one_is_the_library_bit_for_bit(wan):
    inputs = wan_inputs()
    ref = run(wan, inputs)
    tome.apply_patch(wan, method="downsample", downsample_factor=1)
    try:
        assert torch.equal(run(wan, inputs), ref)
        assert tome.patch_report(wan).planner.tokens  # the pooled path ran
    finally:
        tome.remove_patch(wan)


def _pool_frames(x, h, w, f, start=0):
    """[B, S, C] with each frame's h x w tokens (after ``start``) averaged per f x f cell,
    frame by frame, by explicit loops."""
    n = (x.shape[1] - start) // (h * w)
    out = [x[:, :start]]
    for t in range(n):
        img = x[:, start + t * h * w:start + (t + 1) * h * w].reshape(x.shape[0], h, w, -1)
        out += [img[:, i:i + f, j:j + f].mean((1, 2))[:, None]
                for i in range(0, h, f) for j in range(0, w, f)]
    return torch.cat(out, 1)


def _wan_rotate(x, cos, sin):
    """RoPE by hand on interleaved pairs (Wan repeats each frequency over its pair)."""
    x0, x1 = x[..., 0::2].double(), x[..., 1::2].double()
    c, s = cos[..., 0::2], sin[..., 0::2]
    return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2).float()


@pytest.mark.parametrize("rope,proportional,f", [("pooled", False, 2), ("before", False, 2),
                                                 ("pooled", True, 3)])
def test_wan_self_attention_matches_a_hand_written_per_frame_reference(wan, rope,
                                                                       proportional, f):
    """One Wan self-attention call with keys/values pooled per frame, against the maths
    written out: projections, RMS norms across heads, rotation, f x f cell means frame by
    frame (the pooled positions: the cells' mean rotations, normalised), the log-cell-size
    bias (partial cells at the bottom edge with f = 3), softmax."""
    attn = wan.blocks[0].attn1
    g = torch.Generator().manual_seed(3)
    hs = torch.randn(2, F_ * H * W, 24, generator=g)
    cos, sin = wan.rope(torch.empty(1, 0, F_, 2 * H, 2 * W))
    plan = dit.DitPlan(H, W, f, rope, proportional, F_)
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(plan, 0))
    with torch.no_grad():
        out = wrapper(attn, hs, None, None, (cos, sin))

        def heads(x):
            return x.reshape(2, -1, attn.heads, 12)
        q = heads(attn.norm_q(attn.to_q(hs)))
        k = heads(attn.norm_k(attn.to_k(hs)))
        v = heads(attn.to_v(hs))
        c, s = cos[0, :, 0], sin[0, :, 0]  # [S, D]
        q = _wan_rotate(q, c[None, :, None], s[None, :, None])
        if rope == "before":
            k = _wan_rotate(k, c[None, :, None], s[None, :, None])
        kp = heads(_pool_frames(k.flatten(2), H, W, f))
        vp = heads(_pool_frames(v.flatten(2), H, W, f))
        if rope == "pooled":
            pc, ps = (_pool_frames(e[None].float(), H, W, f)[0].double() for e in (c, s))
            r = torch.sqrt(pc ** 2 + ps ** 2)
            kp = _wan_rotate(kp, (pc / r)[None, :, None], (ps / r)[None, :, None])
        assert kp.shape[1] == F_ * math.ceil(H / f) * math.ceil(W / f)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, kp) / math.sqrt(12)
        if proportional:
            counts = [min(f, H - i) * min(f, W - j) for i in range(0, H, f)
                      for j in range(0, W, f)] * F_
            scores = scores + torch.tensor(counts).log()
        ref = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vp).flatten(2)
        ref = attn.to_out[0](ref)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_wan_pooling_never_mixes_frames(wan):
    """Per-frame cells: changing one frame's tokens changes only that frame's pooled keys."""
    plan = dit.DitPlan(H, W, 2, "pooled", False, F_)
    x = torch.randn(1, F_ * H * W, 4)
    y = x.clone()
    y[:, H * W:2 * H * W] += 1.0  # frame 1 only
    px, py = plan.pool(x, 0, 1), plan.pool(y, 0, 1)
    per = (H // 2) * (W // 2)
    changed = (px - py).abs().sum(-1)[0] > 0
    assert changed[per:2 * per].all() and not changed[:per].any() and not changed[2 * per:].any()


def test_wan_ti2v_keeps_the_condition_frame_whole(wan, monkeypatch):
    """A per-token timestep (Wan 2.2 TI2V): the first frame's keys stay as they are, the
    others are pooled; the window reads a generated token's timestep, not the condition's 0."""
    inputs = wan_inputs(per_token=True)
    ref = run(wan, inputs)
    tome.apply_patch(wan, method="downsample", start=0.0, end=0.5)  # t=700: progress 0.3
    try:
        keys = _Keys(monkeypatch)
        out = run(wan, inputs)
        assert keys.lengths[0] == H * W + (F_ - 1) * (H // 2) * (W // 2)
        assert not torch.equal(out, ref) and torch.isfinite(out).all()
    finally:
        tome.remove_patch(wan)
    tome.apply_patch(wan, method="downsample", start=0.5, end=1.0)  # outside the window
    try:
        assert torch.equal(run(wan, inputs), ref)
    finally:
        tome.remove_patch(wan)


def test_wan_measuring_runs_one_block_on_the_video_grid(wan):
    """What the auto policy times (``processors.runner`` with the family's inputs: the text,
    the time projection, the model's own RoPE of the video grid): a block unpooled and
    pooled per frame, its processors back as they were."""
    run_block = processors.runner(layout.read(wan))

    class Planner:
        size = (F_, 2 * H, 2 * W)
    x = torch.randn(1, F_ * H * W, 24, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = run_block(wan.blocks[0], x, None, Planner, None)
        pooled = run_block(wan.blocks[0], x, None, Planner, dit.DitPlan(H, W, 2, "pooled",
                                                                        False, F_))
    assert full.shape == pooled.shape == x.shape
    assert torch.isfinite(pooled).all() and not torch.equal(full, pooled)
    assert type(wan.blocks[0].attn1.processor).__name__ == "WanAttnProcessor"


@pytest.mark.parametrize("grid,speedup", [((F_, H, W), 0.9), ((F_, 2 * H, 2 * W), 1.5)])
def test_wan_auto_policy_times_each_video_size(wan, tmp_path, grid, speedup):
    """The processors runner times video grids as the generation pools them (per frame,
    through the family's inputs: the video's own RoPE), as the per-call hosts' runner does:
    one measurement per video size (cached), and the decision follows it (a clock that
    makes the pooled block 1.5x faster merges, 0.9x does not); the output is then the
    unpooled one, or exactly the fixed policy's pooled one."""
    frames, h, w = grid
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(2, 4, frames, 2 * h, 2 * w, generator=g),
                  timestep=torch.full((2,), 700.0),
                  encoder_hidden_states=torch.randn(2, 7, 16, generator=g))
    lines: list[str] = []
    service = Measurer(MeasurementCache(tmp_path / "m.json", say=lines.append),
                       say=lines.append, clock=fake_clock(speedup), rounds=3)
    ref = run(wan, inputs)
    tome.apply_patch(wan, method="downsample", policy="fixed")
    try:
        pooled = run(wan, inputs)
    finally:
        tome.remove_patch(wan)
    assert not torch.equal(pooled, ref)
    tome.apply_patch(wan, method="downsample", policy="auto", measure=service)
    try:
        out = run(wan, inputs)
        again = run(wan, inputs)
        (decision,) = tome.patch_report(wan).decisions.values()
    finally:
        tome.remove_patch(wan)
    assert not [x for x in lines if "not timed" in x]
    assert len(service.results) == 1 and (tmp_path / "m.json").exists()  # one size, cached
    assert decision.tokens == frames * h * w and "measured" in decision.reason
    assert decision.merged is (speedup > 1.2)
    assert torch.equal(out, pooled if decision.merged else ref) and torch.equal(again, out)
    assert torch.equal(run(wan, inputs), ref)


def test_a_compiled_wan_is_one_graph_across_steps(wan):
    """The grid is the latent's shape: the whole patched transformer compiles as one graph
    (hooks included), gives the eager answer and does not recompile from step to step."""
    model = copy.deepcopy(wan)
    tome.apply_patch(model, method="downsample", proportional=True)
    eager = [run(model, wan_inputs(t=t)) for t in (900.0, 500.0)]
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        out = [fn(**wan_inputs(t=900.0)).sample]
        with torch._dynamo.config.patch(error_on_recompile=True):
            out.append(fn(**wan_inputs(t=500.0)).sample)
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- Qwen-Image

@pytest.mark.parametrize("rope", ["pooled", "before"])
def test_qwen_pools_and_removal_is_bit_exact(qwen, rope, monkeypatch):
    inputs = qwen_inputs()
    ref = run(qwen, inputs)
    tome.apply_patch(qwen, method="downsample", rope=rope)
    try:
        report = tome.patch_report(qwen)
        assert report.summary().startswith("ToMe: diffusers qwen-image DiT, downsample x2; 2/2")
        keys = _Keys(monkeypatch)
        out = run(qwen, inputs)
        assert keys.lengths == [T + (H // 2) * (W // 2)] * 2
        assert not torch.equal(out, ref) and torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=0.05 * ref.abs().max().item(), rtol=0)
        assert torch.equal(run(qwen, inputs), out)
    finally:
        tome.remove_patch(qwen)
    assert torch.equal(run(qwen, inputs), ref)
    assert all(type(b.attn.processor).__name__ == "QwenDoubleStreamAttnProcessor2_0"
               for b in qwen.transformer_blocks)


@pytest.mark.parametrize("kw", [{}, {"mask": True}, {"reference": True}])
def test_qwen_factor_one_is_the_library_bit_for_bit(qwen, kw):
    """Text mask and an edit's reference image included: factor 1 runs the pooled path with
    diffusers' own bits."""
    inputs = qwen_inputs(**kw)
    ref = run(qwen, inputs)
    tome.apply_patch(qwen, method="downsample", downsample_factor=1)
    try:
        assert torch.equal(run(qwen, inputs), ref)
        assert tome.patch_report(qwen).planner.tokens
    finally:
        tome.remove_patch(qwen)


def test_qwen_keeps_reference_images_and_the_text_mask(qwen, monkeypatch):
    """An edit's reference image (after the generated one) keeps all its keys; the text mask
    still hides the padded text keys (changing them changes nothing)."""
    inputs = qwen_inputs(mask=True, reference=True)
    tome.apply_patch(qwen, method="downsample", proportional=True)
    try:
        keys = _Keys(monkeypatch)
        out = run(qwen, inputs)
        assert keys.lengths == [T + (H // 2) * (W // 2) + 24] * 2
        other = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
        other["encoder_hidden_states"][1, -2:] += 5.0  # the masked text tokens of item 1
        again = run(qwen, other)
        torch.testing.assert_close(again[1], out[1], atol=1e-6, rtol=0)
        assert torch.isfinite(out).all()
    finally:
        tome.remove_patch(qwen)


def _qwen_rotate(x, freqs):
    """Qwen-Image's complex RoPE by hand: each interleaved pair turned by its frequency's
    angle (``freqs`` complex [S, D/2])."""
    c, s = (p.repeat_interleave(2, -1)[None, :, None] for p in (freqs.real, freqs.imag))
    return _wan_rotate(x, c.double(), s.double())


@pytest.mark.parametrize("rope,proportional,f", [("pooled", True, 3), ("before", True, 2),
                                                 ("pooled", False, 2)])
def test_qwen_pooled_call_matches_a_hand_written_reference(qwen, rope, proportional, f):
    """One pooled Qwen-Image attention call (the library's maths behind the processor
    wrapper) against the maths written out: projections and RMS norms, text and image rotated
    apart, the generated image's keys/values averaged per f x f cell by loops (partial bottom
    cells with f = 3; the positions: the cells' normalised mean rotations, or keys rotated
    before), an edit's reference image after it whole, [text, image, reference], the
    log(cell size) bias on the cells only, the text mask (one prompt two tokens shorter),
    einsum softmax. The reference with the bias negated is far from the output."""
    model = copy.deepcopy(qwen)
    attn = model.transformer_blocks[0].attn
    for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        torch.nn.init.ones_(norm.weight)  # unit RMS queries and keys: scores of order 1
    g = torch.Generator().manual_seed(6)
    image, ref_tokens = H * W, 4 * 6
    hs = torch.randn(2, image + ref_tokens, 32, generator=g)
    ehs = torch.randn(2, T, 32, generator=g)
    keep = torch.tensor([[True] * T, [True] * (T - 2) + [False] * 2])
    img, txt = model.pos_embed([[(1, H, W), (1, 4, 6)]] * 2, max_txt_seq_len=T)
    plan = dit.DitPlan(H, W, f, rope, proportional)
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(plan, T))

    def reference(sign=1.0):
        def heads(x):
            return x.reshape(2, x.shape[1], attn.heads, 16)
        q, k, v = heads(attn.to_q(hs)), heads(attn.to_k(hs)), heads(attn.to_v(hs))
        eq, ek, ev = (heads(p(ehs)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        q, k, eq, ek = (attn.norm_q(q), attn.norm_k(k), attn.norm_added_q(eq),
                        attn.norm_added_k(ek))
        q, eq, ek = _qwen_rotate(q, img), _qwen_rotate(eq, txt), _qwen_rotate(ek, txt)
        if rope == "before":
            k = _qwen_rotate(k, img)
        kp = heads(_pool_frames(k[:, :image].flatten(2), H, W, f))
        vp = heads(_pool_frames(v[:, :image].flatten(2), H, W, f))
        kr = k[:, image:] if rope == "before" else _qwen_rotate(k[:, image:], img[image:])
        if rope == "pooled":
            pc, ps = (_pool_frames(p[None, :image].float(), H, W, f)[0].double()
                      for p in (img.real, img.imag))
            r = torch.sqrt(pc ** 2 + ps ** 2)
            kp = _qwen_rotate(kp, torch.complex(pc / r, ps / r))
        keys, values = torch.cat([ek, kp, kr], 1), torch.cat([ev, vp, v[:, image:]], 1)
        scores = torch.einsum("bqhd,bkhd->bhqk", torch.cat([eq, q], 1), keys) / 4.0
        counts = torch.tensor([min(f, H - i) * min(f, W - j) for i in range(0, H, f)
                               for j in range(0, W, f)], dtype=torch.float)
        cells = counts.log() * sign * proportional
        text = torch.zeros(2, T).masked_fill(~keep, float("-inf"))
        bias = torch.cat([text, cells.expand(2, -1), torch.zeros(2, ref_tokens)], 1)
        out = torch.einsum("bhqk,bkhd->bqhd", (scores + bias[:, None, None]).softmax(-1),
                           values).flatten(2)
        return attn.to_out[1](attn.to_out[0](out[:, T:])), attn.to_add_out(out[:, :T])

    with torch.no_grad():
        out, ctx = wrapper(attn, hs, encoder_hidden_states=ehs,
                           encoder_hidden_states_mask=keep.long(), image_rotary_emb=(img, txt))
        ref, ref_ctx = reference()
        assert plan.pooled == math.ceil(H / f) * math.ceil(W / f)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(ctx, ref_ctx, atol=2e-5, rtol=1e-4)
        if proportional:
            assert (out - reference(sign=-1.0)[0]).abs().max() > 1e-3


def test_qwen_auto_policy_measures_its_blocks(qwen, tmp_path):
    service = Measurer(MeasurementCache(tmp_path / "m.json", say=print), say=print,
                       clock=fake_clock(1.01), rounds=3)
    inputs = qwen_inputs()
    ref = run(qwen, inputs)
    tome.apply_patch(qwen, method="downsample", policy="auto", measure=service)
    try:
        assert torch.equal(run(qwen, inputs), ref)  # measured 1.01x: not pooled
        (decision,) = tome.patch_report(qwen).decisions.values()
        assert not decision.merged and "measured 1.01x" in decision.reason
    finally:
        tome.remove_patch(qwen)


def test_other_qwen_and_wan_classes_are_not_these_families():
    """ComfyUI's and Forge Neo's models of the same class names are not diffusers'."""
    from tome import dits

    class QwenImageTransformer2DModel(torch.nn.Module):
        pass
    assert dits.find(QwenImageTransformer2DModel()) is None


# ----------------------------------------------------------------------------- HunyuanVideo

def _hunyuan(condition=None):
    return _randomise(diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 4, 4),
        image_condition_type=condition, guidance_embeds=False))


def hunyuan_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, 4, F_, 2 * H, 2 * W, generator=g),
                timestep=torch.full((2,), 700.0),
                encoder_hidden_states=torch.randn(2, 6, 16, generator=g),
                encoder_attention_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]),
                pooled_projections=torch.randn(2, 8, generator=g))


@pytest.mark.parametrize("condition,kept", [(None, 0), ("token_replace", 1)])
def test_hunyuan_video_pools_the_video_keeps_text_and_condition(condition, kept, monkeypatch):
    """Double- and single-stream blocks pool the video's keys per frame ([video, text], the
    text mask kept); image-to-video keeps the condition frame's keys; factor 1 is diffusers'
    bits; removal is exact."""
    model, inputs = _hunyuan(condition), hunyuan_inputs()
    ref = run(model, inputs)
    tome.apply_patch(model, method="downsample", downsample_factor=1)
    try:
        assert torch.equal(run(model, inputs), ref)
    finally:
        tome.remove_patch(model)
    tome.apply_patch(model, method="downsample", proportional=True)
    try:
        assert tome.patch_report(model).patched_blocks == 2
        keys = _Keys(monkeypatch)
        out = run(model, inputs)
        video = kept * H * W + (F_ - kept) * (H // 2) * (W // 2)
        assert keys.lengths[-2:] == [video + 6] * 2  # the refiner's text attention first
        assert not torch.equal(out, ref) and torch.isfinite(out).all()
        torch.testing.assert_close(out, ref, atol=0.05 * ref.abs().max().item(), rtol=0)
    finally:
        tome.remove_patch(model)
    assert torch.equal(run(model, inputs), ref)


def _hunyuan_reference(attn, hs, ehs, keep, cos, sin, f, rope, proportional, sign=1.0,
                       per_video=False):
    """HunyuanVideo's attention written out with the video keys/values pooled: projections
    and RMS norms per head, [video, text] (a single-stream block projects them together), RoPE
    on the video queries, each frame's keys and values averaged per f x f cell by loops
    (``_pool_frames``; ``per_video``: the frames stacked into one tall grid, cells crossing
    frames), the pooled keys rotated before (``rope="before"``) or by their cells' normalised
    mean rotation, ``sign * log(cell size)`` on the cells' scores, the text mask ``keep``
    ([B, text], False: -inf) on the text keys, an einsum softmax, the output projections."""
    b, n, t = hs.shape[0], hs.shape[1], ehs.shape[1]

    def heads(x):
        return x.reshape(b, x.shape[1], attn.heads, -1)
    single = attn.add_q_proj is None
    x = torch.cat([hs, ehs], 1) if single else hs
    q, k, v = heads(attn.to_q(x)), heads(attn.to_k(x)), heads(attn.to_v(x))
    q, k = attn.norm_q(q), attn.norm_k(k)
    if single:
        (q, eq), (k, ek), (v, ev) = (y.split([n, t], 1) for y in (q, k, v))
    else:
        eq, ek, ev = (heads(p(ehs)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
        eq, ek = attn.norm_added_q(eq), attn.norm_added_k(ek)
    c, s = cos[None, :, None], sin[None, :, None]
    q = torch.cat([_wan_rotate(q, c, s), eq], 1)
    if rope == "before":
        k = _wan_rotate(k, c, s)
    h, frames = (F_ * H, 1) if per_video else (H, F_)
    kp = heads(_pool_frames(k.flatten(2), h, W, f))
    vp = heads(_pool_frames(v.flatten(2), h, W, f))
    if rope == "pooled":
        pc, ps = (_pool_frames(e[None].float(), h, W, f)[0].double() for e in (cos, sin))
        r = torch.sqrt(pc ** 2 + ps ** 2)
        kp = _wan_rotate(kp, (pc / r)[None, :, None], (ps / r)[None, :, None])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, torch.cat([kp, ek], 1)) / math.sqrt(q.shape[-1])
    counts = [min(f, h - i) * min(f, W - j) for i in range(0, h, f) for j in range(0, W, f)]
    cells = torch.tensor(counts * frames, dtype=torch.float).log() * sign * proportional
    text = torch.zeros(b, t).masked_fill(~keep, float("-inf"))
    scores = scores + torch.cat([cells.expand(b, -1), text], 1)[:, None, None]
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), torch.cat([vp, ev], 1)).flatten(2)
    out, ctx = out[:, :n], out[:, n:]
    if attn.to_out is not None:
        out = attn.to_out[1](attn.to_out[0](out))
    if getattr(attn, "to_add_out", None) is not None:
        ctx = attn.to_add_out(ctx)
    return out, ctx


@pytest.mark.parametrize("block", ["double", "single"])
@pytest.mark.parametrize("rope,proportional,f", [("pooled", True, 3), ("before", True, 2),
                                                 ("pooled", False, 2)])
def test_hunyuan_video_pooled_call_matches_a_hand_written_per_frame_reference(
        block, rope, proportional, f):
    """One pooled HunyuanVideo attention call (the library's maths behind the processor
    wrapper) in a double-stream and a single-stream block against ``_hunyuan_reference``:
    the video's keys/values pooled per cell within each frame (partial bottom cells with
    f = 3), the log(cell size) bias, the text keys whole with their mask (one prompt two
    tokens shorter). The reference with the bias negated, or pooled per video (cells across
    frames), is far from the output: the comparison can fail."""
    model = _hunyuan()
    attn = (model.transformer_blocks if block == "double" else
            model.single_transformer_blocks)[0].attn
    for norm in (attn.norm_q, attn.norm_k, attn.norm_added_q, attn.norm_added_k):
        if norm is not None:  # unit RMS queries and keys: scores of order 1, not ~0.003
            torch.nn.init.ones_(norm.weight)
    g = torch.Generator().manual_seed(5)
    n, t = F_ * H * W, 6
    hs, ehs = torch.randn(2, n, 24, generator=g), torch.randn(2, t, 24, generator=g)
    keep = torch.tensor([[True] * t, [True] * (t - 2) + [False] * 2])
    mask = torch.cat([torch.ones(2, n, dtype=torch.bool), keep], 1)[:, None, None]
    cos, sin = model.rope(torch.empty(1, 0, F_, 2 * H, 2 * W))
    assert cos.shape[0] == n
    plan = dit.DitPlan(H, W, f, rope, proportional, F_)
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(plan, 0))
    with torch.no_grad():
        out, ctx = wrapper(attn, hs, ehs, mask, (cos, sin))
        args = (attn, hs, ehs, keep, cos, sin, f, rope, proportional)
        ref, ref_ctx = _hunyuan_reference(*args)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(ctx, ref_ctx, atol=2e-5, rtol=1e-4)
        wrong = [_hunyuan_reference(*args, per_video=True)] if f == 3 else []
        wrong += [_hunyuan_reference(*args, sign=-1.0)] if proportional else []
        for bad, _ in wrong:
            assert (out - bad).abs().max() > 1e-3


def test_wan_pooling_adds_few_ops_and_no_host_sync(wan):
    """One Wan self-attention call pooled against the original processor, counted with a
    TorchDispatchMode: a handful of extra ops (pooling keys, values and positions), none
    reading back to the host, no scatter."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    attn = wan.blocks[0].attn1
    hs = torch.randn(2, F_ * H * W, 24)
    emb = wan.rope(torch.empty(1, 0, F_, 2 * H, 2 * W))
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(
        dit.DitPlan(H, W, 2, "pooled", True, F_), 0))
    with torch.no_grad():
        wrapper(attn, hs, None, None, emb)  # the call's first block pools the positions
        with Ops() as pooled:
            wrapper(attn, hs, None, None, emb)
        with Ops() as base:
            attn.processor(attn, hs, None, None, emb)
    assert not {"_local_scalar_dense", "item", "nonzero"} & set(pooled.ops)
    assert not [o for o in pooled.ops if "scatter" in o or "index_put" in o]
    assert len(pooled.ops) - len(base.ops) <= 24, (len(pooled.ops), len(base.ops))


def test_wan_schedule_gives_each_block_its_factor(wan, monkeypatch):
    """The DiT schedule applies per block as on Flux: block 0 x2, block 1 x4 (cross-attention
    untouched)."""
    tome.apply_patch(wan, method="downsample", schedule="0:2,1:4")
    try:
        keys = _Keys(monkeypatch)
        run(wan, wan_inputs())
        assert keys.lengths == [F_ * (H // 2) * (W // 2), 7, F_ * (H // 4) * (W // 4), 7]
    finally:
        tome.remove_patch(wan)


def test_qwen_pooled_attention_compiles_in_one_graph(qwen):
    """Qwen-Image's pooled attention (complex RoPE, pooled positions, the bias) compiles with
    fullgraph=True and gives the eager answer."""
    from stubs import compiles_like_eager
    attn = qwen.transformer_blocks[0].attn
    emb = qwen.pos_embed([(1, H, W)], max_txt_seq_len=T, device=torch.device("cpu"))
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(
        dit.DitPlan(H, W, 2, "pooled", True), T))
    compiles_like_eager(lambda hs, ehs: wrapper(attn, hs, ehs, image_rotary_emb=emb),
                        torch.randn(2, H * W, 32), torch.randn(2, T, 32))


def test_a_pipelines_second_transformer_gets_the_same_patch():
    """Wan 2.2 A14B pipelines hold a low-noise expert in ``transformer_2`` that runs the later
    steps: patched and removed with the first; a failure on it leaves neither patched."""
    import types

    def build(seed):
        torch.manual_seed(seed)
        return randomised(diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64))

    pipe = types.SimpleNamespace(transformer=build(0), transformer_2=build(1))
    inputs = wan_inputs()
    refs = [run(t, inputs) for t in (pipe.transformer, pipe.transformer_2)]
    tome.apply_patch(pipe, method="downsample")
    try:
        assert tome.is_patched(pipe.transformer) and tome.is_patched(pipe.transformer_2)
        assert not torch.equal(run(pipe.transformer_2, inputs), refs[1])
    finally:
        tome.remove_patch(pipe)
    assert not tome.is_patched(pipe.transformer) and not tome.is_patched(pipe.transformer_2)
    assert [torch.equal(run(t, inputs), r) for t, r in
            zip((pipe.transformer, pipe.transformer_2), refs)] == [True, True]
    pipe.transformer_2 = torch.nn.Linear(2, 2)  # not a model ToMe reads
    with pytest.raises(tome.UnsupportedModelError):
        tome.apply_patch(pipe, method="downsample")
    assert not tome.is_patched(pipe.transformer)
