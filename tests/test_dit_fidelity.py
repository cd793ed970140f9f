"""DiT pooling that keeps the image (issue 34): proportional attention for pooled keys on every
pooling path, the per-block/per-step schedule, residual reuse and the presets per model kind.

Every reference is written out here, not taken from the code under test: a pooled key with
the bias ``log(count)`` must act exactly as ``count`` copies of that key (softmax counts each
copy), so the references run plain attention with each cell's mean key/value repeated over
the cell's tokens."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from models import randomised
from stubs import compiles_like_eager

import tome
from tome import attend, dit, processors, wrappers
from tome.config import PRESETS, ToMeConfig, preset

diffusers = pytest.importorskip("diffusers")
H, W, T = 5, 7, 3   # odd grid: partial cells at the right and bottom edges


def _counts_by_hand(h, w, f):
    """Tokens per cell, counted token by token, cells in row-major order."""
    cells: dict[tuple[int, int], int] = {}
    for i in range(h):
        for j in range(w):
            cells[(i // f, j // f)] = cells.get((i // f, j // f), 0) + 1
    return [cells[key] for key in sorted(cells)]


def _repeat_cells(x, start, h, w, f, dim):
    """``x`` with every image token replaced by the mean of its cell (same length)."""
    x = x.movedim(dim, 1)
    img = x[:, start:start + h * w]
    grid = img.reshape(img.shape[0], h, w, *img.shape[2:])
    out = torch.empty_like(grid)
    for i in range(0, h, f):
        for j in range(0, w, f):
            out[:, i:i + f, j:j + f] = grid[:, i:i + f, j:j + f].mean((1, 2), keepdim=True)
    x = torch.cat([x[:, :start], out.reshape(img.shape), x[:, start + h * w:]], 1)
    return x.movedim(1, dim)


@pytest.mark.parametrize("start,rest", [(3, 0), (0, 4), (2, 2)])
@pytest.mark.parametrize("f", [2, 3, 4])
def test_key_bias_is_log_cell_size_on_pooled_keys_and_zero_elsewhere(start, rest, f):
    bias = dit.key_bias(start, start + H * W + rest, H, W, f, "cpu")
    counts = _counts_by_hand(H, W, f)
    want = [0.0] * start + [math.log(c) for c in counts] + [0.0] * rest
    assert bias.tolist() == pytest.approx(want)
    assert max(counts) == f * f and min(counts) < f * f  # full and partial cells both met


def _reference(q, k, v, start, f, dim):
    """Unpooled attention over cell-mean keys/values repeated over their cells ([B,H,S,D])."""
    kr, vr = (_repeat_cells(t, start, H, W, f, dim) for t in (k, v))
    return F.scaled_dot_product_attention(q, kr, vr)


@pytest.mark.parametrize("f", [2, 3])
def test_bias_as_mask_and_as_channel_equal_repeated_keys(f):
    g = torch.Generator().manual_seed(0)
    n = T + H * W
    q, k, v = (torch.randn(2, 3, n, 16, generator=g, dtype=torch.float64) for _ in range(3))
    ref = _reference(q, k, v, T, f, 2)
    plan = dit.DitPlan(H, W, f, "pooled", proportional=True)
    kp, vp = plan.pool(k, T, 2), plan.pool(v, T, 2)
    bias = plan.bias(T, n, "cpu")
    masked = attend.sdpa(q, kp, vp, bias)
    torch.testing.assert_close(masked, ref)
    for scale in (None, attend.channel_width(16) ** -0.5):  # scale passed / kernel's own
        q2, k2, v2 = attend.count_channel(q, kp, vp, bias, 2, scale)
        assert q2.shape[-1] == attend.channel_width(16) == 24
        out = F.scaled_dot_product_attention(q2, k2, v2, scale=16 ** -0.5 if scale is None
                                             else None)
        torch.testing.assert_close(out[..., :16], ref)
        assert not out[..., 16:].any()
    plain = F.scaled_dot_product_attention(q, kp, vp)  # without the bias: not the reference
    assert not torch.allclose(plain, ref, atol=1e-3)


# ----------------------------------------------------------------------------- diffusers

def _randomise(model):
    return randomised(model, 0.3).double()


def _repeating(attn, names, start, f, dim=1):
    """Forward hooks making ``attn``'s image keys/values (outputs of ``names``) cell means."""
    def hook(_m, _i, out):
        return _repeat_cells(out, start, H, W, f, dim)
    return [getattr(attn, n).register_forward_hook(hook) for n in names]


@pytest.mark.parametrize("f", [2, 3])
def test_flux_processor_bias_against_repeated_keys(f):
    flux = _randomise(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=8,
        axes_dims_rope=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    for block in (flux.transformer_blocks[0], flux.single_transformer_blocks[0]):
        attn = block.attn
        joint = attn.added_kv_proj_dim is not None
        hs = torch.randn(2, H * W + (0 if joint else T), 32, generator=g, dtype=torch.float64)
        ehs = torch.randn(2, T, 32, generator=g, dtype=torch.float64) if joint else None
        n = T + H * W  # rotation by zero positions: the identity (the reference has no RoPE)
        emb = (torch.ones(n, 16, dtype=torch.float64), torch.zeros(n, 16, dtype=torch.float64))
        plan = dit.DitPlan(H, W, f, "pooled", proportional=True)
        wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(plan, T))
        with torch.no_grad():
            out = wrapper(attn, hs, ehs, None, emb)
            # Reference: the original processor, image keys/values made cell means.
            hooks = _repeating(attn, ["norm_k", "to_v"], 0 if joint else T, f)
            try:
                ref = attn.processor(attn, hs, ehs, None, emb)
            finally:
                for h in hooks:
                    h.remove()
        for a, b in zip(out if joint else [out], ref if joint else [ref]):
            torch.testing.assert_close(a, b)


def test_sd3_joint_processor_bias_against_repeated_keys():
    sd3 = _randomise(diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
        pooled_projection_dim=8, out_channels=4, pos_embed_max_size=32))
    attn = sd3.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(2)
    hs = torch.randn(2, H * W, 16, generator=g, dtype=torch.float64)
    ehs = torch.randn(2, T, 16, generator=g, dtype=torch.float64)
    plan = dit.DitPlan(H, W, 2, "pooled", proportional=True)
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(plan, T))
    with torch.no_grad():
        out = wrapper(attn, hs, ehs)
        # [B, S, heads*D] outputs: image first, the hooks see only image tokens
        hooks = _repeating(attn, ["to_k", "to_v"], 0, 2)
        try:
            ref = attn.processor(attn, hs, ehs)
        finally:
            for h in hooks:
                h.remove()
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- A1111's SD3

def test_a1111_mmdit_bias_through_the_extra_channel_against_repeated_keys(monkeypatch):
    import mmdit_stub

    def attention(q, k, v, heads):  # A1111's: the head dim is q's, SDPA's default scale
        b, dh = q.shape[0], q.shape[-1] // heads
        q, k, v = (t.view(b, -1, heads, dh).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, heads * dh)
    monkeypatch.setattr(mmdit_stub, "attention", attention)
    torch.manual_seed(0)
    model = mmdit_stub.MMDiT(dim=32, heads=2, depth=2).eval()  # its time embedding is fp32
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 2 * H, 2 * W, generator=g)
    ctx = torch.randn(2, T, 12, generator=g)
    t = torch.full((2,), 600.0)

    def hook(_m, _i, out):  # image block's qkv: k and v made cell means
        q, k, v = out.chunk(3, -1)
        return torch.cat([q] + [_repeat_cells(u, 0, H, W, 2, 1) for u in (k, v)], -1)
    handles = [b.x_block.attn.qkv.register_forward_hook(hook) for b in model.joint_blocks]
    with torch.no_grad():
        ref = model(x, t, context=ctx)
    for h in handles:
        h.remove()
    tome.apply_patch(model, method="downsample")
    try:
        with torch.no_grad():
            out = model(x, t, context=ctx)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
        tome.apply_patch(model, method="downsample", proportional=False)
        with torch.no_grad():
            assert not torch.allclose(model(x, t, context=ctx), ref, atol=1e-4)
        monkeypatch.undo()  # the stub's own attention again; factor 1 changes no bit
        tome.remove_patch(model)
        with torch.no_grad():
            plain = model(x, t, context=ctx)
        tome.apply_patch(model, method="downsample", downsample_factor=1)
        with torch.no_grad():
            assert torch.equal(model(x, t, context=ctx), plain)
    finally:
        tome.remove_patch(model)
    for b in model.joint_blocks:
        for a in (b.x_block.attn, b.context_block.attn):
            assert "pre_attention" not in vars(a) and "post_attention" not in vars(a)


# ----------------------------------------------------------------------------- residual reuse

class _Source:
    """A patch's state as the wrapper sees it: one plan, the progress, the reuse state."""

    def __init__(self, plan, every):
        self.plan, self.text, self.p, self.reuse = plan, T, None, attend.Reuse(every)

    def plan_for(self, index, kind):
        return self.plan


def test_residual_reuse_keeps_full_minus_pooled_and_adds_it_between_refreshes():
    flux = _randomise(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=0, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=8,
        axes_dims_rope=(4, 6, 6)))
    attn = flux.transformer_blocks[0].attn
    ids = torch.zeros(T + H * W, 3)
    ids[T:, 1] = torch.arange(H).repeat_interleave(W)
    ids[T:, 2] = torch.arange(W).repeat(H)
    emb = tuple(e.double() for e in flux.pos_embed(ids))
    plan = dit.DitPlan(H, W, 2, "pooled", proportional=True)
    src = _Source(plan, 2)
    reusing = processors.PoolingProcessor(attn.processor, src)
    pooled = processors.PoolingProcessor(attn.processor, wrappers.Fixed(plan, T))
    g = torch.Generator().manual_seed(3)
    kept = slope = None
    # progress of each call; 0.0 again: a new generation starts with a refresh
    for step, p in enumerate([0.0, 0.25, 0.5, 0.75, 0.0, 0.25]):
        hs = torch.randn(1, H * W, 32, generator=g, dtype=torch.float64)
        ehs = torch.randn(1, T, 32, generator=g, dtype=torch.float64)
        src.p = p
        src.reuse.begin(p, 1, (H, W))
        with torch.no_grad():
            out = reusing(attn, hs, ehs, None, emb)
            full = attn.processor(attn, hs, ehs, None, emb)
            pool = pooled(attn, hs, ehs, None, emb)
        refresh = step in (0, 2, 4)
        for i in range(2):  # image and text outputs (both affine in the attention output)
            if refresh:
                torch.testing.assert_close(out[i], full[i])
            elif slope is None:  # one refresh so far: the residual as kept
                torch.testing.assert_close(out[i], pool[i] + kept[i])
            else:  # two: extrapolated one step on from the last (2 steps between refreshes)
                torch.testing.assert_close(out[i], pool[i] + kept[i] + slope[i] / 2)
        if refresh:
            new = [f - q for f, q in zip(full, pool)]
            slope = None if step == 0 or step == 4 else [a - b for a, b in zip(new, kept)]
            kept = new
    assert len(src.reuse.kept) == 1  # one residual per block: the memory it keeps


def test_reuse_on_a_patched_dit_changes_only_the_steps_between_refreshes():
    from tome_lab import tinydit
    model = tinydit.build_model()
    ref = tinydit.sample(model, [0], seed=0, steps=3)
    tome.apply_patch(model, method="downsample", downsample_factor=2, reuse=20)
    try:  # reuse 20: every step after the first adds the first step's residual
        reused = tinydit.sample(model, [0], seed=0, steps=3)
        state = vars(model.transformer)[processors.STATE_ATTR]
        assert len(state.reuse.kept) == 6 and state.reuse.step == 2
    finally:
        tome.remove_patch(model)
    tome.apply_patch(model, method="downsample", downsample_factor=2, reuse=1)
    try:  # reuse 1: every step refreshes, i.e. runs unpooled
        assert torch.allclose(tinydit.sample(model, [0], seed=0, steps=3), ref, atol=1e-5)
    finally:
        tome.remove_patch(model)
    assert not torch.allclose(reused, ref, atol=1e-5)


# ----------------------------------------------------------------------------- presets per kind

def test_presets_resolve_per_model_kind():
    from tome.config import DIT_FIELDS, DIT_PRESETS, UNET_PRESETS
    from tome.dits import Dit
    from tome.layout import UNET
    # UNet fields: exactly what the presets were before DiT points joined them
    assert UNET_PRESETS == {
        "quality": {"method": "downsample", "downsample_factor": 2, "policy": "auto"},
        "balanced": {"method": "merge", "ratio": 0.5, "policy": "auto"},
        "fast": {"method": "downsample", "downsample_factor": 4, "max_downsample": 2,
                 "policy": "auto"}}
    for name in PRESETS:
        cfg = preset(name, policy="fixed")
        assert cfg.policy == "fixed"
        assert {k: getattr(cfg, k) for k in UNET_PRESETS[name] if k != "policy"} == \
            {k: v for k, v in UNET_PRESETS[name].items() if k != "policy"}
        assert set(DIT_PRESETS[name]) <= set(DIT_FIELDS)
        assert {k: getattr(cfg, k) for k in DIT_PRESETS[name]} == DIT_PRESETS[name]
    q = preset("quality")
    flux, sd3 = Dit(2, True, 512, 1000.0, True), Dit(2, False, 333, 1.0, False)
    assert UNET.describe(q) is None  # a UNet's settings describe themselves
    assert flux.describe(q).startswith(dit.schedule_of(q).describe())
    assert "residual reuse every" in flux.describe(q) and flux.describe(q).endswith("rope before")
    assert "rope" not in sd3.describe(q)  # no rotary positions: the option does not apply
    assert flux.describe(preset("balanced")) == "merge: no DiT form, not pooled"


def test_a_unet_patched_with_a_preset_is_unchanged_by_the_dit_fields():
    from models import ldm_inputs, ldm_unet, run
    unet = ldm_unet()
    x, t, c = ldm_inputs()
    for name in ("quality", "fast"):
        cfg = preset(name, policy="fixed")
        outs = []
        for config in (cfg, ToMeConfig(**{k: getattr(cfg, k) for k in
                                          ("method", "downsample_factor", "max_downsample",
                                           "policy")})):
            tome.apply_patch(unet, config=config)
            outs.append(run(unet, x, t, c))
            tome.remove_patch(unet)
        assert torch.equal(*outs)


def test_a_dit_patched_with_a_preset_runs_the_dit_point():
    from tome_lab import tinydit
    model = tinydit.build_model()
    for name in ("quality", "fast"):
        tome.apply_patch(model, config=preset(name, policy="fixed"))
        try:
            state = vars(model.transformer)[processors.STATE_ATTR]
            want = dit.Schedule.parse(PRESETS[name]["schedule"])
            assert state.schedule.items == want.items
            assert state.reuse.every == PRESETS[name]["reuse"]
            report = tome.patch_report(model)
            assert report.kind == "DiT" and report.levels
        finally:
            tome.remove_patch(model)


@pytest.mark.parametrize("masks,scaled", [(True, True), (False, True), (False, False)])
def test_diffusers_dispatch_paths_all_equal_repeated_keys(monkeypatch, masks, scaled):
    """Each path of diffusers' dispatcher (mask; extra channel with the scale passed; extra
    channel under the kernel's own scale), chosen per backend, gives the reference."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    name = _AttentionBackendRegistry.get_active_backend()[0]
    monkeypatch.setitem(attend._BACKENDS, name, (masks, scaled))
    calls = []
    channel = attend.count_channel
    monkeypatch.setattr(attend, "count_channel", lambda *a: calls.append(1) or channel(*a))
    g = torch.Generator().manual_seed(4)
    n = T + H * W
    q, k, v = (torch.randn(2, n, 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    plan = dit.DitPlan(H, W, 2, "pooled", proportional=True)

    class Original:
        _attention_backend = _parallel_config = None
    out = attend.dispatch(Original())(q, plan.pool(k, T, 1), plan.pool(v, T, 1),
                                      plan.bias(T, n, "cpu"))
    ref = _reference(*(t.transpose(1, 2) for t in (q, k, v)), T, 2, 2).transpose(1, 2)
    torch.testing.assert_close(out, ref)
    assert bool(calls) == (not masks)


# ----------------------------------------------------------------------------- schedule

def test_schedule_parses_describes_and_refuses():
    s = dit.Schedule.parse("all:2@0-0.5, inner:4@0.5-1, last:1")
    assert s.describe() == ("x2 in all blocks, steps 0-0.5; x4 in inner blocks, steps 0.5-1; "
                            "x1 in the last block")
    assert [s.factor(i, "double", 6, 0.25) for i in range(6)] == [2, 2, 2, 2, 2, 1]
    assert [s.factor(i, "double", 6, 0.75) for i in range(6)] == [0, 4, 4, 4, 4, 1]
    assert [s.factor(i, "double", 6, None) for i in range(6)] == [2, 4, 4, 4, 4, 2]
    assert s.window() == (0.0, 1.0) and s.varies()
    assert dit.Schedule.parse("", 4, 0.2, 0.9, "double").items == \
        ((("double", 0, 0), 4, 0.2, 0.9),)
    for bad in ("all:9", "all:2@0.6-0.2", "sometimes:2", "all:x", "all:2@0.5"):
        with pytest.raises(ValueError):
            ToMeConfig(schedule=bad)


def test_each_block_pools_by_its_scheduled_factor_at_each_step():
    from tome_lab import tinydit
    model = tinydit.build_model()
    tome.apply_patch(model, method="downsample", schedule="all:2@0-0.5,inner:4@0.5-1,last:1")
    seen = []
    try:
        state = vars(model.transformer)[processors.STATE_ATTR]
        blocks = list(model.transformer.transformer_blocks) + \
            list(model.transformer.single_transformer_blocks)
        for i, b in enumerate(blocks):
            kind = "double" if i < 3 else "single"
            b.register_forward_pre_hook(
                lambda *_, i=i, kind=kind: seen.append(
                    getattr(state.plan_for(i, kind), "factor", 0)))
        x = torch.randn(1, 3, 16, 16)
        with torch.no_grad():
            for t in (0.75, 0.25):  # progress 0.25, then 0.75
                model(x, torch.full((1,), t), torch.tensor([0]))
    finally:
        tome.remove_patch(model)
        for b in blocks:
            b._forward_pre_hooks.clear()
    assert seen == [2, 2, 2, 2, 2, 1] + [0, 4, 4, 4, 4, 1]


# ----------------------------------------------------------------------------- the lab

def test_dit_frontier_writes_its_table_plot_and_grid(tmp_path, monkeypatch):
    from tome_lab import dit_frontier
    monkeypatch.setattr(dit_frontier, "APPROACHES", {
        "plain pooling": [("x2", {"downsample_factor": 2, "proportional": False})],
        "proportional": [("x2", {"downsample_factor": 2})]})
    monkeypatch.setattr(dit_frontier, "PRESETS", ("quality",))
    monkeypatch.setattr(dit_frontier, "ladder_settings", list)  # tests/test_reuse_memory.py
    g = torch.Generator().manual_seed(0)
    heldout = (torch.rand(2, 3, 64, 64, generator=g), torch.tensor([0, 1]))
    rows = dit_frontier.run(tmp_path, steps=2, seeds=(0,), heldout=heldout)
    assert [r["setting"] for r in rows] == ["unpooled", "plain pooling: x2",
                                            "proportional: x2", "preset quality"]
    assert rows[0]["loss_increase"] == 0 and rows[1]["loss_increase"] != 0
    assert rows[1]["psnr"] < rows[2]["psnr"]  # proportional attention keeps the image closer
    for name in ("frontier.md", "frontier.json", "frontier.png", "grid.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("path", ["mask, first call compiled", "channel"])
def test_biased_pooled_attention_compiles_in_one_graph(monkeypatch, path):
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry
    if path == "channel":
        monkeypatch.setitem(attend._BACKENDS, _AttentionBackendRegistry.get_active_backend()[0],
                            (False, True))
    else:  # nothing looked up yet: the backend's answer is found while tracing
        monkeypatch.setattr(attend, "_BACKENDS", {})
    flux = _randomise(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=0, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=8,
        axes_dims_rope=(4, 6, 6))).float()
    attn = flux.transformer_blocks[0].attn
    ids = torch.zeros(T + H * W, 3)
    ids[T:, 1] = torch.arange(H).repeat_interleave(W)
    ids[T:, 2] = torch.arange(W).repeat(H)
    emb = flux.pos_embed(ids)
    wrapper = processors.PoolingProcessor(attn.processor, wrappers.Fixed(
        dit.DitPlan(H, W, 2, "pooled", proportional=True), T))
    compiles_like_eager(lambda hs, ehs: wrapper(attn, hs, ehs, None, emb),
                        torch.randn(2, H * W, 32), torch.randn(2, T, 32))


def test_reuse_tells_steps_calls_and_generations_apart():
    r = attend.Reuse(3)
    seen = []
    for p in (0.0, 0.0, 0.1, 0.1, 0.2, 0.0, 0.0, 0.0, 0.0, 0.0):
        r.begin(p, 2, (4, 4))
        seen.append((r.step, r.who[-1]))
    # cond/uncond calls share a step, told apart by their place among the step's calls with
    # as many rows; progress going back starts a new generation; any number of calls per
    # noise level stay one step
    assert seen == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (0, 0), (0, 1), (0, 2), (0, 3),
                    (0, 4)]


def test_a1111_sd3_reuses_residuals_through_its_shadows():
    """reuse=1 refreshes at every step, i.e. runs the joint attention unpooled: the model's
    own outputs, step after step; reuse=20 keeps the first step's residual: other outputs."""
    import mmdit_stub
    torch.manual_seed(0)
    model = mmdit_stub.MMDiT(dim=32, heads=2, depth=2).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 2 * H, 2 * W, generator=g)
    ctx = torch.randn(2, T, 12, generator=g)
    steps = [torch.full((2,), t) for t in (900.0, 600.0, 300.0)]
    with torch.no_grad():
        ref = [model(x, t, context=ctx) for t in steps]
    outs = {}
    for every in (1, 20):
        tome.apply_patch(model, method="downsample", downsample_factor=2, reuse=every)
        try:
            with torch.no_grad():
                outs[every] = [model(x, t, context=ctx) for t in steps]
            shared = [vars(b.x_block.attn)["post_attention"].shared for b in model.joint_blocks]
            assert all(set(s) == {"d"} for s in shared)  # no q, k, v kept past a block
        finally:
            tome.remove_patch(model)
    for a, b in zip(outs[1], ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(outs[20][0], ref[0], atol=1e-5, rtol=1e-4)  # first: refresh
    assert not torch.allclose(outs[20][2], ref[2], atol=1e-4)
