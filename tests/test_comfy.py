"""The ComfyUI node pack (``tome/comfy/`` and the root ``__init__.py``) against a stand-in of
ComfyUI 0.8.0's contract (``tests/comfy_stub``: ModelPatcher, one UNet call with its wrappers
and blocks, the DiT call form, the built-in TomePatchModel, progress bar, user directory)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

import comfy.utils  # noqa: E402
import folder_paths  # noqa: E402
from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingDiscrete, ModelSamplingFlux  # noqa: E402
from comfy.sampling import DiTModel, comfy_blocks, ksample, unet_call  # noqa: E402
from comfy_extras import nodes_hypertile, nodes_tomesd  # noqa: E402
from comfy_node import defaults  # noqa: E402
from models import TINY_SD15, TINY_SDXL, ldm_inputs, ldm_unet  # noqa: E402
from stubs import fake_clock  # noqa: E402

from tome import (  # noqa: E402
    dits,  # noqa: E402
    kv,
    override,
)
from tome import modelpatcher as mp  # noqa: E402
from tome.comfy import host, inputs, measure_node, nodes  # noqa: E402
from tome.config import FIELDS, ToMeConfig, choices, preset  # noqa: E402
from tome.patcher import Attn1Patch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def model(config=TINY_SD15):
    m = torch.nn.Module()
    m.diffusion_model = comfy_blocks(ldm_unet(config))
    m.model_sampling = ModelSamplingDiscrete()
    return ModelPatcher(m)


def run(patcher, sigma=14.6146, size=32):
    x, t, ctx = ldm_inputs(2, size, size)
    return unet_call(patcher, x, t, ctx, sigma)


def test_inputs_come_from_the_config_metadata():
    spec = inputs.input_types()
    assert list(spec["required"]) == ["model", "preset", *inputs.MAIN]
    assert list(spec["optional"]) == list(inputs.ADVANCED)
    for name in (*inputs.MAIN, *inputs.ADVANCED):
        kind, opts = spec["required"].get(name) or spec["optional"][name]
        meta = FIELDS[name].metadata
        assert opts["tooltip"] == meta["help"]
        if "choices" in meta:
            assert kind == [str(c) for c in choices(name)]
        elif "maximum" in meta:
            assert (opts["min"], opts["max"], opts["step"]) == \
                (meta["minimum"], meta["maximum"], meta["step"])
    assert spec["required"]["max_downsample"][0] == ["auto", "1", "2", "4", "8"]
    assert spec["required"]["method"][0] == ["merge", "downsample"]
    assert spec["required"]["ratio"][1]["max"] <= 1 - 1 / 64
    assert inputs.config(defaults()) == ToMeConfig(policy="auto")
    assert inputs.config(defaults(preset="fast", seed=7)).replace(seed=0) == \
        preset("fast")  # the library's preset where the inputs are left at their defaults
    assert inputs.config(defaults(preset="fast", ratio=0.1)) == preset("fast", ratio=0.1)
    assert inputs.config(defaults(preset="fast", seed=7)).seed == 7
    # no "control after generate" widget: re-queueing must not change the destinations
    assert spec["required"]["seed"][1]["control_after_generate"] is False


def test_clone_merges_reproducibly_and_the_input_is_untouched(lines):
    base = model()
    before = json.dumps(base.model_options, default=str)
    plain = run(base)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(policy="fixed", seed=3))
    assert ours is not base and json.dumps(base.model_options, default=str) == before
    assert not base.wrappers
    a, b = run(ours), run(ours)
    assert not torch.equal(a, plain) and torch.equal(a, b)
    (again,) = nodes.ToMePatch().patch(base, **defaults(policy="fixed", seed=3))
    assert torch.equal(run(again), a)
    (other,) = nodes.ToMePatch().patch(base, **defaults(policy="fixed", seed=4))
    assert not torch.equal(run(other), a)
    assert lines == ["ToMe: comfy UNet, ratio 0.5; ratio 0.5 at downsample <= 1"] * 3


def test_downsample_method_and_sdxl_at_downsample_2(lines):
    base = model(TINY_SDXL)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(method="downsample", policy="fixed"))
    assert not torch.equal(run(ours), run(base))
    assert "at downsample <= 2" in lines[-1]


def test_clones_share_one_patch():
    """ComfyUI deep-copies model_options on clone: the patch is shared, not copied."""
    (ours,) = nodes.ToMePatch().patch(model(), **defaults(policy="fixed"))
    (patch,), _ = mp.carried(ours)
    (copied,), _ = mp.carried(ours.clone())
    assert copied is patch
    guard = ours.wrappers["apply_model"][nodes.GUARD_KEY][0]  # 0.8.0's name
    assert copy.deepcopy(guard) is guard


def _sample_with(wrapper):
    """A KSampler run (4 steps) of the node's model with ``wrapper`` as a ``diffusion_model``
    wrapper added after it, and the outputs."""
    (ours,) = nodes.ToMePatch().patch(model(), **defaults(policy="fixed"))
    ours = ours.clone()
    ours.add_wrapper_with_key("diffusion_model", "theirs", wrapper)
    x, _, ctx = ldm_inputs(2, 32, 32)
    return ksample(ours, x, ctx, steps=4)


def test_a_unet_whose_blocks_never_call_the_patch_is_said_once(lines):
    """A node after ours that drops the attn1 patches from each call: one line, at the first
    call, never again."""
    def drop(executor, *args, **kwargs):
        args = list(args)
        args[5] = {**args[5], "patches": {}}  # UNetModel's transformer_options
        return executor(*args, **kwargs)

    _sample_with(drop)
    assert lines.count(Attn1Patch.SILENT) == 1


def test_a_step_cache_skipping_later_calls_is_not_a_patch_never_called(lines):
    """A step cache (a ``diffusion_model`` wrapper) that answers every call after the first
    without running the blocks: the sampling's first call reached the patch, so no line says
    it was never called."""
    kept = []

    def cache(executor, *args, **kwargs):
        if not kept:
            kept.append(executor(*args, **kwargs))
        return kept[0]

    _sample_with(cache)
    assert Attn1Patch.SILENT not in lines


def test_worker_threads_sampling_one_patch_at_once_each_get_their_own_call():
    """ComfyUI's MultiGPU runs each device's share of a step in a worker thread, with one
    patch (clones share it): two threads calling the UNet at once, at two sizes, each get
    the output of a call made alone (the call, its replacements and the plan between attn1
    and its output are per thread, ``patcher.LIVE``)."""
    import threading

    (ours,) = nodes.ToMePatch().patch(model(), **defaults(policy="fixed"))
    inputs = {size: ldm_inputs(2, size, size) for size in (32, 24)}
    alone = {size: unet_call(ours, x, t, ctx) for size, (x, t, ctx) in inputs.items()}
    got, errors = {}, []

    def worker(size):
        try:
            x, t, ctx = inputs[size]
            got[size] = [unet_call(ours, x, t, ctx) for _ in range(3)]
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(size,)) for size in inputs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    for size, outs in got.items():
        assert all(torch.equal(out, alone[size]) for out in outs)


def test_a_model_it_cannot_read_passes_through_with_one_line(lines):
    """A DiT with no reader (the stand-in's generic ``DiTModel``): named, passed through."""
    m = torch.nn.Module()
    m.diffusion_model = DiTModel()
    dit = ModelPatcher(m)
    (out,) = nodes.ToMePatch().patch(dit, **defaults())
    assert out is dit and len(lines) == 1
    assert lines[0].startswith("ToMe: DiTModel has no UNet transformer blocks to merge and is "
                               "not a DiT it can pool")
    assert lines[0].endswith("; the model passes through unchanged")


def test_the_dit_call_form_is_answered_with_a_dict():
    """A patch of ours reaching a DiT block (a model swapped under a patched clone) changes
    nothing there instead of failing on the keyword call."""
    (ours,) = nodes.ToMePatch().patch(model(), **defaults(policy="fixed"))
    dit = DiTModel()
    options = {"patches": ours.model_options["transformer_options"]["patches"]}
    txt, img = torch.randn(2, 3, 8), torch.randn(2, 16, 8)
    torch.testing.assert_close(dit(txt, img, options), dit(txt, img, {}))


def test_settings_that_merge_nothing_pass_through(lines):
    base = model(TINY_SDXL)
    (out,) = nodes.ToMePatch().patch(base, **defaults(max_downsample="1"))
    assert out is base and "merges nothing" in lines[0] and len(lines) == 1


@pytest.mark.parametrize("changes, name", [
    ({"ratio": 0.9}, "ratio"), ({"start": 0.8, "end": 0.2}, "start"),
    ({"method": "bogus"}, "method"), ({"preset": "turbo"}, "preset"),
])
def test_bad_settings_are_a_clear_error_and_leave_no_patch(changes, name):
    base = model()
    with pytest.raises(ValueError, match=f"ToMe: .*{name}"):
        nodes.ToMePatch().patch(base, **defaults(**changes))
    assert base.model_options == {"transformer_options": {}}


def test_builtin_tome_before_ours_is_taken_over(lines):
    base = model()
    (builtin,) = nodes_tomesd.TomePatchModel().execute(base, 0.5)
    (ours,) = nodes.ToMePatch().patch(builtin, **defaults(method="downsample",
                                                          policy="fixed"))
    assert "built-in TomePatchModel" in lines[0] and len(lines) == 2
    nodes_tomesd.CALLS.clear()
    out = run(ours)
    assert not nodes_tomesd.CALLS
    (alone,) = nodes.ToMePatch().patch(base, **defaults(method="downsample", policy="fixed"))
    assert torch.equal(out, run(alone))
    assert len(builtin.model_options["transformer_options"]["patches"]["attn1_patch"]) == 1


def test_builtin_tome_after_ours_is_ignored_with_one_line(lines):
    base = model()
    (ours,) = nodes.ToMePatch().patch(base, **defaults(method="downsample", policy="fixed"))
    expected = run(ours)
    (builtin,) = nodes_tomesd.TomePatchModel().execute(ours, 0.5)
    nodes_tomesd.CALLS.clear()
    assert torch.equal(run(builtin), expected) and torch.equal(run(builtin), expected)
    assert not nodes_tomesd.CALLS
    assert sum("added after this ToMe node" in line for line in lines) == 1
    (plain,) = nodes_tomesd.TomePatchModel().execute(base, 0.5)  # alone, it merges
    run(plain)
    assert nodes_tomesd.CALLS


def test_ours_twice_merges_once(lines):
    base = model()
    (first,) = nodes.ToMePatch().patch(base, **defaults(policy="fixed", ratio=0.3))
    (second,) = nodes.ToMePatch().patch(first, **defaults(policy="fixed", ratio=0.6))
    (patch,), foreign = mp.carried(second)
    assert not foreign and patch.config.ratio == 0.6
    assert "an earlier ToMe node's patch" in lines[1]
    (direct,) = nodes.ToMePatch().patch(base, **defaults(policy="fixed", ratio=0.6))
    assert torch.equal(run(second), run(direct))


def test_a_block_whose_attn1_another_node_replaces_is_left_alone(lines):
    """Self-Attention Guidance records the middle block's attention through an attn1
    replacement on a clone of ours: that block must see every token."""
    (ours,) = nodes.ToMePatch().patch(model(), **defaults(policy="fixed", max_downsample="8"))
    sag = ours.clone()
    seen = []

    def record(q, k, v, extra):
        seen.append(q.shape[1])
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    sag.set_model_attn1_replace(record, "middle", 0, 0)
    run(sag)
    assert seen == [4 * 4]  # the 32x32 latent's middle block (ds8), unmerged
    (patch,), _ = mp.carried(sag)
    assert patch.skipped and patch.skipped[0][0] == ("middle", 0, 0)


def test_hypertile_before_or_after_ours_never_fails():
    """HyperTile splits a full-resolution block's queries into tiles: a tile looks like a
    deeper level's grid to a patch after it, so ours leaves tiled blocks alone; before it,
    ours merges and HyperTile finds no full-resolution block to tile."""
    base = model()
    (tiled,) = nodes_hypertile.HyperTile().execute(base)
    (ours,) = nodes.ToMePatch().patch(tiled, **defaults(policy="fixed", max_downsample="2"))
    run(ours)
    (patch,), _ = mp.carried(ours)
    assert patch.skipped and "tiles" in patch.skipped[0][1]
    (first,) = nodes.ToMePatch().patch(base, **defaults(policy="fixed"))
    (after,) = nodes_hypertile.HyperTile().execute(first)
    assert torch.equal(run(after), run(first))


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("TOME_CACHE_DIR", raising=False)
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path))
    monkeypatch.setattr(host, "_services", [])
    return tmp_path


def test_auto_policy_measures_in_the_first_call_with_cache_and_progress(user_dir, lines):
    assert host.cache_path() == user_dir / "tome" / "measurements.json"
    host.measuring_service().clock = fake_clock(2.0)
    comfy.utils.EVENTS.clear()
    (ours,) = nodes.ToMePatch().patch(model(), **defaults())
    run(ours)
    run(ours)
    measured = [line for line in lines if line.startswith("ToMe: measured 256x256 px")]
    auto = [line for line in lines if line.startswith("ToMe auto: 256x256 px")]
    assert len(measured) == 1 and len(auto) == 1 and "ds1 2.00x merged" in measured[0]
    assert comfy.utils.EVENTS == [(0, 1), (1, 1)]
    assert (user_dir / "tome" / "measurements.json").exists()


def test_measure_node_returns_a_table_and_an_image(user_dir, lines):
    host.measuring_service().clock = fake_clock(1.5)
    out = nodes.ToMeMeasure().measure(model(), "128, 256")
    text, image = out["result"]
    assert out["ui"]["text"] == [text]
    assert "merge" in text and "downsample" in text and "256x256" in text and "1.50x" in text
    assert image.shape[0] == 1 and image.shape[-1] == 3 and image.dtype == torch.float32
    assert 0.0 <= float(image.min()) and float(image.max()) <= 1.0 and image.std() > 0
    m = torch.nn.Module()
    m.diffusion_model = DiTModel()
    text, image = nodes.ToMeMeasure().measure(ModelPatcher(m), "512")["result"]
    assert "nothing to measure" in text and image.shape[-1] == 3
    with pytest.raises(ValueError, match="invalid size"):
        nodes.ToMeMeasure().measure(model(), "512, big")
    with pytest.raises(ValueError, match="multiple of 8"):
        measure_node.parse_sizes("500")


def _load_pack(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Import the repository as ComfyUI imports a custom node folder, in a fresh Python."""
    load = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('tome_pack', {str(ROOT / '__init__.py')!r},"
        f" submodule_search_locations=[{str(ROOT)!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['tome_pack'] = m\n"
        "spec.loader.exec_module(m)\n")
    env = {**os.environ, "PYTHONPATH": STUB}
    show = ("print(sorted(getattr(m, 'NODE_CLASS_MAPPINGS', None) or m.__all__),"
            " sys.modules['tome'].__file__)")
    return subprocess.run([sys.executable, "-c", code + load + show],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_the_repository_loads_as_a_custom_node_pack(tmp_path):
    done = _load_pack("", tmp_path)
    assert done.returncode == 0, done.stderr
    assert "['WEB_DIRECTORY', 'comfy_entrypoint']" in done.stdout  # the stub has the V3 schema
    assert str(ROOT / "tome" / "__init__.py") in done.stdout
    other = tmp_path / "tome"
    other.mkdir()
    (other / "__init__.py").write_text("")
    done = _load_pack("import sys; sys.path.insert(0, '.'); import tome\n", tmp_path)
    assert done.returncode != 0 and "was imported from" in done.stderr


def test_pyproject_has_the_registry_table():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    comfy_table = data["tool"]["comfy"]
    assert comfy_table["PublisherId"] and comfy_table["DisplayName"]
    assert "comfyui" not in data["project"]["name"].lower()  # a registry rule
    assert data["project"]["dependencies"] == ["torch>=2.0"]  # nothing ComfyUI lacks
    assert comfy_table["requires-comfyui"] == ">=0.8.0"  # comfy-cli reads it in [tool.comfy]
    # the icon the registry will show (its URL is set on publishing): a small square SVG
    import xml.etree.ElementTree as ET
    svg = ET.parse(ROOT / "docs" / "icon.svg").getroot()
    assert svg.tag.endswith("svg") and svg.get("width") == svg.get("height")
    _, _, w, h = svg.get("viewBox").split()
    assert w == h and (ROOT / "docs" / "icon.svg").stat().st_size < 4096


# ----------------------------------------------------------------------------- DiTs

LATENTS = {"flux": (1, 4, 16, 24), "qwen": (1, 4, 1, 16, 24), "wan": (1, 4, 3, 16, 24),
           "aura": (1, 4, 16, 24), "sd3": (1, 4, 16, 24), "hunyuan": (1, 4, 3, 16, 24)}
FAMILY_NAMES = {"flux": "comfy flux", "qwen": "comfy qwen-image", "wan": "comfy wan"}
FIXED = {"method": "downsample", "policy": "fixed"}


def dit_model(family="flux", **kw):
    """ComfyUI 0.8.0's Flux, Qwen-Image or Wan 2.1 (tiny stand-ins) behind a ModelPatcher,
    with their model sampling (Flux and Qwen-Image: shift 1.15; Wan: discrete flow, shift
    8), AuraFlow (shift 1.73, timestep = sigma), SD3 (shift 3) and HunyuanVideo (shift
    7)."""
    from comfy.ldm.aura.mmdit import MMDiT
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.hunyuan_video.model import HunyuanVideo
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    from comfy.ldm.wan.model import WanModel
    from comfy.model_base import BaseModel
    from comfy.model_sampling import ModelSamplingDiscreteFlow
    torch.manual_seed(0)
    net, sampling = {
        "flux": (Flux, lambda: ModelSamplingFlux(shift=1.15)),
        "qwen": (QwenImageTransformer2DModel, lambda: ModelSamplingFlux(shift=1.15)),
        "wan": (WanModel, lambda: ModelSamplingDiscreteFlow(shift=8.0)),
        "aura": (MMDiT, lambda: ModelSamplingDiscreteFlow(shift=1.73, multiplier=1.0)),
        "sd3": (OpenAISignatureMMDITWrapper, lambda: ModelSamplingDiscreteFlow(shift=3.0)),
        "hunyuan": (HunyuanVideo, lambda: ModelSamplingDiscreteFlow(shift=7.0))}[family]
    return ModelPatcher(BaseModel(net(**kw).eval(), sampling()))


def sample(patcher, family="flux", seed=0, steps=4, sigmas=None, latent=None, **conds):
    """A KSampler run (Euler, cfg 1) from seeded noise and text, with the model's "simple"
    sigmas (Flux 4 steps: 1.0, 0.905, 0.760, 0.513; Wan: 1.0, 0.96, 0.889, 0.727)."""
    from comfy.model_sampling import simple_sigmas
    from comfy.sampling import dit_sample
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(latent or LATENTS[family], generator=g)
    ctx = torch.randn(1, 5, 12, generator=g)
    if sigmas is None:
        sigmas = simple_sigmas(patcher.get_model_object("model_sampling"), steps)
    with torch.no_grad():
        return dit_sample(patcher, noise, ctx, sigmas, **conds)


def one_call(patcher, sigma, family="flux"):
    """The denoised latent of one model call at ``sigma`` (a sampler's step to 0)."""
    return sample(patcher, family, sigmas=torch.tensor([float(sigma), 0.0]))


def spy(monkeypatch, family="flux"):
    """The key lengths each attention call of ``family`` hands the backend (the module global
    its model bound at import, replaced by a wrapped backend of the same name)."""
    import comfy.ldm.flux.math
    import comfy.ldm.qwen_image.model
    import comfy.ldm.wan.model
    from comfy.ldm.modules import attention as comfy_attention
    seen = []

    @comfy_attention.wrap_attn
    def attention_pytorch(q, k, v, heads, mask=None, **kw):
        seen.append(k.shape[2 if kw.get("skip_reshape") else 1])
        return comfy_attention.attention_pytorch.__wrapped__(q, k, v, heads, mask, **kw)

    module, name = {"flux": (comfy.ldm.flux.math, "optimized_attention"),
                    "qwen": (comfy.ldm.qwen_image.model, "optimized_attention_masked"),
                    "wan": (comfy.ldm.wan.model, "optimized_attention")}[family]
    monkeypatch.setattr(module, name, attention_pytorch)
    return seen


def close(a, b, tol=0.2):
    return bool(torch.isfinite(a).all()) and float((a - b).norm() / b.norm()) < tol


FAMILIES = ["flux", "qwen", "wan"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_comfy_dit_is_pooled_through_the_attention_override(lines, monkeypatch, family):
    """ComfyUI 0.8.0's blocks never call attn1 patches; every family reaches attention
    through the override: pooled, finite, close; the same seed gives the same latent; the
    input MODEL (no node) stays bit-identical."""
    base = dit_model(family)
    ref = sample(base, family)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    assert ours is not base and not base.wrappers
    assert lines[-2].startswith(f"ToMe: {FAMILY_NAMES[family]} DiT, downsample x2; 2/2 "
                                "blocks pooled" if family != "flux" else
                                "ToMe: comfy flux DiT, downsample x2; 4/4 blocks pooled")
    assert lines[-1].startswith("ToMe DiT: x2 in all blocks; proportional attention; rope "
                                "before (this ComfyUI form cannot apply: rope pooled")
    seen = spy(monkeypatch, family)
    out = sample(ours, family)
    pooled = {"flux": 5 + 4 * 6, "qwen": 5 + 4 * 6, "wan": 3 * 4 * 6}[family]
    if family == "wan":  # its cross-attention (keys of the 5 text tokens) passes through
        assert set(seen) == {pooled, 5} and seen.count(5) == seen.count(pooled)
    else:
        assert set(seen) == {pooled}
    assert not torch.equal(out, ref) and close(out, ref)
    assert torch.equal(sample(ours, family), out)
    assert torch.equal(sample(base, family), ref)
    assert getattr(ours, mp.MARK).counts() == (8, 8, 8, 8, 8) and len(lines) == 4
    assert lines[2] == lines[3] and lines[2].startswith("ToMe: pooled ")  # one per sampling


def test_a_graph_without_the_node_after_one_with_it_is_bit_identical(lines):
    base = dit_model()
    before = sample(base)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    sample(ours)
    assert torch.equal(sample(base), before)
    assert not override.carried(base) and getattr(base, mp.MARK, None) is None


def test_an_override_already_there_is_chained_with_the_pooled_tensors(lines, monkeypatch):
    """A SageAttention node (KJNodes' way: its override ignores ``func`` and calls its
    kernel, which drops masks) set before or after ours: ours calls it with the pooled keys,
    the bias riding on an extra channel; the latent is the one ours gives alone."""
    from comfy.ldm.modules import attention as comfy_attention
    got = []

    def sage_override(func, *args, **kwargs):
        got.append(args[1].shape[2])
        return comfy_attention.attention_sage.__wrapped__(*args, **kwargs)

    base = dit_model()
    (alone,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    expected = sample(alone)
    sage = base.clone()
    sage.model_options["transformer_options"][override.OVERRIDE] = sage_override
    (ours,) = nodes.ToMePatch().patch(sage, **defaults(**FIXED))
    torch.testing.assert_close(sample(ours), expected, atol=1e-4, rtol=1e-4)
    assert got and set(got) == {5 + 4 * 6}
    later = alone.clone()  # installed after ours, at graph time
    later.model_options["transformer_options"][override.OVERRIDE] = sage_override
    got.clear()
    torch.testing.assert_close(sample(later), expected, atol=1e-4, rtol=1e-4)
    assert set(got) == {5 + 4 * 6}


def test_a_non_chaining_override_installed_after_ours_is_said(lines):
    """A node that sets its own override inside the call, after ours, without calling it:
    nothing is pooled, and after each sampling one line says so (what happened, not what
    was installed)."""
    from comfy.ldm.modules import attention as comfy_attention

    def theirs(func, *args, **kwargs):
        return comfy_attention.attention_pytorch.__wrapped__(*args, **kwargs)

    def replace(executor, *args, **kwargs):
        args = list(args)
        args[7] = {**args[7], override.OVERRIDE: theirs}  # Flux's transformer_options
        return executor(*args, **kwargs)

    base = dit_model()
    plain = base.clone()
    plain.add_wrapper_with_key("diffusion_model", "theirs", replace)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    after = ours.clone()
    after.add_wrapper_with_key("diffusion_model", "theirs", replace)
    told = len(lines)
    assert torch.equal(sample(after), sample(plain))
    assert lines[told:] == ["ToMe: not pooled in this sampling (4 model calls): the attention "
                            "override was installed but never called (a node after this ToMe "
                            "node replaced ComfyUI's optimized_attention_override without "
                            "calling it)"]
    sample(after)
    assert len(lines) == told + 2 and lines[-1] == lines[-2]
    assert override.OverridePatch.SILENT not in lines  # said once, after the sampling


def test_reference_latents_stay_unpooled(lines, monkeypatch):
    """Kontext: a reference latent's tokens follow the image's; only the image is pooled."""
    base = dit_model()
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    seen = spy(monkeypatch)
    ref = torch.randn(1, 4, 8, 12)
    out = sample(ours, ref_latents=[ref])
    assert set(seen) == {5 + 4 * 6 + 4 * 6}
    assert close(out, sample(base, ref_latents=[ref]))


def test_wan_reference_latent_and_text_as_long_as_the_video(lines, monkeypatch):
    """Wan with ``ref_conv``: the reference latent's tokens come first, unpooled; Wan 2.2's
    image-to-video frame (a ``denoise_mask``) stays whole. A video
    whose token count equals the text length cannot be told from cross-attention by its
    lengths: nothing is pooled there."""
    base = dit_model("wan", ref_conv=True)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    seen = spy(monkeypatch, "wan")
    ref = torch.randn(1, 4, 16, 24)
    out = sample(ours, "wan", reference_latent=ref)
    assert 8 * 12 + 3 * 4 * 6 in seen
    assert close(out, sample(base, "wan", reference_latent=ref))
    seen.clear()
    sample(ours, "wan", denoise_mask=torch.ones(1, 1, 3, 16, 24))  # Wan 2.2 TI2V: frame 0 whole
    assert set(seen) == {8 * 12 + 2 * 4 * 6, 5}
    tiny = (1, 4, 1, 2, 10)  # 1 x 1 x 5 video tokens: as many as the text's
    assert torch.equal(sample(ours, "wan", latent=tiny), sample(base, "wan", latent=tiny))


def test_wan_time_cells_through_the_node(lines, monkeypatch):
    """The node's ``temporal`` on ComfyUI's Wan: 3 frames of 8x12 tokens in 2 frame cells of
    4x6 (one pair, the last frame alone); Wan 2.2 TI2V's image frame (a ``denoise_mask``)
    stays whole and the pair after it is pooled together."""
    base = dit_model("wan")
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, temporal=2))
    seen = spy(monkeypatch, "wan")
    out = sample(ours, "wan")
    assert set(seen) == {2 * 4 * 6, 5}
    assert close(out, sample(base, "wan"))
    seen.clear()
    sample(ours, "wan", denoise_mask=torch.ones(1, 1, 3, 16, 24))
    assert set(seen) == {8 * 12 + 4 * 6, 5}


def test_calls_a_family_cannot_place_are_not_pooled():
    """HunyuanVideo has Flux's blocks but a 3-D patch and [image, text] (no longer read as
    Flux: below); Flux's reading of such a call places nothing rather than the wrong
    tokens."""
    from types import SimpleNamespace

    from tome import adapters
    flux_spans = adapters.comfy_spans("comfy flux")
    hunyuan = SimpleNamespace(patch_size=[1, 2, 2])
    assert flux_spans(hunyuan, torch.zeros(1, 16, 3, 8, 8), torch.zeros(1, 5, 12), {}) is None
    flux = SimpleNamespace(patch_size=2)
    assert flux_spans(flux, torch.zeros(1, 16, 7, 9), torch.zeros(1, 5, 12),
                      {"ref_latents": [torch.zeros(1, 16, 4, 4)]}) == \
        kv.Spans(5, True, 0, 1, 4, 5, 4)
    assert flux_spans(flux, torch.zeros(1, 16, 8, 8), None, {}) is None


NOT_READ = ("has no UNet transformer blocks to merge and is not a DiT it can pool",
            f"; {nodes.PASSES}")


@pytest.mark.parametrize("family", ["aura", "sd3", "hunyuan"])
def test_auraflow_sd3_and_hunyuan_video_are_claimed_by_their_own_families(lines, family):
    """AuraFlow's model class is called ``MMDiT``, as A1111's SD3 is, with none of its
    structure (the node used to raise ``AttributeError: 'MMDiT' object has no attribute
    'x_embedder'``); ComfyUI's SD3 (the reference MMDiT A1111 runs too, called with
    ``transformer_options``) was taken for A1111's SD3 and got an attn1 patch its blocks never
    call; HunyuanVideo (Flux's blocks, a 3-D patch, [image, text]) was read as Flux, whose
    spans place none of its calls. Each is read by its own ComfyUI family now and pooled
    (``tests/test_comfy_families.py`` checks their calls against references)."""
    base = dit_model(family)
    ref = sample(base, family)
    (out,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    name = {"aura": "comfy auraflow", "sd3": "comfy sd3", "hunyuan": "comfy hunyuan-video"}
    assert out is not base and lines[0].startswith(f"ToMe: {name[family]} DiT, downsample x2")
    pooled = sample(out, family)
    assert not torch.equal(pooled, ref) and close(pooled, ref)
    assert lines[-1].startswith("ToMe: pooled ")


@pytest.mark.parametrize("fails", ["recognise", "read"])
def test_a_family_that_fails_on_a_model_passes_it_through(lines, fails):
    """Defence in depth: any exception in a family's ``recognise`` or ``read`` passes the
    model through with its line (naming what failed, for read) instead of failing the
    prompt; a failing ``recognise`` leaves the other families to read the model."""
    from tome import dits
    from tome.dits import Family

    def broken(model):
        raise KeyError("no such weight")

    def everything(model):
        return True

    toy = Family("toy broken", broken if fails == "recognise" else everything, broken)
    dits.REGISTRY = {toy.name: toy, **dits.REGISTRY}  # tried first
    try:
        from comfy.model_base import BaseModel
        base = ModelPatcher(BaseModel(torch.nn.Linear(2, 2), ModelSamplingFlux()))  # no DiT
        (out,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
        assert out is base and len(lines) == 1 and lines[0].endswith(NOT_READ[1])
        if fails == "read":
            assert "it looked like toy broken but could not be read as one (KeyError: " \
                "'no such weight')" in lines[0]
        flux = dit_model()
        (out,) = nodes.ToMePatch().patch(flux, **defaults(**FIXED))
        assert (out is not flux) == (fails == "recognise")  # read by comfy flux after all
    finally:
        dits.unregister(toy.name)


def test_not_pooled_after_a_sampling_says_why(lines, monkeypatch):
    """The node's line says what was installed; after a sampling where no call was pooled, one
    line says so and why (counted per model call in the apply_model wrapper: Python ints, no
    tensor read); a sampling that pooled says nothing more."""
    base = dit_model()
    (late,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, start=0.99))
    told = len(lines)
    sample(late)
    assert lines[told:] == ["ToMe: steps 0.99-1 (sigma <= 0.0309): merging in 0 of 4 steps",
                            "ToMe: not pooled in this sampling (4 model calls): no step was "
                            "pooled by the settings (the step window or the auto policy)"]
    flux = dits.REGISTRY["comfy flux"]  # its call reading placing nothing
    monkeypatch.setitem(dits.REGISTRY, "comfy flux", dataclasses.replace(
        flux, host=dits.HostPoint(dits.COMFYUI, lambda *a: None)))
    (unplaced,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    told = len(lines)
    assert torch.equal(sample(unplaced), sample(base))
    assert lines[told:] == ["ToMe: not pooled in this sampling (4 model calls): comfy flux "
                            "cannot place this model's tokens (its latent or text is not laid "
                            "out as that family's are)"]
    monkeypatch.undo()
    (ours,) = nodes.ToMePatch().patch(late, **defaults(**FIXED))  # replaces the earlier node
    told = len(lines)
    sample(ours)
    assert lines[told:] == [] and getattr(ours, mp.MARK).counts()[-1] == 4


def test_the_line_after_a_sampling_starts_on_its_own_line_in_a_log(monkeypatch):
    """In ComfyUI's log (stdout and stderr into one file, each buffered on its own) the line
    said after a sampling used to continue the closed bar's (``3/3 [00:04<00:00,
    1.47s/it]ToMe: not pooled ...``): the bar's last newline was still in stderr's buffer."""
    import io

    from tqdm import tqdm

    from tome import console
    log = io.BytesIO()
    shared = io.BufferedWriter(log)
    out, err = (io.TextIOWrapper(shared, encoding="utf-8", write_through=False)
                for _ in range(2))
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    for _ in tqdm(range(3), file=err):
        pass
    console.line("ToMe: not pooled")
    err.flush()
    text = log.getvalue().decode()
    assert "3/3" in text and text.endswith("]\nToMe: not pooled\n")


def test_merge_on_a_dit_passes_through_with_one_line(lines):
    base = dit_model()
    (out,) = nodes.ToMePatch().patch(base, **defaults(method="merge"))
    assert out is base and "merge has no DiT form" in lines[-1] and "passes through" in lines[-1]


def test_ours_twice_on_a_dit_pools_once(lines):
    base = dit_model()
    (first,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, downsample_factor=4))
    (second,) = nodes.ToMePatch().patch(first, **defaults(**FIXED))
    assert len(second.wrappers["apply_model"]["tome"]) == 1
    assert "an earlier ToMe node's patch" in lines[2]
    (direct,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    assert torch.equal(sample(second), sample(direct))


def test_dit_blocks_setting_and_window(lines):
    base = dit_model()
    (doubles,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, blocks="double"))
    (late,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, start=0.5))
    assert not torch.equal(one_call(doubles, 0.9), one_call(base, 0.9))
    assert torch.equal(one_call(late, 0.9), one_call(base, 0.9))  # before the window
    assert not torch.equal(one_call(late, 0.2), one_call(base, 0.2))


def test_a_flux_window_is_cut_where_its_shifted_schedule_is(lines):
    """Flux's sigmas are shifted (4 steps: 1.0, 0.905, 0.760, 0.513): progress 0.45 is sigma
    0.794, so the last two steps pool; 1 - sigma would have put only the last inside. The
    window's line comes at the first step of a run."""
    from comfy.model_sampling import simple_sigmas
    base = dit_model()
    schedule = simple_sigmas(ModelSamplingFlux(shift=1.15), 4)
    (late,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, start=0.45))
    pooled = [not torch.equal(one_call(late, s), one_call(base, s)) for s in schedule[:-1]]
    assert pooled == [False, False, True, True]
    sample(late)
    assert lines[-2].startswith("ToMe: steps 0.45-1 (sigma <= 0.79") \
        and lines[-2].endswith("merging in 2 of 4 steps")
    assert lines[-1] == "ToMe: pooled 8 of 16 attention calls; the rest: outside the window 8"


def test_flux_pools_from_its_schedule_window(lines):
    """A schedule's window is the form's step window (the fast preset without reuse):
    progress 0.3 is sigma 0.88 with Flux's shift; and a schedule whose items have different
    windows gives each block its factor at each step."""
    base = dit_model()
    (fast,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, schedule="all:2@0.3-1"))
    assert torch.equal(one_call(fast, 0.9), one_call(base, 0.9))
    assert not torch.equal(one_call(fast, 0.5), one_call(base, 0.5))
    assert any(line.startswith("ToMe DiT: x2 in all blocks, steps 0.3-1") for line in lines)
    (steps,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, schedule="double:2@0-0.5,"
                                                                        "single:4@0.5-1"))
    (doubles,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, blocks="double"))
    assert torch.equal(one_call(steps, 0.99), one_call(doubles, 0.99))
    (singles,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, schedule="single:4"))
    assert torch.equal(one_call(steps, 0.2), one_call(singles, 0.2))


@pytest.mark.parametrize("order", ["tome first", "compile first"])
def test_a_compiled_model_recompiles_at_most_once_per_resolution(lines, order):
    """ComfyUI's TorchCompileModel (its guard filter drops every guard on
    ``transformer_options``) before or after ours: the compiled model gives the eager
    latents, pools where the window says, and compiles one graph per resolution and window
    state (the override is one stable object; the call's state plain ints)."""
    import torch._dynamo.testing
    from comfy_api.torch_helpers import set_torch_compile_wrapper, skip_torch_compile_dict

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    base = dit_model()
    config = defaults(**FIXED, start=0.3)

    def compiled(m):
        m = m.clone()
        set_torch_compile_wrapper(m, counter, options={"guard_filter_fn": skip_torch_compile_dict})
        return m

    if order == "tome first":
        model = compiled(nodes.ToMePatch().patch(base, **config)[0])
    else:
        model = nodes.ToMePatch().patch(compiled(base), **config)[0]
    (eager,) = nodes.ToMePatch().patch(base, **config)
    for latent in ((1, 4, 16, 24), (1, 4, 16, 24), (1, 4, 24, 24)):
        torch.testing.assert_close(sample(model, latent=latent), sample(eager, latent=latent))
    assert counter.frame_count <= 2 * 2, counter.frame_count  # 2 resolutions x (unpooled, pooled)
    assert not any("not pooled" in line for line in lines)  # the graph replays the count
    torch.testing.assert_close(one_call(model, 1.0), one_call(base, 1.0))


def test_measure_node_on_a_dit_gives_rows(user_dir, lines):
    """Flux is timed through the override's runner (it used to say "not measured" for every
    size); merge, which has no DiT form, says so in its rows."""
    host.measuring_service().clock = fake_clock(1.5)
    text, image = nodes.ToMeMeasure().measure(dit_model(), "512, 1024")["result"]
    assert "downsample  512x512    ds2    1024" in text and "1.50x     merge" in text
    assert "downsample  1024x1024  ds2    4096" in text and "Error" not in text
    assert text.count("merge  ") == 2 and "merge has no DiT form (comfy flux)" in text
    assert image.shape[0] == 1 and image.shape[-1] == 3


AUTO = {"method": "downsample", "policy": "auto"}


@pytest.mark.parametrize("family", ["flux", "qwen"])
def test_auto_times_a_comfy_dit_once_per_size_and_decides_by_it(user_dir, lines, family,
                                                                monkeypatch):
    """The first call at a size times a block unpooled and through the override (the fake
    clock says 1.5x), the console names the measured speed-up, later calls and sizes already
    measured time nothing; the pooled latents are those of the fixed policy."""
    calls = []
    host.measuring_service().clock = fake_clock(1.5, calls)
    (ours,) = nodes.ToMePatch().patch(dit_model(family), **defaults(**AUTO))
    out = sample(ours, family)
    assert calls and calls.count("unmerged") == calls.count("merged")
    measured = [x for x in lines if x.startswith("ToMe: measured 192x128 px, batch 1, ")]
    assert len(measured) == 1 and "ds2 1.50x merged" in measured[0]
    assert [x for x in lines if x.startswith("ToMe auto:")] == [
        "ToMe auto: 192x128 px: ds2 measured 1.50x on " + measured[0].split(" on ")[1]
        .split(" (")[0] + ", merged"]
    calls.clear()
    assert torch.equal(sample(ours, family), out) and not calls
    (fixed,) = nodes.ToMePatch().patch(dit_model(family), **defaults(**FIXED))
    assert torch.equal(sample(fixed, family), out)


def test_auto_measured_slower_leaves_a_comfy_dit_unpooled(user_dir, lines):
    host.measuring_service().clock = fake_clock(0.9)
    base = dit_model()
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**AUTO))
    assert torch.equal(sample(ours), sample(base))
    assert any("ds2 measured 0.90x on " in x and x.endswith("not merged") for x in lines)


def test_auto_skips_a_grid_that_may_not_fit_with_one_line(user_dir, lines, monkeypatch):
    """The memory check comes first: nothing is timed, one line says why, and the DiT form's
    own CPU threshold (1024 tokens, not the UNet method's 4096) decides."""
    from tome import memory
    calls = []
    host.measuring_service().clock = fake_clock(1.5, calls)
    monkeypatch.setattr(memory, "available", lambda device: 1 << 20)
    (ours,) = nodes.ToMePatch().patch(dit_model(), **defaults(**AUTO))
    sample(ours)
    assert not calls
    skipped = [x for x in lines if x.startswith("ToMe: not measured at 192x128 px, batch 1: "
                                                  "timing the unmerged block needs about ")]
    assert len(skipped) == 1 and skipped[0].endswith("; the token thresholds decide")
    assert "ToMe auto: 192x128 px: ds2 96 tokens, below the CPU threshold (1024), not merged" \
        in lines


def test_auto_times_a_wan_video_grid_once_and_keeps_it_in_the_cache(user_dir, lines):
    """A video's grid (frames x rows x columns) is timed as the override pools it; a new
    service (the next ComfyUI session) reads it from the cache file without timing."""
    calls = []
    host.measuring_service().clock = fake_clock(1.5, calls)
    (ours,) = nodes.ToMePatch().patch(dit_model("wan"), **defaults(**AUTO))
    sample(ours, "wan")
    assert calls
    assert sum(x.startswith("ToMe: measured 192x128 px, 9 frames, batch 1, ") for x in lines) == 1
    assert any(x.startswith("ToMe auto: 192x128 px, 9 frames: ds2 measured 1.50x on ")
               for x in lines)
    host._services.clear()
    host.measuring_service().clock = fake_clock(1.5, calls)
    calls.clear()
    (again,) = nodes.ToMePatch().patch(dit_model("wan"), **defaults(**AUTO))
    sample(again, "wan")
    assert not calls and sum(x.startswith("ToMe: measured") for x in lines) == 1


def test_auto_skips_a_wan_video_that_may_not_fit_and_uses_the_dit_threshold(user_dir, lines,
                                                                           monkeypatch):
    from tome import memory
    calls = []
    host.measuring_service().clock = fake_clock(1.5, calls)
    monkeypatch.setattr(memory, "available", lambda device: 1 << 20)
    (ours,) = nodes.ToMePatch().patch(dit_model("wan"), **defaults(**AUTO))
    sample(ours, "wan")
    assert not calls
    assert any(x.startswith("ToMe: not measured at 192x128 px, 9 frames, batch 1: timing the "
                            "unmerged block needs about ") for x in lines)
    assert "ToMe auto: 192x128 px, 9 frames: ds2 288 tokens, below the CPU threshold (1024), " \
        "not merged" in lines


def test_comfy_qwen_image_and_wan_are_read_as_dits():
    """ComfyUI's Qwen-Image (double-stream blocks) and Wan (its blocks, 2x2 latent pixels per
    token) are read by their families, as the node's lines name them."""
    from tome import layout
    qwen, wan = (layout.read(dit_model(f).model) for f in ("qwen", "wan"))
    assert qwen.family == "comfy qwen-image" and [b.kind for b in qwen.blocks] == ["double"] * 2
    assert wan.family == "comfy wan" and len(wan.blocks) == 2 and wan.dit.patch == 2


# ----------------------------------------------------------------------------- the step window

def merged_steps(patched, base, outs=None):
    """Per model call of a 4-step KSampler: whether the output differs from the unpatched."""
    x, _, ctx = ldm_inputs(2, 32, 32)
    ref = ksample(base, x, ctx)
    return [not torch.equal(a, b) for a, b in zip(ksample(patched, x, ctx), ref)]


def test_the_stand_in_hands_the_sigmas_of_a_real_sampler():
    from comfy.model_sampling import normal_sigmas
    # 4 Euler steps, normal schedule, SD1.5, as the real ComfyUI 0.8.0 hands them
    torch.testing.assert_close(normal_sigmas(ModelSamplingDiscrete(), 4),
                               torch.tensor([14.6146, 2.9183, 0.9324, 0.0292, 0.0]),
                               atol=2e-4, rtol=0)


@pytest.mark.parametrize("method", ["merge", "downsample"])
@pytest.mark.parametrize(("start", "end", "expect"), [
    (0.0, 0.5, [True, True, False, False]),
    (0.5, 1.0, [False, False, True, True]),
    (0.0, 1.0, [True, True, True, True]),
])
def test_the_window_merges_its_part_of_the_steps(lines, method, start, end, expect):
    """Steps at progress 0, 1/3, 2/3, 1 (sigmas 14.6, 2.92, 0.93, 0.03): the first half is the
    first two. A sigma read as a 0-1000 timestep made every step look like the end."""
    base = model()
    (ours,) = nodes.ToMePatch().patch(base, **defaults(method=method, policy="fixed",
                                                       start=start, end=end))
    assert merged_steps(ours, base) == expect
    if end - start < 1:
        assert f"steps {start:g}-{end:g} (sigma" in lines[-2]
        assert lines[-1].startswith(f"ToMe: steps {start:g}-{end:g} (sigma ")
        assert lines[-1].endswith("merging in 2 of 4 steps")
        said = len(lines)
        merged_steps(ours, base)  # a second run: its own line
        assert len(lines) == said + 1 and lines[-1] == lines[said - 1]
        assert getattr(ours, mp.MARK).report.steps() == f"steps {start:g}-{end:g}: merged " \
                                                         "in 2 of 4 steps"


def test_without_model_sampling_the_window_uses_sds_schedule(lines):
    base = model()
    del base.model.model_sampling
    (ours,) = nodes.ToMePatch().patch(base, **defaults(policy="fixed", end=0.5))
    x, t, ctx = ldm_inputs(2, 32, 32)
    merged = [not torch.equal(unet_call(ours, x, t, ctx, s), unet_call(base, x, t, ctx, s))
              for s in (14.6146, 2.9183, 0.9324, 0.0292)]
    assert merged == [True, True, False, False]


# ----------------------------------------------------------------------------- residual reuse

@pytest.mark.parametrize("family", ["flux", "wan"])
def test_the_quality_preset_reuses_residuals_per_cond_and_uncond(lines, monkeypatch, family):
    """The quality preset's full point (x8 everywhere, residual refreshed every 5 steps)
    applies through the override (its line says so; here with the fixed policy, as the
    stand-in's CPU times x8 slower): at a refresh step each of cond and uncond runs the
    unpooled attention too (keys of the whole image), in between only pooled keys; the
    latent differs from x8 without reuse and is closer to the unpooled one; the same seed
    gives the same latent; nothing is kept after the sampling (``on_cleanup``), and a
    sampling that failed half-way leaves nothing that changes the next one (``on_pre_run``)."""
    base = dit_model(family)
    g = torch.Generator().manual_seed(1)
    uncond = torch.randn(1, 5, 12, generator=g)
    run = {"family": family, "steps": 8, "cfg": 2.0, "uncond": uncond}
    ref = sample(base, **run)
    nodes.ToMePatch().patch(base, **defaults(preset="quality"))
    assert "x8 in all blocks; residual reuse every 5 steps" in lines[-2]
    assert "residual reuse" not in lines[-1].partition("cannot apply")[2]
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, schedule="all:8", reuse=5))
    (plain,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, schedule="all:8", reuse=0))
    seen = spy(monkeypatch, family)
    out = sample(ours, **run)
    image = {"flux": 5 + 8 * 12, "wan": 3 * 8 * 12}[family]
    blocks = {"flux": 4, "wan": 2}[family]
    assert seen.count(image) == 2 * 2 * blocks  # steps 0 and 5, cond and uncond
    mark = getattr(ours, mp.MARK)
    assert mark.reuse.held_bytes() == 0 and "residual reuse" not in mark.limits
    without = sample(plain, **run)
    assert torch.isfinite(out).all() and not torch.equal(out, without)
    assert float((out - ref).norm()) < float((without - ref).norm())
    assert torch.equal(sample(ours, **run), out)

    calls = []
    apply_model = ours.model.apply_model

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise RuntimeError("interrupted")
        return apply_model(*args, **kwargs)

    monkeypatch.setattr(ours.model, "apply_model", failing)
    with pytest.raises(RuntimeError):
        sample(ours, **run)
    assert mark.reuse.held_bytes() == 0
    monkeypatch.setattr(ours.model, "apply_model", apply_model)
    assert torch.equal(sample(ours, **{**run, "steps": 8}), out)


def test_reuse_that_does_not_fit_in_memory_runs_the_point_without_it(capsys, monkeypatch):
    """What reuse would keep is checked against free memory before anything is kept
    (``budget.ReuseBudget`` on the per-call path): with almost nothing free, one line says so
    and the sampling runs the settings' point without reuse (the quality preset's: x2 in
    single blocks from 0.3), keeping nothing."""
    from tome import memory
    base = dit_model("flux")
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, schedule="all:8", reuse=5))
    (point,) = nodes.ToMePatch().patch(base, **defaults(**FIXED, schedule="single:2@0.3-1",
                                                         reuse=0))
    monkeypatch.setattr(memory, "available", lambda device: 1024)
    capsys.readouterr()
    out = sample(ours, steps=8)
    assert getattr(ours, mp.MARK).reuse.held_bytes() == 0
    said = capsys.readouterr().out
    assert said.count("residual reuse would keep") == 1 and "it is off, x2 in single blocks" \
        in said
    assert torch.equal(out, sample(point, steps=8))
