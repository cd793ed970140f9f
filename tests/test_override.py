"""The attention override (``tome/override.py``) and the per-call core under it
(``tome/percall.py``) on their own: which calls it pools, what it hands the backend
(hand-written references), chaining, the bias as a mask and as an extra channel, keys
rotated by the core, and one compiled graph per state. The node around it is in
``test_comfy.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tome import kv, percall, plan
from tome.kv import CallState, Spans
from tome.override import KvPool


def backend(seen: list | None = None, masks: bool = True):
    """A ComfyUI-like backend ``(q, k, v, heads, mask=None, skip_reshape=False,
    skip_output_reshape=False, **kw)``, recording the key length (and mask) it gets."""
    def attention_pytorch(q, k, v, heads, mask=None, skip_reshape=False,
                          skip_output_reshape=False, **kwargs):
        if not skip_reshape:
            q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
        if seen is not None:
            seen.append((k.shape[2], mask))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if masks else None)
        return out if skip_output_reshape else out.transpose(1, 2).flatten(2)
    if not masks:
        attention_pytorch.__name__ = "attention_sage"
    return attention_pytorch


def state(text=3, h=4, w=6, frames=1, before=0, after=0, factors=(2, 2), doubles=1,
          proportional=False):
    return CallState(Spans(text, True, before, frames, h, w, after), factors, doubles,
                     proportional)


def call(pool, func, q, k, v, st, prev=None, **kw):
    with percall.active(pool, st, prev):
        return pool(func, q, k, v, 2, **kw)


def cells(x, start, h, w, frames=1, dim=2):
    """Hand-written 2x2 cell means of ``[frames, h, w]`` tokens at ``start`` along ``dim``."""
    x = x.movedim(dim, 0)
    img = x[start:start + frames * h * w].reshape(frames, h, w, *x.shape[1:])
    out = [img[f, i:i + 2, j:j + 2].mean((0, 1)) for f in range(frames)
           for i in range(0, h, 2) for j in range(0, w, 2)]
    rest = x[start + frames * h * w:]
    return torch.cat([x[:start], torch.stack(out), rest]).movedim(0, dim)


def test_spans_tell_joint_image_only_and_other_lengths():
    s = Spans(5, True, 0, 1, 4, 6, after=8)
    assert s.image == 24 and s.start(5 + 24 + 8) == 5 and s.start(24 + 8) == 0
    assert s.start(24) is None and s.start(40) is None
    assert Spans(5, False, 0, 1, 4, 6).start(29) == 0  # [image, text]
    assert Spans(0, True, 12, 3, 4, 6).start(12 + 72) == 12  # Wan: a reference first
    st = state(factors=(2, 0, 4), doubles=2)
    assert (st.factor("double", 0), st.factor("double", 1), st.factor("single", 0)) == (2, 0, 4)
    assert st.factor("single", 5) == 0 and st.factor(None, None) == 0
    assert state(factors=(2, 2)).factor(None, None) == 2


def test_joint_call_pools_the_image_span_only():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3 + 24, 8) for _ in range(3))
    seen = []
    pool = KvPool()
    out = call(pool, backend(seen), q, k, v, state(), skip_reshape=True)
    assert seen[0][0] == 3 + 6
    ref = F.scaled_dot_product_attention(q, cells(k, 3, 4, 6), cells(v, 3, 4, 6))
    torch.testing.assert_close(out, ref.transpose(1, 2).flatten(2))
    assert pool.flags == {"fired": True, "pooled": True}


def test_image_only_layout_b_s_hd_with_heads_as_a_keyword_and_frames():
    """Wan's call: [B, S, heads * D], ``heads=`` by name, three frames pooled per frame."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3 * 24, 16) for _ in range(3))
    seen = []
    pool = KvPool()
    st = state(text=0, frames=3, factors=(2,))
    with percall.active(pool, st):
        out = pool(backend(seen), q, k, v, heads=2, transformer_options={"block_index": 0})
    assert seen[0][0] == 3 * 6
    kp, vp = cells(k, 0, 4, 6, 3, dim=1), cells(v, 0, 4, 6, 3, dim=1)
    ref = backend()(q, kp, vp, 2)
    torch.testing.assert_close(out, ref)


def test_cross_attention_masks_unknown_lengths_and_unpooled_blocks_pass_through():
    torch.manual_seed(2)
    pool, seen = KvPool(), []
    q = torch.randn(1, 2, 27, 8)
    kv = torch.randn(1, 2, 5, 8)
    func = backend(seen)
    exact = func(q, kv, kv, 2, skip_reshape=True)
    assert torch.equal(call(pool, func, q, kv, kv, state(), skip_reshape=True), exact)  # cross
    mask = torch.zeros(1, 1, 27, 26)  # a mask over other keys than the call's: left alone
    x = torch.randn(1, 2, 27, 8)
    sage = backend(seen, masks=False)  # drops the mask: the call runs
    assert torch.equal(call(pool, sage, x, x, x, state(), skip_reshape=True, mask=mask,
                            transformer_options={"block_type": "double", "block_index": 0}),
                       sage(x, x, x, 2, skip_reshape=True, mask=mask))
    assert pool.skipped == [(("double", 0), percall.MASK)]
    y = torch.randn(1, 2, 30, 8)  # a length this call does not have
    assert torch.equal(call(pool, func, y, y, y, state(), skip_reshape=True),
                       func(y, y, y, 2, skip_reshape=True))
    unpooled = {"block_type": "single", "block_index": 0}  # factor 0 there
    assert torch.equal(call(pool, func, x, x, x, state(factors=(2, 0)), skip_reshape=True,
                            transformer_options=unpooled), func(x, x, x, 2, skip_reshape=True))
    assert torch.equal(call(pool, func, x, x, x, None, skip_reshape=True),
                       func(x, x, x, 2, skip_reshape=True))
    assert 3 + 6 not in [n for n, _ in seen]  # none of those was pooled
    assert pool.flags == {"fired": True}  # what the host's wrapper counts: reached, none pooled


def test_an_override_already_there_is_chained_with_the_pooled_tensors():
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 2, 27, 8) for _ in range(3))
    got = []

    def sage_node(func, *args, **kwargs):  # a node's override that calls the backend
        got.append(args[1].shape[2])
        return func(*args, **kwargs)

    func = backend()
    out = call(KvPool(), func, q, k, v, state(), prev=sage_node, skip_reshape=True)
    assert got == [9]
    torch.testing.assert_close(out, call(KvPool(), func, q, k, v, state(), skip_reshape=True))


def test_the_bias_as_a_mask_or_as_an_extra_channel_gives_the_same_attention():
    """Proportional attention: ``log(cell size)`` on pooled keys. A backend taking masks gets
    it as a [1, 1, 1, S'] mask; one dropping masks (Sage), or an override chained without
    knowing its kernel, gets one extra query/key channel instead."""
    torch.manual_seed(4)
    st = state(h=4, w=5, proportional=True)  # a partial edge cell: counts 4, 4, 2, ...
    n = 3 + 20
    for layout in ("bhsd", "bshd"):
        shape, kw = ((1, 2, n, 8), {"skip_reshape": True}) if layout == "bhsd" \
            else ((1, n, 16), {})
        q, k, v = (torch.randn(*shape) for _ in range(3))
        seen = []
        masked = call(KvPool(), backend(seen), q, k, v, st, **kw)
        assert seen[0][1].shape == (1, 1, 1, 3 + 6)
        dim = 2 if layout == "bhsd" else 1
        sizes = torch.tensor([1.0] * 3 + [4, 4, 2, 4, 4, 2])
        q4, kp, vp = (t if layout == "bhsd" else t.unflatten(-1, (2, -1)).transpose(1, 2)
                      for t in (q, cells(k, 3, 4, 5, dim=dim), cells(v, 3, 4, 5, dim=dim)))
        ref = F.scaled_dot_product_attention(q4, kp, vp, attn_mask=sizes.log().view(1, 1, 1, -1))
        torch.testing.assert_close(masked, ref.transpose(1, 2).flatten(2))
        channel = call(KvPool(), backend(masks=False), q, k, v, st, **kw)
        torch.testing.assert_close(channel, masked, atol=1e-5, rtol=1e-4)
        chained = call(KvPool(), backend(), q, k, v, st,
                       prev=lambda f, *a, **k2: f(*a, **k2), **kw)
        torch.testing.assert_close(chained, masked, atol=1e-5, rtol=1e-4)
        out4 = call(KvPool(), backend(masks=False), q, k, v, st, skip_output_reshape=True, **kw)
        torch.testing.assert_close(out4.transpose(1, 2).flatten(2), masked, atol=1e-5, rtol=1e-4)


def test_progress_inverts_percent_to_sigma():
    shift = lambda p: 0.0 if p >= 1 else 1.15 * (1 - p) / (1 + 0.15 * (1 - p))  # noqa: E731
    for p in (0.0, 0.3, 0.5, 0.9):
        assert abs(plan.Window.sigmas(0, 1, shift).progress(shift(p)) - p) < 1e-6
    assert plan.Window(0, 1).progress(250) == 0.75  # a timestep window: 1 - t / 1000


def test_compiled_calls_recompile_once_per_state_and_follow_it():
    """The state is read from the module slot, which a compiled graph guards on even where
    every guard on ``transformer_options`` is dropped (ComfyUI's TorchCompileModel): one graph
    per state, and a state seen before reuses its graph."""
    import torch._dynamo.testing

    pool = KvPool()
    func = backend()

    def model(x, transformer_options):
        q = k = v = x.unflatten(-1, (2, -1)).transpose(1, 2)
        return transformer_options["optimized_attention_override"](
            func, q, k, v, 2, skip_reshape=True, transformer_options=transformer_options)

    counter = torch._dynamo.testing.CompileCounter()
    skip = {"guard_filter_fn": lambda entries: ["transformer_options" not in e.name
                                                for e in entries]}
    compiled = torch.compile(model, backend=counter, options=skip)
    torch._dynamo.reset()
    x = torch.randn(1, 27, 16)
    states = [state(), state(), None, state(), state(factors=(4, 4)), None, state()]
    for st in states:
        with percall.active(pool, st):
            to = {"optimized_attention_override": pool, "block_index": 0, "block_type": "double"}
            got = compiled(x, to)
            want = model(x, to)
        assert torch.equal(got, want)
    assert counter.frame_count == 3  # x2, unpooled, x4


@pytest.mark.parametrize("rope", ["pooled", "before"])
def test_keys_before_rope_are_rotated_and_pooled_per_frame(rope):
    """Where the host rotates inside its function (a pre-RoPE ``pe``: Forge Neo's Flux), the
    core rotates the queries and keys itself: each frame's image keys/values pooled in 2x2
    cells of that frame (frame-major tokens), against loops and RoPE written out here as
    complex multiplications (not the stand-in's or the library's 2x2 matrices)."""
    import sys
    from pathlib import Path
    stub = str(Path(__file__).resolve().parent / "comfy_stub")
    if stub not in sys.path:
        sys.path.insert(0, stub)
    from comfy.flux import PosEmbed
    frames, h, w, text = 3, 4, 6, 3
    n = frames * h * w
    ids = torch.zeros(1, text + n, 3)
    ids[0, text:] = torch.tensor([[a, i, j] for a in range(frames) for i in range(h)
                                  for j in range(w)], dtype=torch.float32)
    pe = PosEmbed((4, 6, 6))(ids)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, text + n, 16) for _ in range(3))

    def rotate(x, ids):  # [B, H, S, D] by positions [B, S, 3], as complex numbers
        angles = [ids[..., i].double()[..., None] * 10000.0 ** (
            -torch.arange(0, d, 2, dtype=torch.float64) / d) for i, d in enumerate((4, 6, 6))]
        turn = torch.polar(torch.ones(1, dtype=torch.float64), torch.cat(angles, -1))
        pairs = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
        return torch.view_as_real(pairs * turn[:, None]).flatten(-2).float()

    def pool(x):  # [B, H, S, D]: each frame's 2x2 cell means, by loops
        img = x[:, :, text:].reshape(*x.shape[:2], frames, h, w, -1)
        cells = [img[:, :, a, i:i + 2, j:j + 2].mean((2, 3)) for a in range(frames)
                 for i in range(0, h, 2) for j in range(0, w, 2)]
        return torch.cat([x[:, :, :text], torch.stack(cells, 2)], 2)

    mean_ids = torch.cat([ids[:, :text], pool(ids[:, None])[:, 0, text:]], 1)
    expect_k = pool(rotate(k, ids)) if rope == "before" else rotate(pool(k), mean_ids)
    st = state(text=text, frames=frames, factors=(2,))
    out = kv.pool_call(st, 2, text, q, k, v, 2, lambda *t: t, {}, rope=rope, pe=pe)
    assert out[1].shape[2] == text + frames * 2 * 3 and out[3] is None  # no bias: no mask
    torch.testing.assert_close(out[0], rotate(q, ids), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[1], expect_k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[2], pool(v))


def test_reuse_at_the_kernel_against_plain_attention_per_identity():
    """Residual reuse on the per-call path (``reuse`` = 2), cond and uncond apart: a refresh
    step answers the unpooled attention exactly and keeps ``full - pooled``; the step after
    adds it (plus its slope, zero after one refresh); the next refresh keeps the new residual
    and the slope from the last two. The reference is plain SDPA over hand-pooled cells,
    step by step, per identity (never the code under test)."""
    from tome import attend
    torch.manual_seed(6)
    text, h, w = 3, 4, 6
    n = text + h * w
    reuse = attend.Reuse(2)
    reuse.join(0)
    pool = KvPool()

    def sdpa(q, k, v):  # [B, heads, S, D] -> [B, S, heads * D]
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)

    kept = {}  # identity -> (residual, slope, step): the reference's own bookkeeping
    for step in range(4):
        for who in (0, 1):
            q, k, v = (torch.randn(1, 2, n, 8) for _ in range(3))
            reuse.begin(step / 4, 1, (1, h, w), (who,))
            st = CallState(Spans(text, True, 0, 1, h, w), (2,), 1, False, reuse,
                           reuse.parts())
            got = call(pool, backend(), q, k, v, st, skip_reshape=True,
                       transformer_options={"block_type": "double", "block_index": 0})
            pooled = sdpa(q, cells(k, text, h, w), cells(v, text, h, w))
            if step % 2 == 0:  # a refresh: the full attention, its residual kept
                want = sdpa(q, k, v)
                r = want - pooled
                slope = torch.zeros_like(r) if who not in kept else \
                    (r - kept[who][0]) / (step - kept[who][2])
                kept[who] = (r, slope, step)
            else:
                r, slope, at = kept[who]
                want = pooled + r + slope * (step - at)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert reuse.held_bytes() == 2 * 2 * n * 16 * 4  # 2 identities x (residual, slope)
    reuse.reset()
    assert reuse.held_bytes() == 0


def test_compiled_calls_reuse_as_eager_with_a_few_graphs_not_one_per_step():
    """Reuse's state is decided on the host per call (``Reuse.begin``): a compiled override
    (TorchCompileModel's guard filter) gives the eager outputs over ten steps of cond and
    uncond, with one graph per variant (nothing kept yet, first slope, refresh, reuse), none
    per step."""
    import torch._dynamo.testing

    from tome import attend
    pool, func = KvPool(), backend()

    def model(x, to):
        q = k = v = x.unflatten(-1, (2, -1)).transpose(1, 2)
        return to["optimized_attention_override"](func, q, k, v, 2, skip_reshape=True,
                                                  transformer_options=to)

    def run(fn):
        reuse = attend.Reuse(2)
        reuse.join(0)
        torch.manual_seed(0)
        outs = []
        for step in range(10):
            for who in (0, 1):
                x = torch.randn(1, 27, 16)
                reuse.begin(step / 10, 1, (1, 4, 6), (who,))
                st = CallState(Spans(3, True, 0, 1, 4, 6), (2,), 1, False, reuse,
                               reuse.parts())
                with percall.active(pool, st):
                    outs.append(fn(x, {"optimized_attention_override": pool,
                                       "block_index": 0, "block_type": "double"}))
        return outs

    counter = torch._dynamo.testing.CompileCounter()
    skip = {"guard_filter_fn": lambda entries: ["transformer_options" not in e.name
                                                for e in entries]}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counter, options=skip)
    for got, want in zip(run(compiled), run(model)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert counter.frame_count <= 4  # of 20 calls


@pytest.mark.parametrize("proportional", [False, True])
def test_a_text_mask_is_kept_and_pooled_with_the_keys(proportional):
    """A joint call with a text mask (Qwen-Image's, HunyuanVideo's: padded text tokens
    masked), boolean as ComfyUI hands it ([B, Sq, Sk]): the text keys keep their mask, the
    image cells attend (a cell of masked image keys stays masked), with the bias added where
    proportional. Reference: SDPA over hand-pooled cells with the mask written out."""
    torch.manual_seed(7)
    text, h, w = 3, 4, 5
    n = text + h * w
    q, k, v = (torch.randn(2, 2, n, 8) for _ in range(3))
    mask = torch.ones(2, n, n, dtype=torch.bool)
    mask[0, :, 2] = False  # the first image's last text token is padding
    mask[1, :, text + 4] = False  # one image key of the second (row 0, column 4)
    mask[1, :, text + 9] = False  # and a key of a full cell (row 1, column 4: with row 0)
    seen = []
    out = call(KvPool(), backend(seen), q, k, v, state(h=h, w=w, proportional=proportional),
               skip_reshape=True, mask=mask)
    assert seen[0][0] == text + 6
    sizes = torch.tensor([1.0] * text + [4, 4, 2, 4, 4, 2])
    keep = torch.zeros(2, 1, 1, text + 6)
    keep[0, ..., 2] = float("-inf")
    keep[1, ..., text + 2] = float("-inf")  # the cell of rows 0-1, column 4
    if proportional:
        keep = keep + sizes.log()
    want = F.scaled_dot_product_attention(q, cells(k, text, h, w), cells(v, text, h, w),
                                          attn_mask=keep).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_the_per_call_runner_times_reuses_refresh_share(monkeypatch):
    """With residual reuse (N = 5) the auto policy's run of a pooled block also runs the
    unpooled attention on 1/N of the queries against every key (the refresh's share), as
    the generation will: the backend sees the pooled keys, then all keys for 20 of 96
    queries; without reuse only the pooled call."""
    import sys
    import types

    from tome import dit, percall_runner
    from tome.config import ToMeConfig
    from tome.plan import Planner
    seen = []

    def attention_pytorch(q, k, v, heads, mask=None, **kw):
        seen.append((q.shape[1], k.shape[1]))
        return percall_runner._sdpa(q, k, v, heads, mask)

    host = types.ModuleType("fake_host_attention")
    host.optimized_attention = attention_pytorch
    monkeypatch.setitem(sys.modules, "fake_host_attention", host)
    block = torch.nn.Module()
    block.num_heads, block.qkv = 2, torch.nn.Linear(32, 96)
    x = torch.randn(1, 8 * 12, 32)
    cfg = ToMeConfig(method="downsample", downsample_factor=2)
    planner = Planner(cfg, 2, method=dit.method_for(cfg))
    plan = planner.plan(planner.begin((16, 24), x.device, 1.0), x)
    for reuse, want in ((0, [(96, 24)]), (5, [(96, 24), (20, 96)])):
        seen.clear()
        out = percall_runner.runner(("fake_host_attention", "optimized_attention"), reuse)(
            block, x, None, planner, plan)
        assert out.shape == x.shape and seen == want
