"""Quality figures: the metrics, exactness at ratio 0, growth with the ratio, the showcase."""

from __future__ import annotations

import math

import pytest
import torch

import tome
from tome.config import ToMeConfig
from tome_lab import quality, report, showcase, tinyldm
from tome_lab.settings import parse_settings


@pytest.fixture(scope="module")
def model():
    if not tinyldm.DEFAULT_WEIGHTS.is_file():
        pytest.skip(f"shipped weights missing: {tinyldm.DEFAULT_WEIGHTS.name}")
    return tinyldm.load_model()


def _images(n=2, size=32, seed=0):
    return torch.rand(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- metrics


def test_identical_images_are_perfect():
    a = _images()
    assert torch.equal(quality.mse(a, a), torch.zeros(2))
    assert torch.isinf(quality.psnr(a, a)).all()
    assert torch.allclose(quality.ssim(a, a), torch.ones(2), atol=1e-6)


def test_more_noise_scores_worse():
    a = _images(1, 48)
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(a.shape, generator=g)
    scores = [(quality.psnr(a, (a + s * noise).clamp(0, 1)).item(),
               quality.ssim(a, (a + s * noise).clamp(0, 1)).item()) for s in (0.01, 0.05, 0.2)]
    psnrs, ssims = zip(*scores)
    assert psnrs[0] > psnrs[1] > psnrs[2] and ssims[0] > ssims[1] > ssims[2]
    assert all(-1 <= s < 1 for s in ssims)


def test_psnr_of_known_error():
    a = torch.zeros(1, 3, 16, 16)
    assert quality.psnr(a, a + 0.1).item() == pytest.approx(20.0, abs=1e-4)  # 10 log10(1/0.01)


def test_ssim_is_symmetric_and_matches_the_formula_on_flat_images():
    a, b = _images(seed=1), _images(seed=2)
    assert torch.allclose(quality.ssim(a, b), quality.ssim(b, a))
    # Flat images: no variance, so SSIM is the luminance term (2xy + C1) / (x² + y² + C1).
    x, y, c1 = 0.3, 0.6, 0.01**2
    flat = quality.ssim(torch.full((1, 3, 20, 20), x), torch.full((1, 3, 20, 20), y))
    assert flat.item() == pytest.approx((2 * x * y + c1) / (x * x + y * y + c1), rel=1e-5)
    # Structure matters more than brightness: a small shift keeps SSIM high, shuffling not.
    smooth = torch.nn.functional.interpolate(a[:1, :, :8, :8], size=32, mode="bilinear")
    shifted = quality.ssim(smooth, (smooth + 0.05).clamp(0, 1)).item()
    perm = torch.randperm(32 * 32, generator=torch.Generator().manual_seed(0))
    shuffled = quality.ssim(smooth, smooth.flatten(2)[..., perm].view_as(smooth)).item()
    assert shifted > 0.95 > 0.2 > shuffled


def test_showcase_settings_parse_with_the_benchmark_syntax():
    s = parse_settings(["merge:0.5:matching=local", "downsample:4", "merge:0.75:end=0.5"])
    assert [x.label for x in s] == ["unmerged", "merge local 0.5", "downsample x4",
                                    "merge 0.75 end=0.5"]
    assert [x.group for x in s] == ["unmerged", "merge local", "downsample", "merge end=0.5"]
    assert s[2].config == ToMeConfig(method="downsample", downsample_factor=4)
    full = parse_settings(showcase.FULL_SETTINGS)  # every preset setting is valid
    assert len(full) == len(showcase.FULL_SETTINGS) and full[0].unmerged


# ----------------------------------------------------------------------------- on the model


def test_sampling_respects_the_dtype(model):
    ref = tinyldm.sample(model, [1], seed=2, steps=2, size=32)
    assert torch.equal(tinyldm.sample(model, [1], seed=2, steps=2, size=32, dtype="fp32"), ref)
    low = tinyldm.sample(model, [1], seed=2, steps=2, size=32, dtype=torch.bfloat16)
    assert low.dtype == torch.float32 and not torch.equal(low, ref)
    assert (low - ref).abs().max() < 0.1  # bf16 compute, same image


def test_ratio_zero_and_removal_reproduce_unmerged_images_bit_exactly(model):
    ref = tinyldm.sample(model, [0, 2], seed=3, steps=3, size=32)
    for opts in ({"ratio": 0.0}, {"method": "downsample", "downsample_factor": 1}):
        tome.apply_patch(model, **opts)
        try:
            assert torch.equal(tinyldm.sample(model, [0, 2], seed=3, steps=3, size=32), ref)
        finally:
            tome.remove_patch(model)
    tome.apply_patch(model, ratio=0.5)
    merged = tinyldm.sample(model, [0, 2], seed=3, steps=3, size=32)
    tome.remove_patch(model)
    assert not torch.equal(merged, ref)
    assert torch.equal(tinyldm.sample(model, [0, 2], seed=3, steps=3, size=32), ref)


def test_quality_worsens_with_the_ratio(model):
    settings = parse_settings(["merge:0.25", "merge:0.75", "downsample:2", "downsample:4"])
    heldout = _heldout()
    # t=100: the last, detailed steps, where merging's effect on the loss is largest.
    rows = quality.evaluate(model, settings, [(0, 0), (1, 1)], steps=6, size=32,
                            heldout=heldout, timesteps=(100,))
    by = {r["setting"]: r for r in rows}
    base = by["unmerged"]
    assert base["mse"] == 0 and math.isinf(base["psnr"]) and base["ssim"] == pytest.approx(1)
    for low, high in (("merge 0.25", "merge 0.75"), ("downsample x2", "downsample x4")):
        assert 0 < by[low]["mse"] < by[high]["mse"]
        assert by[low]["psnr"] > by[high]["psnr"] and by[low]["ssim"] > by[high]["ssim"]
        if heldout is not None:
            assert 0 < by[high]["loss_increase"][100]
            assert by[low]["loss_increase"][100] < by[high]["loss_increase"][100]
    assert all(r["speedup"] > 0 for r in rows)
    table = report.quality_table(rows)
    assert table.count("\n") == len(rows) + 1 and "merge 0.75" in table


def _heldout():
    """The held-out crops if the photos are already cached (no download from a test)."""
    from tome_lab.tinyldm import data

    if not (data.default_cache_dir() / f"photos{data.SHORT_SIDE}.npz").is_file():
        return None  # only the image figures are checked
    return data.heldout_batch(8, 32, seed=0)


def test_showcase_quick_writes_grid_plot_and_table(model, tmp_path, capsys):
    assert showcase.main(["--quick", "--heldout", "0", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| merge 0.5 |" in printed and "grid.png" in printed
    from PIL import Image

    with Image.open(tmp_path / "grid.png") as im:
        assert im.width > 3 * 96 and im.height > 2 * 96  # 3 settings x 2 images, upscaled
    assert (tmp_path / "quality_vs_speed.png").stat().st_size > 10_000
    table = (tmp_path / "table.md").read_text()
    assert "downsample x2" in table
    assert "; dtype fp32: " in table or "; dtype bf16: " in table  # the choice and its reason


def test_equal_speed_interpolates_from_the_unmerged_point():
    def row(setting, group, speedup, mse, ssim):
        return {"setting": setting, "group": group, "unmerged": not group, "speedup": speedup,
                "mse": mse, "ssim": ssim}

    rows = [row("unmerged", "", 1.0, 0.0, 1.0), row("merge 0.5", "merge", 2.0, 1e-3, 0.9),
            row("downsample x2", "downsample", 3.0, 1e-4, 0.99)]
    pts = {(p["group"], p["speedup"]): p for p in quality.at_equal_speed(rows, (1.5, 2.5))}
    assert pts["merge", 1.5]["mse"] == pytest.approx(5e-4)
    assert pts["merge", 1.5]["psnr"] == pytest.approx(10 * math.log10(1 / 5e-4))
    assert pts["merge", 1.5]["ssim"] == pytest.approx(0.95)
    assert "mse" not in pts["merge", 2.5]  # never extrapolated
    assert pts["downsample", 2.5]["mse"] == pytest.approx(0.75e-4)
    table = report.equal_speed_table(rows, (1.5, 2.5))
    assert "| merge | 33.0 dB, SSIM 0.9500 | – (not that fast) |" in table
