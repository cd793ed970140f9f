"""Attention calls the per-call core (``tome/percall.py``, ``tome/percall_calls.py``) reads
beyond one joint sequence: keys longer than the queries (references appended or prepended,
a segment of the sequence attending to all of it), fewer key heads than query heads (GQA),
cross-attention left alone; and the line after a sampling (``tome/comfy/nodes.py``) with the
counts of the ComfyUI stand-in's attention calls. References are plain SDPA over cells
pooled by loops written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tome import percall, percall_calls
from tome.kv import CallState, Spans
from tome.override import KvPool


def backend(masks: bool = True):
    """A ComfyUI-like backend ``(q, k, v, heads, mask=None, skip_reshape=False,
    skip_output_reshape=False, enable_gqa=False)``: keys/values may carry fewer heads than the
    queries (split by the queries' head width)."""
    def attention_pytorch(q, k, v, heads, mask=None, skip_reshape=False,
                          skip_output_reshape=False, enable_gqa=False, **kwargs):
        if not skip_reshape:
            d = q.shape[-1] // heads
            q = q.unflatten(-1, (heads, d)).transpose(1, 2)
            k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if masks else None,
                                             enable_gqa=enable_gqa)
        return out if skip_output_reshape else out.transpose(1, 2).flatten(2)
    if not masks:
        attention_pytorch.__name__ = "attention_sage"
    return attention_pytorch


def pooled_by_loops(x, start, h, w):
    """``x`` [B, H, S, D] with the ``h x w`` image at ``start`` along S replaced by its 2x2
    cell means (edge cells partial), row by row, by explicit loops; the rest kept."""
    out = []
    for i in range(0, h, 2):
        for j in range(0, w, 2):
            members = [start + a * w + b for a in range(i, min(i + 2, h))
                       for b in range(j, min(j + 2, w))]
            total = x[:, :, members[0]].clone()
            for m in members[1:]:
                total = total + x[:, :, m]
            out.append(total / len(members))
    return torch.cat([x[:, :, :start], torch.stack(out, 2), x[:, :, start + h * w:]], 2)


def sizes_by_loops(start, n, h, w):
    """The keys' cell sizes after ``pooled_by_loops`` (1 outside the image)."""
    cells = [min(2, h - i) * min(2, w - j) for i in range(0, h, 2) for j in range(0, w, 2)]
    return torch.tensor([1.0] * start + cells + [1.0] * (n - start - h * w))


def run(pool, func, q, k, v, st, **kw):
    with percall.active(pool, st):
        return pool(func, q, k, v, q.shape[1] if kw.get("skip_reshape") else 2, **kw)


@pytest.mark.parametrize("case", ["appended", "prepended", "segment"])
def test_longer_keys_pool_only_their_image_span(case):
    """Queries text + image, keys with 8 more: references appended (Kontext-like: the spans
    keep references after the image), prepended (Wan-like: before it), or the keys the whole
    sequence and the queries a segment of it. Only the keys' image span is pooled."""
    torch.manual_seed(0)
    text, h, w, refs = 3, 4, 6, 8
    spans, nq, start = {
        "appended": (Spans(text, True, 0, 1, h, w), text + h * w, text),
        "prepended": (Spans(0, True, 4, 1, h, w), 4 + h * w, 4 + refs),
        "segment": (Spans(text, True, 0, 1, h, w, after=refs), text + h * w, text)}[case]
    nk = nq + refs
    q = torch.randn(1, 2, nq, 8)
    k, v = (torch.randn(1, 2, nk, 8) for _ in range(2))
    st = CallState(spans, (2,), 1, False)
    assert st.start(nq, nk) == start
    pool = KvPool()
    got = run(pool, backend(), q, k, v, st, skip_reshape=True)
    ref = F.scaled_dot_product_attention(q, pooled_by_loops(k, start, h, w),
                                         pooled_by_loops(v, start, h, w))
    torch.testing.assert_close(got, ref.transpose(1, 2).flatten(2))
    assert pool.tally == {"pooled": 1}


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("masks", [True, False])
def test_gqa_keys_with_half_the_heads_pool_along_tokens(layout, masks):
    """Four query heads, two key/value heads, proportional attention: as a mask (a backend
    adding masks) or as the extra channel (one dropping them), in both of ComfyUI's layouts;
    the reference repeats each key head for its two query heads over the loop-pooled cells,
    with ``log(cell size)`` added to the scores."""
    torch.manual_seed(1)
    text, h, w = 3, 4, 5  # a partial edge column: sizes 4, 4, 2
    n = text + h * w
    q = torch.randn(1, 4, n, 8)
    k, v = (torch.randn(1, 2, n, 8) for _ in range(2))
    st = CallState(Spans(text, True, 0, 1, h, w), (2,), 1, True)
    kw = {"enable_gqa": True}
    if layout == "bhsd":
        args, heads = (q, k, v), 4
        kw["skip_reshape"] = True
    else:
        args, heads = tuple(t.transpose(1, 2).flatten(2) for t in (q, k, v)), 4
    with percall.active(pool := KvPool(), st):
        got = pool(backend(masks), *args, heads, **kw)
    kp, vp = (pooled_by_loops(t, text, h, w).repeat_interleave(2, 1) for t in (k, v))
    bias = sizes_by_loops(text, kp.shape[2], h, w).log().view(1, 1, 1, -1)
    ref = F.scaled_dot_product_attention(q, kp, vp, attn_mask=bias)
    torch.testing.assert_close(got, ref.transpose(1, 2).flatten(2), atol=1e-5, rtol=1e-4)


def test_cross_attention_stays_bit_for_bit_and_is_counted():
    """Keys as long as the text (or any length not the call's): the backend's own answer."""
    torch.manual_seed(2)
    st = CallState(Spans(3, True, 0, 1, 4, 6), (2,), 1, True)
    q = torch.randn(1, 2, 27, 8)
    pool, func = KvPool(), backend()
    for n in (3, 5, 26):
        kv = torch.randn(1, 2, n, 8)
        assert st.start(27, n) is None
        assert torch.equal(run(pool, func, q, kv, kv, st, skip_reshape=True),
                           func(q, kv, kv, 2, skip_reshape=True))
    assert pool.tally == {"cross": 3} and "pooled" not in pool.flags


def test_the_line_after_each_sampling_counts_attention_calls(monkeypatch):
    """The ComfyUI stand-in's Flux (4 blocks of joint attention) and Wan (2 blocks, each a
    self- and a cross-attention call), 4 steps of one model call: every self-attention call
    pooled, Wan's cross-attention named; a window that leaves steps out names them; no
    pooled call keeps the "not pooled" line."""
    from test_comfy import FIXED, defaults, dit_model, sample

    from tome.comfy import host, nodes
    said = []
    monkeypatch.setattr(host, "console", said.append)
    (flux,) = nodes.ToMePatch().patch(dit_model("flux"), **defaults(**FIXED))
    told = len(said)
    sample(flux)
    assert said[told:] == ["ToMe: pooled 16 of 16 attention calls"]
    (wan,) = nodes.ToMePatch().patch(dit_model("wan"), **defaults(**FIXED))
    told = len(said)
    sample(wan, "wan")
    assert said[told:] == ["ToMe: pooled 8 of 16 attention calls; the rest: cross-attention "
                           "or other lengths 8"]
    (late,) = nodes.ToMePatch().patch(dit_model("flux"), **defaults(**FIXED, start=0.3))
    told = len(said)
    sample(late)
    merged = int(said[told].split("merging in ")[1].split(" of")[0])  # the window's line
    assert 0 < merged < 4
    assert said[told + 1:] == [f"ToMe: pooled {4 * merged} of 16 attention calls; the rest: "
                               f"outside the window {16 - 4 * merged}"]
    (none,) = nodes.ToMePatch().patch(dit_model("flux"), **defaults(**FIXED, start=0.99))
    told = len(said)
    sample(none)
    assert said[told + 1:] == ["ToMe: not pooled in this sampling (4 model calls): no step "
                               "was pooled by the settings (the step window or the auto policy)"]


def test_calls_replayed_by_a_compiled_graph_are_named_not_counted():
    """A model call whose attention reached the override without a counted call (a compiled
    graph replays it without Python) is named apart, never guessed."""
    now = (percall_calls.Counter({"pooled": 2}), 3, 0, 0)
    line = percall_calls.line(now, (percall_calls.Counter(), 0, 0, 0))
    assert line == ("ToMe: pooled 2 of 2 attention calls; the rest: model calls inside a "
                    "compiled graph 3 (their attention calls not counted)")
