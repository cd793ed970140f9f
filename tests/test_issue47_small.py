"""Issue 47's smaller items: kept residuals clamped before a float8 cast (every torch the hosts
ship), the reuse budget in the dtype the model computes in (ComfyUI casts inside
``_apply_model``), true CFG budgeted for the identities a generation will have, and nothing
ignored in silence (``blocks``/``downsample_factor`` beside a schedule or a preset; a family's
``spans`` that raises while sampling).

Byte counts are written out from the stand-in Flux's shape (4 blocks, hidden 32, 5 text and
8 x 12 image tokens), not taken from the estimator."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from comfy.model_base import BaseModel  # noqa: E402
from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingFlux, simple_sigmas  # noqa: E402
from comfy.sampling import dit_sample  # noqa: E402
from comfy_node import flux_key_lengths  # noqa: E402

from tome import adapters, attend, budget, memory, override  # noqa: E402
from tome.comfy import nodes  # noqa: E402
from tome.config import ToMeConfig, preset  # noqa: E402
from tome.modelpatcher import MARK  # noqa: E402
from tome.webui import script_args  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ----------------------------------------------------------------------------- float8

def _keep_one(dtype, residual):
    """One refresh of a part under ``Keep(dtype=dtype)`` whose unpooled output exceeds the
    pooled one by ``residual``; what is kept, and the next step's output (residual added)."""
    reuse = attend.Reuse(5, attend.Keep(dtype=dtype))
    pos = reuse.join(0)
    out = torch.zeros(1, 4, 2)
    reuse.begin(0.0, 1, (1, 2, 2))
    part = reuse.parts()[pos]  # this thread's slot of block 0
    reuse.around((part, 2), out, lambda rows=None: out + residual)
    (kept,) = part.kept[reuse.who].values()
    reuse.begin(0.1, 1, (1, 2, 2))
    return kept, reuse.around((part, 2), out, lambda rows=None: out + residual)


def test_e5m2_residuals_past_its_range_are_kept_at_its_largest_value():
    """float8_e5m2's largest value is 57344; torch's cast (even this one) makes 70000 inf.
    Kept clamped, the residual stays finite, and so does the next step's output."""
    residual = torch.tensor([70000.0, -70000.0, 1000.0, 0.5]).view(1, 4, 1).expand(1, 4, 2)
    (r, slope, _), after = _keep_one(E5M2, residual)
    assert torch.isfinite(r.float()).all() and torch.isfinite(slope.float()).all()
    assert r.float()[0, :, 0].tolist() == [57344.0, -57344.0, 1024.0, 0.5]
    assert torch.isfinite(after).all()


class _CastWithoutSaturation(TorchDispatchMode):
    """torch before float8 casts saturated (the hosts ship 2.1-2.9): a float32 value of 480 or
    more (past e4m3fn's 448 by half a step) cast to float8_e4m3fn is NaN."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") == E4M3:
            src = args[0].float()
            out = torch.where(src.abs() >= 480, float("nan"), src).to(E4M3)
        return out


def test_e4m3_residuals_are_clamped_before_the_cast_on_a_torch_that_does_not_saturate():
    residual = torch.tensor([1000.0, -500.0, 448.0, 3.0]).view(1, 4, 1).expand(1, 4, 2)
    with _CastWithoutSaturation():
        (r, slope, _), after = _keep_one(E4M3, residual)
    assert not r.float().isnan().any() and not slope.float().isnan().any()
    assert r.float()[0, :, 0].tolist() == [448.0, -448.0, 448.0, 3.0]
    assert torch.isfinite(after).all()


# ----------------------------------------------------------------------------- ComfyUI's Flux

LATENT = (1, 4, 16, 24)
TEXT, IMAGE, WIDTH, BLOCKS = 5, 8 * 12, 32, 4  # the stand-in Flux at LATENT, 5 text tokens


def _flux(dtype=torch.float32):
    from comfy.ldm.flux.model import Flux
    torch.manual_seed(0)
    return ModelPatcher(BaseModel(Flux().eval().to(dtype), ModelSamplingFlux(shift=1.15)))


def _sample(patcher, steps=4, **kw):
    g = torch.Generator().manual_seed(0)
    noise, ctx = torch.randn(LATENT, generator=g), torch.randn(1, TEXT, 12, generator=g)
    uncond = torch.randn(1, TEXT, 12, generator=g)
    sigmas = simple_sigmas(patcher.get_model_object("model_sampling"), steps)
    return dit_sample(patcher, noise, ctx, sigmas, uncond=uncond, **kw)


def _free(held, rows, elem):
    """Free memory in which ``held`` kept bytes just fit beside a call of ``rows`` batch rows
    (16 copies of one block's input in the dtype of ``elem`` bytes), with the margin."""
    reserve = memory.ACTIVATION_COPIES * rows * (TEXT + IMAGE) * WIDTH * elem
    return math.ceil((held + reserve) * memory.MARGIN) + memory.HEADROOM


def _quality(base, lines):
    ours = nodes.apply(base, preset("quality", policy="fixed"))
    return ours, getattr(ours, MARK)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_budget_counts_in_the_dtype_the_comfy_model_computes_in(lines, monkeypatch, capsys,
                                                                   dtype):
    """ComfyUI hands its wrappers the sampler's float32 latent and casts it to the model's
    dtype inside ``_apply_model`` (a bf16 or fp16 model): reuse keeps 16-bit outputs, residual
    and slope, of every block's 101 rows. With free memory for that but not for twice it, the
    budget keeps everything and says nothing."""
    need = 2 * 2 * BLOCKS * (TEXT + IMAGE) * WIDTH  # residual + slope, 2 bytes each
    monkeypatch.setattr(memory, "available", lambda device: _free(need, 1, 2))
    ours, core = _quality(_flux(dtype), lines)
    capsys.readouterr()
    out = _sample(ours, steps=6)
    assert torch.isfinite(out).all()
    assert core.budget.keep == attend.Keep() and core.budget.need == need
    assert "residual reuse would keep" not in capsys.readouterr().out


def test_the_model_base_says_the_dtype_it_computes_in():
    """ComfyUI after v0.30 (``get_dtype_inference``), before (``manual_cast_dtype``, else
    ``get_dtype()``), Forge's and Neo's KModel (``computation_dtype``); nothing: None."""
    class New:
        def get_dtype_inference(self):
            return torch.float16

    class Old:
        manual_cast_dtype = None

        def get_dtype(self):
            return torch.bfloat16

    assert budget.compute_dtype(New()) == torch.float16
    assert budget.compute_dtype(Old()) == torch.bfloat16
    assert budget.compute_dtype(SimpleNamespace(computation_dtype=torch.float16)) == torch.float16
    assert budget.compute_dtype(object()) is None and budget.compute_dtype(None) is None


def _full_calls(monkeypatch):
    """How many attention calls reached the backend with the whole 101 keys (a refresh's
    unpooled attention; quality pools every block at x8: 7 keys): the backend as Flux's
    blocks reach it, behind ComfyUI's attention override."""
    seen = flux_key_lengths(monkeypatch)
    return lambda: sum(n == TEXT + IMAGE for n in seen)


@pytest.mark.parametrize("batched", [False, True])
def test_true_cfg_refreshes_at_the_paced_period_and_says_the_ladder_once(lines, monkeypatch,
                                                                         capsys, batched):
    """True CFG (cfg 2) over 10 steps, twice; free memory for one call's float32 residuals
    and slopes, which is also both calls' in bfloat16. Cond and uncond as two calls: the
    uncond's first call steps the ladder down to bfloat16 and what the cond kept is converted,
    not dropped; the second generation budgets for both from its first call. As one batched
    call, both from the start. Either way each call refreshes at steps 0, 4 and 8 only (4
    blocks each: the preset's 5 at 20 steps, paced to 10: round(5 * sqrt(10 / 20)) = 4), and
    the ladder's line comes once."""
    one = 2 * 4 * BLOCKS * (TEXT + IMAGE) * WIDTH  # one call: residual + slope in float32
    monkeypatch.setattr(memory, "available",
                        lambda device: _free(one, 2 if batched else 1, 4))
    ours, core = _quality(_flux(), lines)
    full = _full_calls(monkeypatch)
    capsys.readouterr()
    for generation in (1, 2):
        _sample(ours, steps=10, cfg=2.0, batched=batched)
        assert full() == generation * 3 * (1 if batched else 2) * BLOCKS
        assert core.budget.keep == attend.Keep(dtype=torch.bfloat16)
        assert core.budget.need == one  # both calls in 16 bits
    said = [x for x in capsys.readouterr().out.splitlines() if "residual reuse" in x]
    assert len(said) == 1 and said[0].endswith("it keeps residual + slope, bfloat16 "
                                               f"({one / 1024:.1f} KiB)")


# ----------------------------------------------------------------------------- nothing ignored

def test_blocks_beside_a_schedule_is_a_value_error_naming_both():
    with pytest.raises(ValueError, match=r"invalid blocks='double': schedule='all:8' names "
                                         r"the blocks itself.*\('double:8'\)"):
        ToMeConfig(method="downsample", schedule="all:8", blocks="double")
    with pytest.raises(ValueError, match=r"blocks='0-3': schedule='inner:2'"):
        preset("quality", schedule="inner:2", blocks="0-3")
    ToMeConfig(method="downsample", schedule="all:8", blocks="all")  # the default: fine
    ToMeConfig(method="downsample", blocks="double")  # without a schedule: it says which


@pytest.mark.parametrize("changes,schedule", [
    ({"blocks": "double"}, "double:8"), ({"blocks": "0-18"}, "0-18:8"),
    ({"downsample_factor": 4}, "all:4"), ({"blocks": "double", "downsample_factor": 2},
                                          "double:2"),
    ({"blocks": "all"}, "all:8"), ({"ratio": 0.3}, "all:8"),
    ({"schedule": "single:4", "blocks": "all"}, "single:4")])
def test_blocks_and_the_factor_beside_a_preset_go_into_its_schedule(changes, schedule):
    """A preset is a starting point: the user's ``blocks`` and ``downsample_factor`` win over
    its DiT schedule (the UNet still reads the factor), its reuse and rope stay."""
    config = preset("quality", **changes)
    assert (config.schedule, config.blocks, config.reuse, config.rope) == \
        (schedule, "all", 5, "before")
    assert config.downsample_factor == changes.get("downsample_factor", 2)


def test_the_webui_api_folds_them_too_and_the_preset_with_default_controls_is_not_refused():
    named = script_args.parse_args([{"enabled": True, "preset": "fast", "blocks": "double",
                                     "downsample_factor": "2"}])
    assert (named.config.schedule, named.config.blocks, named.config.reuse) == \
        ("double:2", "all", 10)
    controls = {**script_args.control_values(script_args.DEFAULT), "enabled": True,
                "preset": "Quality", "hires_only": False, "hr_ratio": 0.0}  # the UI's defaults
    ui = script_args.parse_args([controls[k] for k in script_args.ARGS])
    assert ui.config == preset("quality") and ui.config.blocks == "all"
    with pytest.raises(ValueError, match="names the blocks itself"):
        script_args.parse_args([{"enabled": True, "schedule": "all:4", "blocks": "double"}])


def test_the_summary_never_names_blocks_the_schedule_overrides(lines):
    nodes.apply(_flux(), preset("quality", policy="fixed", blocks="double"))
    nodes.apply(_flux(), ToMeConfig(method="downsample", policy="fixed", blocks="double"))
    assert [x for x in lines if x.startswith("ToMe: comfy flux DiT")] == [
        "ToMe: comfy flux DiT, x8 in double blocks; residual reuse every 5 steps (paced to the "
        "step count); 2/4 blocks pooled (rope before)",
        "ToMe: comfy flux DiT, downsample x2; 2/4 blocks pooled (blocks double, rope before)"]


def test_a_spans_that_raises_while_sampling_passes_the_call_through_once(lines, monkeypatch,
                                                                         capsys):
    """A family whose ``spans`` raises on a call (here Flux's, made to): ComfyUI's prompt
    runs unpooled, as without the node, with one console line for the whole sampling."""
    real = adapters.comfy_spans

    def boom(model, x, context, conds):
        raise KeyError("y")

    monkeypatch.setattr(adapters, "comfy_spans",
                        lambda family: override.spans_of(boom) if real(family) else None)
    base = _flux()
    ref = _sample(base, cfg=2.0)
    ours = nodes.apply(base, ToMeConfig(method="downsample", policy="fixed"))
    capsys.readouterr()
    assert torch.equal(_sample(ours, cfg=2.0), ref)
    said = [x for x in capsys.readouterr().out.splitlines() if "could not place" in x]
    assert said == ["ToMe: comfy flux could not place a model call's tokens (KeyError: 'y'); "
                    "the calls it cannot place run unpooled"]


def test_a_spans_that_raises_in_forge_neo_passes_the_call_through_once(monkeypatch, capsys):
    from webui_stub.harness import WebUI, neo

    from tome import swap
    real = adapters.neo_form

    def boom(model, x, c):
        raise ValueError("no latent")

    def form(family):
        found = real(family)
        return None if found is None else swap.Form(found.points, boom)

    webui = WebUI(neo.NeoModel("flux"))
    off = torch.stack(webui.generate(steps=4).images)
    monkeypatch.setattr(adapters, "neo_form", form)
    on = torch.stack(webui.generate(tome={"enabled": True, "method": "downsample",
                                          "policy": "fixed"}, steps=4).images)
    assert torch.equal(on, off)
    said = [x for x in capsys.readouterr().out.splitlines() if "could not place" in x]
    assert said == ["ToMe: forge neo flux could not place a model call's tokens (ValueError: "
                    "no latent); the calls it cannot place run unpooled"]


def test_forge_neo_budget_counts_in_the_dtype_its_kmodel_computes_in(monkeypatch, capsys):
    """Forge Neo's ``model_function_wrapper`` gets the sampler's float32 latent too, and its
    KModel casts it to ``computation_dtype`` inside ``apply_model``: a bf16 Flux keeps 16-bit
    residuals and slopes (4 blocks, 16 image + 7 text rows, width 32); with memory for those
    and not twice them, reuse keeps everything."""
    from webui_stub.harness import neo

    from tome import swap
    model = neo.NeoModel("flux")
    unet = model.forge_objects.unet
    unet.model.diffusion_model.to(torch.bfloat16)
    unet.model.computation_dtype = torch.bfloat16
    rows = 16 + neo.TEXT_TOKENS
    need = 2 * 2 * BLOCKS * rows * WIDTH
    reserve = memory.ACTIVATION_COPIES * rows * WIDTH * 2
    monkeypatch.setattr(memory, "available", lambda device: math.ceil(
        (need + reserve) * memory.MARGIN) + memory.HEADROOM)
    patched, _ = adapters.patch_model_patcher(unet, preset("quality", policy="fixed"))
    ours = getattr(patched, MARK)
    assert isinstance(ours, swap.Swap)
    x = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    capsys.readouterr()
    for sigma in (1.0, 0.9):
        out = neo.calc_batch(patched, x, torch.tensor([sigma]), model.conds("a cat", 1), [0])
        assert torch.isfinite(out).all()
    assert ours.budget.keep == attend.Keep() and ours.budget.need == need
    assert ours.reuse.held_bytes() == need
    assert "residual reuse would keep" not in capsys.readouterr().out
