"""The tiny video DiT (``tome_lab/tinyvdit``): its clips move, it samples deterministically
and is pooled through its transformer (time cells too), and ``video_quality`` reports on it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")


def test_a_pan_moves_the_content_by_its_speed():
    """A photo that brightens left to right, panned right at 0.5 px per frame: each frame's
    mean rises by the ramp's slope times 0.5."""
    from tome_lab.tinyvdit.clips import _move
    w = 200
    ramp = torch.linspace(0, 1, w).expand(1, 3, 120, w).contiguous()
    video = _move(ramp, 16, 5, "pan", [0.5, 0.5, 0.0, 0.0])  # speed 0.5, direction 0 (right)
    means = video.mean((0, 2, 3))
    torch.testing.assert_close(means.diff(), torch.full((4,), 0.5 / (w - 1)), atol=2e-4,
                               rtol=0)


def test_clips_are_videos_of_every_class():
    from tome_lab.tinyvdit.clips import clips
    g = torch.Generator().manual_seed(0)
    photos = [(torch.randint(0, 256, (3, 96, 128), dtype=torch.uint8, generator=g), c)
              for c in range(4)]
    x, c = clips(photos, 8, 16, 5, torch.Generator().manual_seed(1))
    assert x.shape == (8, 3, 5, 16, 16) and 0 <= x.min() and x.max() <= 1
    assert set(c.tolist()) <= {0, 1, 2, 3} and (x.diff(dim=2).abs().amax((1, 2, 3, 4)) > 0).all()


def _model():
    from tome_lab import tinyvdit
    try:
        return tinyvdit.load_model()
    except FileNotFoundError:
        return tinyvdit.build_model().eval()


def test_tiny_video_dit_samples_deterministically_and_is_pooled():
    import tome
    from tome_lab import tinyvdit
    model = _model()
    ref = tinyvdit.sample(model, [1], seed=3, steps=2)
    assert ref.shape == (1, 3, 9, 32, 32) and 0 <= ref.min() and ref.max() <= 1
    assert torch.equal(tinyvdit.sample(model, [1], seed=3, steps=2), ref)
    outs = []
    for temporal in (1, 2):
        tome.apply_patch(model, method="downsample", temporal=temporal)
        try:
            assert tome.patch_report(model).kind == "DiT"
            outs.append(tinyvdit.sample(model, [1], seed=3, steps=2))
        finally:
            tome.remove_patch(model)
    assert not torch.equal(outs[0], ref) and not torch.equal(outs[0], outs[1])
    assert torch.equal(tinyvdit.sample(model, [1], seed=3, steps=2), ref)


def test_video_quality_compares_videos_frame_by_frame():
    from tome_lab import video_quality
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(2, 3, 4, 16, 16, generator=g)
    same = video_quality.compare_videos(ref, ref)
    assert same["psnr"] == float("inf") and same["ssim"] == pytest.approx(1)
    assert same["motion_error"] == 0 and same["motion_ratio"] == 1
    still = ref[:, :, :1].expand_as(ref)  # motion gone
    got = video_quality.compare_videos(still, ref)
    assert len(got["psnr_per_frame"]) == 4 and got["psnr_per_frame"][0] == float("inf")
    assert got["motion_ratio"] == 0 and got["motion_error"] == pytest.approx(1)


def test_video_quality_rows_on_the_tiny_video_dit():
    from tome_lab import video_quality
    settings = tuple((n, s) for n, s in video_quality.TRAINED if n in ("unpooled", "x2 2x2x2"))
    rows = video_quality.trained_rows(_model(), settings, [0], [0, 1], steps=1, guidance=2.0)
    assert [r["setting"] for r in rows] == ["x2 2x2x2"]
    assert 0 < rows[0]["psnr"] < float("inf") and len(rows[0]["ssim_per_frame"]) == 9
    assert "| 1 | 2 | x2 2x2x2 |" in video_quality.trained_table(rows)


def test_the_similarity_gate_merges_a_pair_only_where_its_keys_are_close():
    """The lab's gate on a 3-frame 2x4 grid (pairs: frames 0-1, frame 2 alone): frame 1's
    keys equal frame 0's in the left cell and are their negatives in the right one, so at
    threshold 0.5 the left pair becomes one key (their mean, log 8) and the right stays two
    (log 4 each); below -1 every pair merges, above 1 none."""
    import math

    from tome_lab.similarity_gate import Gate
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 3, 2, 4, 5, generator=g)  # [B, H, F, h, w, D]
    k[:, :, 1, :, :2] = k[:, :, 0, :, :2]
    k[:, :, 1, :, 2:] = -k[:, :, 0, :, 2:]
    v = torch.randn(k.shape, generator=g)
    flat = k.flatten(2, 4), v.flatten(2, 4)
    cell = k.reshape(1, 2, 3, 1, 2, 2, 2, 5).mean((4, 6)).reshape(1, 2, 3, 2, 5)  # 2x2
    keys, _, mask = Gate(0.5, 3, 2, 4).pool(*flat)
    # slots: [first of the pair (2 cells), second of the pair (2 cells), frame 2 (2 cells)]
    torch.testing.assert_close(keys[:, :, 0], cell[:, :, 0, 0])  # merged: the mean, = frame 0
    torch.testing.assert_close(keys[:, :, 1], cell[:, :, 0, 1])  # kept: frame 0's
    torch.testing.assert_close(keys[:, :, 3], cell[:, :, 1, 1])  # and frame 1's
    torch.testing.assert_close(keys[:, :, 4:], cell[:, :, 2])
    l4, l8 = math.log(4), math.log(8)
    assert mask.flatten().tolist() == pytest.approx([l8, l4, -math.inf, l4, l4, l4])
    for threshold, merged in ((-2.0, 2), (2.0, 0)):
        gate = Gate(threshold, 3, 2, 4)
        gate.pool(*flat)
        assert (gate.merged, gate.pairs) == (merged, 2)
