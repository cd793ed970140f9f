"""ComfyUI's joint-attention DiT families (``tome/dits/comfy_*.py``) against the stand-ins in
``tests/comfy_stub`` (written from ComfyUI 0.8.0's and v0.30.0's public call shapes): SD3 and
SD3.5 (joint [context, image], SD3.5's image-only ``attn2``), AuraFlow ([registers + text,
image]), HunyuanVideo (0.8.0's [image, text], v0.30's [text, image], a reference latent
before the image, a text mask), Chroma and Flux 2 named as themselves.

Each pooled layout's first attention call (whose inputs pooling has not touched yet) is
checked against a reference written here: the image keys and values averaged per 2x2 cell
by loops over the token grid, every other key kept in place, ``log(cell size)`` added to
the cells' scores, the host's text mask kept on the text keys, an einsum softmax. Whole
samplings: finite and close to the unpooled latent, same seed same latent, and the input
MODEL (no node) bit-identical."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingDiscreteFlow, ModelSamplingFlux  # noqa: E402
from comfy_node import defaults  # noqa: E402

from tome import dits  # noqa: E402
from tome.comfy import nodes  # noqa: E402

FIXED = {"method": "downsample", "policy": "fixed", "downsample_factor": 2,
         "proportional": True}
TEXT = 5


# name -> (builder, its keywords, model sampling, latent, the module whose bound
# ``optimized_attention`` its joint blocks call)
def _models():
    from comfy.ldm.aura.mmdit import MMDiT
    from comfy.ldm.chroma.model import Chroma
    from comfy.ldm.flux.model import Flux
    from comfy.ldm.genmo.joint_model.asymm_models_joint import AsymmDiTJoint
    from comfy.ldm.hidream.model import HiDreamImageTransformer2DModel
    from comfy.ldm.hunyuan_video.model import HunyuanVideo
    from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
    from comfy.ldm.omnigen.omnigen2 import OmniGen2Transformer2DModel
    flow = ModelSamplingDiscreteFlow
    return {
        "sd3": (OpenAISignatureMMDITWrapper, {}, lambda: flow(shift=3.0), (1, 4, 16, 24),
                "comfy.ldm.modules.diffusionmodules.mmdit"),
        "sd35": (OpenAISignatureMMDITWrapper, {"x_block_self_attn_layers": (0, 1),
                                               "register_length": 3},
                 lambda: flow(shift=3.0), (1, 4, 15, 23),
                 "comfy.ldm.modules.diffusionmodules.mmdit"),
        "aura": (MMDiT, {}, lambda: flow(shift=1.73, multiplier=1.0), (1, 4, 16, 23),
                 "comfy.ldm.aura.mmdit"),
        "hunyuan": (HunyuanVideo, {}, lambda: flow(shift=7.0), (1, 4, 3, 16, 24),
                    "comfy.ldm.flux.math"),
        "hunyuan030": (HunyuanVideo, {"version": "0.30", "byt5": True},
                       lambda: flow(shift=7.0), (1, 4, 3, 16, 24), "comfy.ldm.flux.math"),
        "chroma": (Chroma, {}, lambda: ModelSamplingFlux(shift=1.15), (1, 4, 16, 24),
                   "comfy.ldm.flux.math"),
        "flux2": (Flux, {"patch_size": 1, "global_modulation": True},
                  lambda: ModelSamplingFlux(shift=1.15), (1, 4, 8, 12),
                  "comfy.ldm.flux.math"),
        "hidream": (HiDreamImageTransformer2DModel, {}, lambda: flow(shift=3.0),
                    (1, 4, 16, 23), "comfy.ldm.hidream.model"),
        "mochi": (AsymmDiTJoint, {}, lambda: flow(shift=6.0, multiplier=1.0),
                  (1, 4, 3, 16, 24), "comfy.ldm.genmo.joint_model.asymm_models_joint"),
        "omnigen2": (OmniGen2Transformer2DModel, {}, lambda: flow(shift=3.0, multiplier=1.0),
                     (1, 4, 16, 24), "comfy.ldm.omnigen.omnigen2")}


def conds_of(family):
    """What the model base hands each family besides the text: HiDream's Llama layers
    (``[B, layers, L, D]``: 3 layers of 4 tokens), Mochi's count of real text tokens."""
    g = torch.Generator().manual_seed(2)
    return {"hidream": {"encoder_hidden_states_llama3": torch.randn(1, 3, 4, 10, generator=g)},
            "mochi": {"num_tokens": 3}, "omnigen2": {"num_tokens": TEXT}}.get(family, {})


NAMES = {"sd3": "comfy sd3", "sd35": "comfy sd3", "aura": "comfy auraflow",
         "hunyuan": "comfy hunyuan-video", "hunyuan030": "comfy hunyuan-video",
         "chroma": "comfy chroma", "flux2": "comfy flux 2", "hidream": "comfy hidream",
         "mochi": "comfy mochi", "omnigen2": "comfy omnigen2"}


def dit_model(family):
    from comfy.model_base import BaseModel
    net, kw, sampling, _, _ = _models()[family]
    torch.manual_seed(0)
    return ModelPatcher(BaseModel(net(**kw).eval(), sampling()))


def sample(patcher, family, seed=0, sigmas=None, **conds):
    """A KSampler run (Euler, cfg 1) from seeded noise and text: 4 "simple" steps, or
    ``sigmas``."""
    from comfy.model_sampling import simple_sigmas
    from comfy.sampling import dit_sample
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(_models()[family][3], generator=g)
    ctx = torch.randn(1, TEXT, 12, generator=g)
    if sigmas is None:
        sigmas = simple_sigmas(patcher.get_model_object("model_sampling"), 4)
    return dit_sample(patcher, noise, ctx, sigmas, **{**conds_of(family), **conds})


def record(monkeypatch, family):
    """Every call the family's blocks make to the attention backend, as the backend gets it
    (with ours installed: the pooled keys and the bias as its mask): ``(q, k, v, mask,
    heads, skip_reshape, out)``."""
    import importlib

    from comfy.ldm.modules import attention as comfy_attention
    seen = []

    @comfy_attention.wrap_attn
    def attention_pytorch(q, k, v, heads, mask=None, **kw):
        out = comfy_attention.attention_pytorch.__wrapped__(q, k, v, heads, mask, **kw)
        seen.append((q, k, v, mask, heads, bool(kw.get("skip_reshape")), out))
        return out

    module = importlib.import_module(_models()[family][4])
    name = "optimized_attention_masked" if family == "omnigen2" else "optimized_attention"
    monkeypatch.setattr(module, name, attention_pytorch)
    return seen


def heads_first(t, heads, skip):
    """``[B, heads, S, D]`` of a backend's input in either ComfyUI layout (SD3's values
    ``[B, S, heads, D]``)."""
    if skip:
        return t
    return (t if t.dim() == 4 else t.unflatten(-1, (heads, -1))).transpose(1, 2)


def reference(q, k, v, heads, skip, start, grid, mask=None):
    """One attention call written out: the ``frames x h x w`` image tokens of ``k`` and ``v``
    from ``start`` (frame-major, row-major) averaged per 2x2 cell of each frame (partial
    cells at the edges) by loops, the other keys in place; ``log(cell size)`` on the cells'
    scores; the host's mask on the other keys (its cells' entries the mean of theirs);
    an einsum softmax. Returns the output in the backend's layout and the pooled keys."""
    q, k, v = (heads_first(t, heads, skip).double() for t in (q, k, v))
    frames, h, w = grid
    image = frames * h * w
    n = k.shape[2]
    cells = [[start + f * h * w + i * w + j for i in range(i0, min(i0 + 2, h))
              for j in range(j0, min(j0 + 2, w))]
             for f in range(frames) for i0 in range(0, h, 2) for j0 in range(0, w, 2)]
    keep = list(range(start)), list(range(start + image, n))
    m = torch.zeros(n, dtype=torch.float64) if mask is None else \
        mask.reshape(-1)[-n:].double()

    def pool(t):
        return torch.stack([t[:, :, r] for r in keep[0]]
                           + [sum(t[:, :, r] for r in c) / len(c) for c in cells]
                           + [t[:, :, r] for r in keep[1]], 2)

    bias = torch.tensor([float(m[r]) for r in keep[0]]
                        + [math.log(len(c)) + sum(float(m[r]) for r in c) / len(c)
                           for c in cells]
                        + [float(m[r]) for r in keep[1]], dtype=torch.float64)
    kp, vp = pool(k), pool(v)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, kp) / math.sqrt(q.shape[-1]) + bias
    out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vp)
    out = out.transpose(1, 2).flatten(2)  # ComfyUI's backends answer [B, S, heads * D]
    return out, kp


def check_first_calls(monkeypatch, family, layouts, **conds):
    """The model's first attention calls (``layouts``: per call its image start and grid, or
    ``(index, start, grid)``), unpooled and then through the node: each pooled call against
    ``reference`` over the unpooled call's own inputs (its queries are the same: nothing
    before it was pooled); the calls before them that are not listed are not pooled."""
    layouts = [x if len(x) == 3 else (i, *x) for i, x in enumerate(layouts)]
    base = dit_model(family)
    sigmas = torch.tensor([1.0, 0.0])  # one model call
    seen = record(monkeypatch, family)
    sample(base, family, sigmas=sigmas, **conds)
    plain = list(seen)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    seen.clear()
    sample(ours, family, sigmas=sigmas, **conds)
    for i in range(max(x[0] for x in layouts)):
        if i not in [x[0] for x in layouts]:
            assert torch.equal(seen[i][6], plain[i][6]) and seen[i][1].shape == plain[i][1].shape
    for i, start, grid in layouts:
        q, k, v, mask, heads, skip, _ = plain[i]
        want, kp = reference(q, k, v, heads, skip, start, grid, mask)
        got_k, got = seen[i][1], seen[i][6]
        assert got_k.shape[2 if skip else 1] == kp.shape[2] < k.shape[2 if skip else 1]
        torch.testing.assert_close(heads_first(got_k, heads, skip).double(), kp,
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
        assert not torch.allclose(plain[i][6].double(), want, atol=1e-3)  # it pools
    return plain, seen


def close(a, b, tol=0.25):
    return bool(torch.isfinite(a).all()) and float((a - b).norm() / b.norm()) < tol


def check_sampling(lines, family, **conds):
    """Pooled, finite, close; the same seed the same latent; the input MODEL untouched."""
    base = dit_model(family)
    ref = sample(base, family, **conds)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    assert ours is not base and not base.wrappers
    assert lines[-2].startswith(f"ToMe: {NAMES[family]} DiT, downsample x2;"), lines
    out = sample(ours, family, **conds)
    assert not torch.equal(out, ref) and close(out, ref)
    assert torch.equal(sample(ours, family, **conds), out)
    assert torch.equal(sample(base, family, **conds), ref)
    assert lines[-1].startswith("ToMe: pooled "), lines[-1]
    return out


# ----------------------------------------------------------------------------- the families

@pytest.mark.parametrize("family", sorted(NAMES))
def test_each_family_is_read_as_itself(family):
    model = dit_model(family).model.diffusion_model
    assert dits.find(model).name == NAMES[family]


def test_sd3_joint_call_text_first(monkeypatch, lines):
    """SD3: [context, image] in ``[B, S, heads * D]``, no block index (one shared factor)."""
    check_first_calls(monkeypatch, "sd3", [(TEXT, (1, 8, 12))])


def test_sd35_registers_and_its_image_only_attn2(monkeypatch, lines):
    """SD3.5 Medium: 3 registers before the context; block 0's ``attn2`` over the image
    alone (start 0); an odd latent padded to the patch (15 x 23 -> 8 x 12 tokens)."""
    check_first_calls(monkeypatch, "sd35", [(3 + TEXT, (1, 8, 12)), (0, (1, 8, 12))])


def test_auraflow_registers_then_text_then_image(monkeypatch, lines):
    """AuraFlow: 8 registers and the text before the image; 16 x 23 -> 8 x 12 tokens."""
    check_first_calls(monkeypatch, "aura", [(8 + TEXT, (1, 8, 12))])


def test_hunyuan_video_image_first_in_0_8_0(monkeypatch, lines):
    """0.8.0's flipped double blocks: [image, text], 3 frames of 8 x 12."""
    check_first_calls(monkeypatch, "hunyuan", [(0, (3, 8, 12))])


def test_hunyuan_video_text_first_in_v0_30_with_byt5_a_reference_and_a_mask(monkeypatch,
                                                                             lines):
    """v0.30: [text + ByT5, reference latent, image]; the text mask's padded tokens stay
    masked (their part of the mask kept), the reference latent's tokens whole."""
    byt5 = torch.randn(1, 4, 12)
    ref = torch.randn(1, 4, 1, 16, 24)
    mask = torch.ones(1, TEXT, dtype=torch.long)
    mask[0, -2:] = 0
    conds = {"txt_byt5": byt5, "ref_latent": ref, "attention_mask": mask}
    plain, _ = check_first_calls(monkeypatch, "hunyuan030",
                                 [(TEXT + 4 + 96, (3, 8, 12))], **conds)
    assert plain[0][3] is not None and plain[0][3].shape[-1] == TEXT + 4 + 96 + 288


def test_hunyuan_video_image_first_with_a_reference_and_a_mask(monkeypatch, lines):
    """0.8.0: [reference latent, image, text]: the image starts after the reference."""
    ref = torch.randn(1, 4, 1, 16, 24)
    mask = torch.ones(1, TEXT, dtype=torch.long)
    mask[0, -1] = 0
    check_first_calls(monkeypatch, "hunyuan", [(96, (3, 8, 12))], ref_latent=ref,
                      attention_mask=mask)


def test_chroma_and_flux_2_text_first(monkeypatch, lines):
    check_first_calls(monkeypatch, "chroma", [(TEXT, (1, 8, 12))])
    ref = torch.randn(1, 4, 4, 6)  # a Flux 2 reference latent follows the image, whole
    check_first_calls(monkeypatch, "flux2", [(TEXT, (1, 8, 12))], ref_latents=[ref])


@pytest.mark.parametrize("family", sorted(NAMES))
def test_each_family_samples_pooled_close_and_reproducibly(lines, family):
    check_sampling(lines, family)


def test_hunyuan_spans_from_the_models_hints():
    """HunyuanImage 2.1 (a 4-D latent, a 2-D patch), image-prompt tokens where the model has
    ``vision_in``, ByT5 tokens only where it has ``byt5_in``; a video as long as the
    conditioning is not placed (the token refiner's text-only call has its length)."""
    from types import SimpleNamespace

    from tome.dits import comfy_hunyuan_video as hv
    block = SimpleNamespace(flipped_img_txt=True)
    image = SimpleNamespace(patch_size=[1, 1], double_blocks=[], single_blocks=[block],
                            byt5_in=None, vision_in=object())
    ctx, byt5, clip = torch.zeros(1, 7, 12), torch.zeros(1, 4, 12), torch.zeros(1, 3, 8)
    assert hv.spans(image, torch.zeros(1, 64, 9, 10), ctx,
                    {"txt_byt5": byt5, "clip_fea": clip}) == (10, False, 0, 1, 9, 10, 0)
    video = SimpleNamespace(patch_size=[1, 2, 2], double_blocks=[], single_blocks=[],
                            byt5_in=object(), vision_in=None)
    assert hv.spans(video, torch.zeros(1, 16, 2, 7, 9), ctx, {"txt_byt5": byt5}) == \
        (11, True, 0, 2, 4, 5, 0)
    assert hv.spans(video, torch.zeros(1, 16, 1, 2, 14), ctx, {}) is None  # 7 tokens
    assert hv.spans(video, torch.zeros(1, 16, 8, 8), ctx, {}) is None  # not 5-D
    # one token's side in 8 px latent pixels (the console's sizes): 1.0, 1.5, Image 2.1
    assert [hv.pixels(SimpleNamespace(patch_size=p)) for p in
            ([1, 2, 2], [1, 1, 1], [1, 1])] == [2, 2, 4]


def test_forge_neos_chroma_and_flux_2_are_named_as_themselves():
    """Forge Neo's Chroma ("forge neo chroma", a subclass of its Flux in the stand-in) and
    Flux 2 (Neo's Flux class with global modulation: "forge neo flux 2"), swapped at Flux's
    attention global; Neo's Flux stays "forge neo flux"."""
    from tome import adapters

    flux = type("IntegratedFluxTransformer2DModel", (torch.nn.Module,),
                {"__module__": "backend.nn.flux"})
    chroma = type("IntegratedChromaTransformer2DModel", (flux,),
                  {"__module__": "backend.nn.chroma"})
    assert dits.find(chroma()).name == "forge neo chroma"
    assert dits.find(flux()).name == "forge neo flux"
    flux2 = flux()
    flux2.double_stream_modulation_img = torch.nn.Linear(2, 2)  # Klein's global modulation
    assert dits.find(flux2).name == "forge neo flux 2"
    assert adapters.neo_form("forge neo chroma").points == \
        adapters.neo_form("forge neo flux").points


def test_hidream_image_first_with_t5_and_two_llama_layers(monkeypatch, lines):
    """[image, T5 + 2 Llama layers]: 5 + 2 x 4 text tokens after 8 x 12 image tokens."""
    check_first_calls(monkeypatch, "hidream", [(0, (1, 8, 12))])


def test_hidream_e1_edit_image_joined_along_the_width(monkeypatch, lines):
    """E1: the edit image joined to the latent's right: one 8 x 16 grid (23 + 8 px wide)."""
    cond = torch.randn(1, 4, 16, 8)
    plain, _ = check_first_calls(monkeypatch, "hidream", [(0, (1, 8, 16))], image_cond=cond)
    assert plain[0][1].shape[1] == 8 * 16 + TEXT + 2 * 4


def test_mochi_video_first_and_text_cropped(monkeypatch, lines):
    """[video, text[:num_tokens]]: 3 frames of 8 x 12, then 3 of the 5 text tokens."""
    plain, _ = check_first_calls(monkeypatch, "mochi", [(0, (3, 8, 12))])
    assert plain[0][1].shape[2] == 3 * 8 * 12 + 3


def test_omnigen2_text_then_references_then_image(monkeypatch, lines):
    """The text, ref and noise refiners' own calls stay whole with references (the noise
    refiner's is pooled without: it is then as long as the image); the joint call [text,
    references, image] is pooled after the references."""
    refs = [torch.randn(1, 4, 8, 12), torch.randn(1, 4, 5, 5)]
    check_first_calls(monkeypatch, "omnigen2", [(3, TEXT + 24 + 9, (1, 8, 12))],
                      ref_latents=refs)
    check_first_calls(monkeypatch, "omnigen2", [(1, 0, (1, 8, 12))])


def test_sd3_values_4d_through_a_kernel_without_masks(monkeypatch, lines):
    """SD3's values reach the backend ``[B, S, heads, D]`` (q and k flattened): the bias
    rides on the extra channel through a kernel that drops masks (Sage's) and gives the
    latent the masked kernel gives."""
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    from comfy.ldm.modules import attention as comfy_attention
    base = dit_model("sd3")
    (ours,) = nodes.ToMePatch().patch(base, **defaults(**FIXED))
    masked = sample(ours, "sd3")
    monkeypatch.setattr(mmdit, "optimized_attention", comfy_attention.attention_sage)
    torch.testing.assert_close(sample(ours, "sd3"), masked, atol=1e-5, rtol=1e-5)
    assert not torch.equal(sample(base, "sd3"), masked)


@pytest.mark.parametrize("family", ["sd3", "aura", "hidream"])
def test_a_host_that_names_no_block_runs_the_point_without_reuse(lines, family):
    """SD3, AuraFlow and HiDream tell no call's block, and residual reuse is kept per block:
    the quality point (x8, reuse every 5 steps) ran x8 on every step and said "residual
    reuse". It runs the preset's point without reuse now (one kind of block: x2 from half
    way), says reuse cannot apply, and gives that point's latent; HunyuanVideo (its blocks
    named) still reuses."""
    base = dit_model(family)
    (ours,) = nodes.ToMePatch().patch(base, **defaults(schedule="all:8", reuse=5, **FIXED))
    assert lines[-1].endswith("residual reuse)") and "cannot apply" in lines[-1]
    out = sample(ours, family)
    assert "refreshed" not in lines[-1]
    (point,) = nodes.ToMePatch().patch(base, **defaults(**{**FIXED, "schedule": "all:2@0.5-1"}))
    assert torch.equal(out, sample(point, family))
    hunyuan = dit_model("hunyuan")
    (reused,) = nodes.ToMePatch().patch(hunyuan, **defaults(schedule="all:8", reuse=5, **FIXED))
    sample(reused, "hunyuan")
    assert "residual reuse refreshed at steps 0" in lines[-1]
