"""What ``pip install`` users get: the library only. The lab (``tome_lab/``: benchmarks, the demo,
the tiny models' weights) stays in the repository, so a wheel is small and imports nothing of it.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _wheel(tmp_path: pathlib.Path) -> pathlib.Path:
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("the build needs setuptools >= 77 (PEP 639 license field)")
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", ".git", "out", "*.egg-info", "__pycache__", ".hypothesis", ".ruff_cache",
        "build", "dist"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(src), "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    return wheel


def test_the_wheel_ships_the_library_only_and_patches_a_unet(tmp_path):
    wheel = _wheel(tmp_path)
    assert wheel.stat().st_size < 1 << 20, wheel.stat().st_size
    names = zipfile.ZipFile(wheel).namelist()
    assert not [n for n in names if n.startswith("tome_lab") or n.endswith(".safetensors")]
    assert "tome/__init__.py" in names and "tome/comfy/nodes.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import importlib.util, tome\n"
        "from diffusers import UNet2DConditionModel\n"
        f"assert tome.__file__.startswith({str(site)!r}), tome.__file__\n"
        "assert importlib.util.find_spec('tome_lab') is None\n"
        "u = UNet2DConditionModel(block_out_channels=(32, 64), layers_per_block=1,\n"
        "    down_block_types=('CrossAttnDownBlock2D', 'DownBlock2D'),\n"
        "    up_block_types=('UpBlock2D', 'CrossAttnUpBlock2D'), cross_attention_dim=32,\n"
        "    attention_head_dim=8, sample_size=32)\n"
        "tome.apply_patch(u, ratio=0.5)\n"
        "print(tome.patch_report(u).summary())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "blocks patched" in out.stdout
