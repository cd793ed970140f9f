"""The algorithm (``tome/merge.py``): matching, merge/unmerge, downsampling, hashed cells."""

from __future__ import annotations

import pytest
import torch

from tome import merge

torch.set_num_threads(1)


def _tomesd():
    return pytest.importorskip("tomesd.merge")


@pytest.mark.parametrize("h,w", [(16, 16), (13, 17), (32, 24)])
@pytest.mark.parametrize("no_rand", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_global_matching_equals_tomesd(h, w, no_rand, dtype):
    ref = _tomesd().bipartite_soft_matching_random2d
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, h * w, 64, generator=g).to(dtype)
    y = torch.randn(2, h * w, 64, generator=g).to(dtype)
    r = h * w // 2
    m1, u1 = ref(x, w, h, 2, 2, r, no_rand=no_rand, generator=torch.Generator().manual_seed(3))
    m2, u2 = merge.bipartite_soft_matching_random2d(
        x, w, h, 2, 2, r, no_rand=no_rand, generator=torch.Generator().manual_seed(3))
    a, b = m1(y), m2(y)
    assert a.shape == b.shape == (2, h * w - r, 64)
    # The same tokens in the same order, even in bf16 where equal scores are common; the sum
    # is exact here (fixed point), so tomesd's rounding differs by at most one unit (bf16).
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(a.float(), b.float(), **tol)
    torch.testing.assert_close(u1(a * 2 + 1).float(), u2(b * 2 + 1).float(), **tol)


def test_global_matching_chunked_equals_unchunked(monkeypatch):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24 * 24, 32, generator=g)
    src, dst = merge.partition(24, 24, 2, 2)
    whole = merge.global_match(x, src, dst)
    monkeypatch.setattr(merge, "CHUNK_BYTES", 4096)  # many small chunks
    chunked = merge.global_match(x, src, dst)
    torch.testing.assert_close(whole[0], chunked[0], rtol=0, atol=1e-6)
    assert torch.equal(whole[1], chunked[1])


@pytest.mark.parametrize("h,w", [(4, 4), (5, 5), (5, 4), (4, 5)])
def test_local_equals_global_when_every_destination_is_a_neighbour(h, w):
    # With a 2 x 2 cell grid the 3 x 3 neighbourhood covers every destination.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, h * w, 16, generator=g)
    src, dst = merge.partition(h, w, 2, 2, merge.random_cells(h, w, 2, 2, g))
    gm, gi = merge.global_match(x, src, dst)
    lm, li = merge.local_match(x, h, w, 2, 2, src, dst)
    torch.testing.assert_close(gm, lm, rtol=0, atol=1e-5)
    assert torch.equal(gi, li)


@pytest.mark.parametrize("h,w,sx,sy", [(16, 16, 2, 2), (13, 17, 2, 2), (12, 18, 3, 2)])
def test_local_matching_picks_the_best_neighbour(h, w, sx, sy, monkeypatch):
    monkeypatch.setattr(merge, "CHUNK_BYTES", 8192)  # several row chunks
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, h * w, 8, generator=g)
    src, dst = merge.partition(h, w, sx, sy, merge.random_cells(h, w, sx, sy, g))
    lm, li = merge.local_match(x, h, w, sx, sy, src, dst)
    hsy, wsx = h // sy, w // sx
    by_cell = merge.cell_of(dst, w, sx, sy, hsy, wsx).argsort().tolist()  # cell -> dst position
    xn = x / x.norm(dim=-1, keepdim=True)
    for b in range(2):
        for n, s in enumerate(src.tolist()):
            ci, cj = min(s // w // sy, hsy - 1), min(s % w // sx, wsx - 1)
            cand = [by_cell[(ci + di) * wsx + cj + dj] for di in (-1, 0, 1) for dj in (-1, 0, 1)
                    if 0 <= ci + di < hsy and 0 <= cj + dj < wsx]
            scores = xn[b, dst[cand]] @ xn[b, s]
            best = int(scores.argmax())
            assert abs(float(lm[b, n]) - float(scores[best])) < 1e-5
            assert float(scores[cand.index(int(li[b, n]))]) >= float(scores[best]) - 1e-6


def test_merge_unmerge_bookkeeping():
    g = torch.Generator().manual_seed(5)
    h = w = 8
    x = torch.randn(2, h * w, 4, generator=g)
    src, dst = merge.partition(h, w, 2, 2)
    plan = merge.Plan(x, src, dst, 20)
    m = plan.merge(x)
    assert m.shape == (2, h * w - 20, 4)
    # Means are preserved: the count-weighted sum of the merged tokens is the sum of x.
    counts = torch.ones(2, m.shape[1], 1)
    counts[:, plan.n_kept:] = plan.inv_count.reciprocal()
    torch.testing.assert_close((m * counts).sum(1), x.sum(1), rtol=1e-5, atol=1e-5)
    u = plan.unmerge(m)
    kept = plan.gather_rows[:plan.n_kept]  # batch 0's kept tokens
    torch.testing.assert_close(u[0, kept], x[0, kept])
    summed = plan.merge(x, "sum")
    torch.testing.assert_close(summed[:, :plan.n_kept], m[:, :plan.n_kept])
    torch.testing.assert_close(summed.sum(1), x.sum(1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="merge mode"):
        plan.merge(x, "amax")


@pytest.mark.parametrize("h,w,f", [(16, 16, 2), (16, 16, 4), (13, 17, 2), (12, 9, 3), (7, 7, 8)])
def test_downsample_tokens_shapes_and_values(h, w, f):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, h * w, 5, generator=g)
    y = merge.downsample_tokens(x, h, w, f)
    size = (max(1, h // f), max(1, w // f))
    assert y.shape == (2, size[0] * size[1], 5)
    ref = torch.nn.functional.interpolate(x.transpose(1, 2).reshape(2, 5, h, w), size=size,
                                          mode="nearest-exact").flatten(2).transpose(1, 2)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    avg = merge.downsample_tokens(x, h, w, f, mode="avg")
    assert avg.shape == y.shape
    assert merge.downsample_tokens(x, h, w, 1) is x


# ----------------------------------------------------------------------------- patched UNets

def test_float_scan_fallback_where_int64_scans_are_missing(monkeypatch):
    """MPS before macOS 13.3 cannot scan int64: the merge falls back to a float32 scan."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 16 * 16, 8, generator=g)
    src, dst = merge.partition(16, 16, 2, 2)
    exact = merge.Plan(x, src, dst, 128)
    monkeypatch.setattr(merge, "exact_scan", lambda device: False)
    approx = merge.Plan(x, src, dst, 128)
    assert approx.scale == 1.0 and exact.scale == merge.SCALE
    torch.testing.assert_close(approx.merge(x), exact.merge(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(approx.merge(x, "sum"), exact.merge(x, "sum"), rtol=1e-5,
                               atol=1e-5)
