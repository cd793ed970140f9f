"""Grids in three dimensions: a video DiT's tokens are ``frames x h x w``, frame-major. Pooling
(cells within each frame, or ``temporal`` frames deep), the positions of pooled keys, the
proportional bias and ``DitPlan`` against references written out with loops here, and an
image (one frame) bit for bit as before."""

from __future__ import annotations

import math

import pytest
import torch

from tome import dit

GRIDS = [(1, 8, 12, 2, 1), (3, 7, 5, 2, 1), (4, 6, 6, 2, 2), (3, 5, 4, 2, 2), (5, 9, 9, 3, 2),
         (2, 4, 4, 1, 2), (3, 4, 6, 4, 3)]  # (frames, h, w, factor, temporal)


def _cells(t, h, w, f, tf):
    """Each cell's token positions (frame, row, col), in the pooled order, by loops."""
    return [[(a, i, j) for a in range(a0, min(a0 + tf, t)) for i in range(i0, min(i0 + f, h))
             for j in range(j0, min(j0 + f, w))]
            for a0 in range(0, t, tf) for i0 in range(0, h, f) for j0 in range(0, w, f)]


def _reference_pool(x, start, t, h, w, f, tf):
    """[B, S, C]: the image span's cell means by explicit sums over each cell's tokens."""
    out = [x[:, :start]]
    for cell in _cells(t, h, w, f, tf):
        rows = [start + (a * h + i) * w + j for a, i, j in cell]  # frame-major layout
        out.append(sum(x[:, r] for r in rows)[:, None] / len(rows))
    out.append(x[:, start + t * h * w:])
    return torch.cat(out, 1)


@pytest.mark.parametrize("t,h,w,f,tf", GRIDS)
def test_pool_span_is_the_cell_mean_of_a_frame_major_grid(t, h, w, f, tf):
    x = torch.randn(2, 3 + t * h * w + 2, 6, dtype=torch.float64)
    out = dit.pool_span(x, 3, h, w, f, 1, frames=t, temporal=tf)
    cells = _cells(t, h, w, f, tf)
    assert out.shape[1] == 3 + len(cells) + 2 == 3 + dit.pooled_tokens(h, w, f, t, tf) + 2
    torch.testing.assert_close(out, _reference_pool(x, 3, t, h, w, f, tf))
    assert dit.cell_counts(h, w, f, t, tf) == [len(c) for c in cells]
    # heads-first layout [B, heads, S, D], the sequence at dim 2
    xh = x.reshape(2, x.shape[1], 2, 3).transpose(1, 2)
    outh = dit.pool_span(xh, 3, h, w, f, 2, t, tf)
    torch.testing.assert_close(outh.transpose(1, 2).reshape(2, -1, 6), out)


@pytest.mark.parametrize("t,h,w,f,tf", GRIDS)
def test_key_bias_is_the_log_of_each_cells_tokens(t, h, w, f, tf):
    sizes = [len(c) for c in _cells(t, h, w, f, tf)]
    bias = dit.key_bias(4, 4 + t * h * w + 3, h, w, f, "cpu", frames=t, temporal=tf)
    assert bias.tolist() == pytest.approx([0.0] * 4 + [math.log(n) for n in sizes] + [0.0] * 3)


def _image_reference(x, start, h, w, f):
    """[B, S, C]: an ``h x w`` image's ``f x f`` cell means in row-major cell order, by two
    loops over cells (a partial cell at the right or bottom edge averages what it holds), and
    each cell's token count."""
    out, sizes = [x[:, :start]], []
    for i0 in range(0, h, f):
        for j0 in range(0, w, f):
            rows = [start + i * w + j for i in range(i0, min(i0 + f, h))
                    for j in range(j0, min(j0 + f, w))]
            out.append(sum(x[:, r] for r in rows)[:, None] / len(rows))
            sizes.append(len(rows))
    out.append(x[:, start + h * w:])
    return torch.cat(out, 1), sizes


@pytest.mark.parametrize("h,w", [(7, 9), (6, 8), (5, 3)])
def test_an_image_is_one_frame_of_cell_means(h, w):
    """The default (frames=1) path pools an image's cells: against a 2-D loop reference,
    edge cells included, in both layouts; factor 1 is the identity (and nothing is copied)."""
    x = torch.randn(2, 5 + h * w + 1, 8, dtype=torch.float64)
    for f in (2, 3, 4):
        want, sizes = _image_reference(x, 5, h, w, f)
        out = dit.pool_span(x, 5, h, w, f, 1)
        assert out.shape[1] == 5 + len(sizes) + 1 == 5 + dit.pooled_tokens(h, w, f) + 1
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(dit.pool_span(x, 5, h, w, f, 1, frames=1), want)
        xh = x.reshape(2, x.shape[1], 2, 4).transpose(1, 2)  # [B, heads, S, D]
        outh = dit.pool_span(xh, 5, h, w, f, 2)
        torch.testing.assert_close(outh.transpose(1, 2).reshape(2, -1, 8), want)
        assert dit.cell_counts(h, w, f) == sizes
        bias = dit.key_bias(5, x.shape[1], h, w, f, "cpu")
        assert bias.tolist() == pytest.approx([0.0] * 5 + [math.log(n) for n in sizes] + [0.0])
    assert dit.pool_span(x, 5, h, w, 1, 1) is x
    assert dit.cell_counts(7, 9, 2) == [4] * 4 + [2] + [4] * 4 + [2] + [4] * 4 + [2] \
        + [2] * 4 + [1]  # typed out: 7 rows = 2+2+2+1, 9 cols = 2+2+2+2+1
    plan = dit.DitPlan(h, w, 2, "pooled")
    assert (plan.frames, plan.temporal, plan.grid, plan.tokens) == (1, 1, (1, h, w), h * w)


def test_frames_pool_on_their_own_unless_temporal():
    """Spatial cells within a frame: each frame's keys are that frame's own pooled keys."""
    t, h, w, f = 3, 4, 6, 2
    x = torch.randn(1, t * h * w, 4)
    out = dit.pool_span(x, 0, h, w, f, 1, frames=t)
    per = [dit.pool_span(x[:, a * h * w:(a + 1) * h * w], 0, h, w, f, 1) for a in range(t)]
    torch.testing.assert_close(out, torch.cat(per, 1))
    pairs = dit.pool_span(x, 0, h, w, f, 1, frames=t, temporal=2)
    n = dit.pooled_tokens(h, w, f)
    torch.testing.assert_close(pairs[:, :n], (out[:, :n] + out[:, n:2 * n]) / 2)
    torch.testing.assert_close(pairs[:, n:], out[:, 2 * n:])  # the last frame: a partial cell


def _rope(ids, dims=(4, 6, 6), theta=10000.0):
    """cos/sin [S, D] of positions ``ids`` [S, 3] (frame, row, col), interleaved pairs, one
    band of channels per axis (Flux's and Wan's form), written out here."""
    cos, sin = [], []
    for axis, d in enumerate(dims):
        freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = ids[:, axis:axis + 1].double() * freqs
        cos.append(angles.cos().repeat_interleave(2, 1))
        sin.append(angles.sin().repeat_interleave(2, 1))
    return torch.cat(cos, 1).float(), torch.cat(sin, 1).float()


@pytest.mark.parametrize("t,h,w,f,tf", [(3, 4, 6, 2, 1), (4, 6, 6, 2, 2), (3, 5, 4, 2, 2)])
def test_pooled_positions_are_the_cells_mean_positions_in_three_dimensions(t, h, w, f, tf):
    """The normalised mean of a cell's rotations is the rotation by its mean position, also
    along frames: diffusers' cos/sin and ComfyUI's 2x2 matrices, through the plan."""
    text = 3
    ids = torch.zeros(text + t * h * w, 3)
    ids[text:] = torch.tensor([[a, i, j] for a in range(t) for i in range(h) for j in range(w)],
                              dtype=torch.float32)
    cos, sin = _rope(ids)
    plan = dit.DitPlan(h, w, f, "pooled", frames=t, temporal=tf)
    pc, ps = plan.cos_sin((cos, sin), text)
    ec, es = _rope(_reference_pool(ids[None].double(), text, t, h, w, f, tf)[0])
    torch.testing.assert_close(pc, ec, atol=1e-5, rtol=0)
    torch.testing.assert_close(ps, es, atol=1e-5, rtol=0)
    mats = torch.stack([cos[:, ::2], -sin[:, ::2], sin[:, ::2], cos[:, ::2]], -1)
    pooled = plan.rotations(mats.reshape(1, 1, -1, cos.shape[1] // 2, 2, 2), text)
    torch.testing.assert_close(pooled[0, 0, ..., 0, 0], ec[:, ::2], atol=1e-5, rtol=0)
    torch.testing.assert_close(pooled[0, 0, ..., 1, 0], es[:, ::2], atol=1e-5, rtol=0)


def test_a_plan_carries_its_frames_through_factor_and_bias():
    t, h, w = 3, 5, 4
    plan = dit.DitPlan(h, w, 2, "before", True, frames=t, temporal=2)
    assert (plan.grid, plan.tokens, plan.pooled) == ((3, 5, 4), 60, 2 * 3 * 2)
    four = plan.with_factor(4)
    assert (four.frames, four.temporal, four.factor, four.proportional) == (3, 2, 4, True)
    x = torch.randn(2, 2 + t * h * w, 4)
    torch.testing.assert_close(plan.pool(x, 2, 1), _reference_pool(x, 2, t, h, w, 2, 2))
    sizes = [len(c) for c in _cells(t, h, w, 2, 2)]
    bias = plan.bias(2, 2 + t * h * w, "cpu")
    assert bias.tolist() == pytest.approx([0.0, 0.0] + [math.log(n) for n in sizes])
    assert plan.bias(2, 2 + t * h * w, "cpu") is bias  # once per plan
    # a plan at factor 1 pools nothing, in time either (a schedule's x1 blocks stay whole)
    assert not dit.DitPlan(h, w, 1, "pooled", True, frames=t, temporal=2).biased
    assert not dit.DitPlan(h, w, 1, "pooled", True, frames=t).biased
