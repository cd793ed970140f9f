"""The DiT lab: the speed benchmark's quick path and the tiny DiT (never asserting timings)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")


def test_dit_bench_quick_runs_every_variant(tmp_path, capsys):
    from tome_lab import dit_bench
    assert dit_bench.main(["--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "dit_bench.json").read_text())
    rows = {r["family"]: r for r in data["rows"]}
    assert set(rows) == {"flux", "sd3"}
    assert set(rows["flux"]["ms"]) == {"none", "x2", "x4", "x2 before", "ceiling"}
    assert all("auto" in r for r in rows.values())
    assert "| flux | 256 |" in (tmp_path / "dit_bench.md").read_text()
    out = capsys.readouterr().out
    assert "DiT bench on" in out and "should be kept in float32" not in out


def test_dit_bench_quick_covers_qwen_and_a_video_dit(tmp_path):
    """Qwen-Image and Wan (a video: its rows are WxHxF, with the 2x2x2 variant), the library's
    memory check per size and the auto policy's decision."""
    from tome_lab import dit_bench
    assert dit_bench.main(["--quick", "--models", "qwen,wan", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "dit_bench.json").read_text())
    rows = {r["family"]: r for r in data["rows"]}
    assert set(rows["qwen"]["ms"]) == {"none", "x2", "x4", "x2 before", "ceiling"}
    assert set(rows["wan"]["ms"]) == {"none", "x2", "x4", "x2 2x2x2", "ceiling"}
    assert rows["wan"]["px"] == "64x48x5" and rows["wan"]["image_tokens"] == 2 * 3 * 4
    assert all(r["memory"]["own"]["fits"] and r["auto"] for r in rows.values())
    text = (tmp_path / "dit_bench.md").read_text()
    assert "| wan | 64x48x5 | 24 |" in text and "with the score matrix" in text


def test_video_quality_compares_2x2_and_2x2x2():
    from tome_lab import dit_shapes, video_quality
    size = dit_shapes.Size.parse("128x96x9")
    model = dit_shapes.build("wan", (1, 0), True, torch.float32)
    video_quality.unit_norms(model)
    rows = video_quality.evaluate(model, size, 0.5, torch.float32, True,
                                  {k: video_quality.SETTINGS[k] for k in ("x2", "x2 2x2x2")})
    assert [r["setting"] for r in rows] == ["x2", "x2 2x2x2"]
    for r in rows:
        att = r["attention"]
        assert len(att["psnr_per_frame"]) == 3 and len(att["motion_error"]) == 2
        assert 0 < att["psnr"] < float("inf") and att["motion_ratio"] > 0
    assert rows[0]["attention"]["psnr"] != rows[1]["attention"]["psnr"]
    assert "| x2 2x2x2 | attention |" in video_quality.table(rows)


def test_tiny_dit_samples_deterministically():
    from tome_lab import tinydit
    try:
        model = tinydit.load_model()
    except FileNotFoundError:
        model = tinydit.build_model().eval()
    a = tinydit.sample(model, [0, 1], seed=3, steps=2, size=32)
    b = tinydit.sample(model, [0, 1], seed=3, steps=2, size=32)
    assert a.shape == (2, 3, 32, 32) and torch.equal(a, b)
    assert 0 <= a.min() and a.max() <= 1


def test_tiny_dit_is_pooled_through_its_transformer():
    import tome
    from tome_lab import tinydit
    model = tinydit.build_model().eval()
    ref = tinydit.sample(model, [2], seed=0, steps=2, size=32)
    tome.apply_patch(model, method="downsample", downsample_factor=2, rope="before")
    try:
        assert tome.patch_report(model).kind == "DiT"
        assert not torch.equal(tinydit.sample(model, [2], seed=0, steps=2, size=32), ref)
    finally:
        tome.remove_patch(model)
    assert torch.equal(tinydit.sample(model, [2], seed=0, steps=2, size=32), ref)


def test_dit_quality_rows_have_the_heldout_loss():
    """Every setting gets the held-out loss; the unpooled row is the reference (+0%)."""
    from tome_lab import dit_quality, tinydit
    model = tinydit.build_model().eval()
    g = torch.Generator().manual_seed(0)
    heldout = (torch.rand(2, 3, 32, 32, generator=g), torch.tensor([0, 1]))
    rows = dit_quality.evaluate(model, [(0, 0)], steps=1, size=32, heldout=heldout)
    assert [r["setting"] for r in rows] == [n for n, _ in dit_quality.SETTINGS]
    assert rows[0]["loss_increase"] == {t: 0.0 for t in dit_quality.LOSS_TIMES}
    assert any(v != 0 for v in rows[1]["loss_increase"].values())
    assert "loss Δ t=0.5" in dit_quality.table(rows)


def test_dit_bench_quick_times_one_call_of_the_override_only_families(tmp_path):
    """Lumina 2 (joint [text, image]) at an image size, LTX-Video (video-only) at a video
    size: one self-attention call each, unpooled, x2, x4 and the ceiling, in the table."""
    from tome_lab import dit_bench
    assert dit_bench.main(["--quick", "--models", "lumina2,ltxv", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "dit_bench.json").read_text())
    assert not data["rows"]
    rows = {r["family"]: r for r in data["call_rows"]}
    assert set(rows) == {"lumina2", "ltxv"}
    assert set(rows["lumina2"]["call_ms"]) == {"none", "x2", "x4", "ceiling"}
    assert (rows["lumina2"]["px"], rows["lumina2"]["image_tokens"]) == (256, 256)
    assert rows["lumina2"]["sequence"] == 8 + 256
    assert (rows["ltxv"]["px"], rows["ltxv"]["image_tokens"]) == ("64x48x5", 2 * 2)
    assert rows["ltxv"]["sequence"] == 4 and rows["ltxv"]["text_tokens"] == 0
    assert "| lumina2 | 256 | 256 | 264 |" in (tmp_path / "dit_bench.md").read_text()
