"""ComfyUI's DiT families whose self-attention is over the image alone, or that run refiner
calls before their joint blocks (issue 41): Lumina 2 and Z-Image, LTX-Video, Cosmos predict1
and predict2, Kandinsky 5. Each against a tiny stand-in (``tests/comfy_stub/comfy/ldm/``,
true to ComfyUI 0.8.0's and v0.30.0's call shapes where they differ): one model call through
the ToMe node against a hand-written reference (the stand-in's own attention swapped for
``reference_backend``: keys and values pooled per cell of each frame by loops, ``log(cell
size)`` on the cells' scores, an einsum softmax; the calls it must leave alone run whole),
a sampling that is finite, close and the same for the same seed, and the model without the
node bit-identical."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from comfy.model_base import BaseModel  # noqa: E402
from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingDiscreteFlow  # noqa: E402
from comfy.sampling import dit_sample  # noqa: E402

from tome import dits  # noqa: E402
from tome.comfy import nodes  # noqa: E402

VERSIONS = ["0.8.0", "0.30.0"]


def pooled(base, proportional=True, factor=2):
    (out,) = nodes.ToMePatch().patch(base, preset="custom", method="downsample",
                                     downsample_factor=factor, policy="fixed",
                                     proportional=proportional)
    return out


def patcher(net, shift=3.0, multiplier=1.0):
    return ModelPatcher(BaseModel(net.eval(), ModelSamplingDiscreteFlow(shift, multiplier)))


def groups(length, start, grid, f):
    """The reference's keys: each token before ``start`` alone, then the image's cells (per
    frame, ``f x f`` tokens, fewer at the bottom and right edges), then each token after the
    image alone (loops, row-major within each frame)."""
    frames, h, w = grid
    out = [[i] for i in range(start)]
    for t in range(frames):
        for i0 in range(0, h, f):
            for j0 in range(0, w, f):
                out.append([start + t * h * w + i * w + j for i in range(i0, min(i0 + f, h))
                            for j in range(j0, min(j0 + f, w))])
    return out + [[i] for i in range(start + frames * h * w, length)]


def reference_backend(layout, grid, f=2, proportional=True, seen=None):
    """An attention backend with ComfyUI's signature that pools by hand: ``layout`` maps a
    self-attention call's key length to where its image starts (None: that call runs whole,
    as every call whose length is not in it: cross-attention, text alone)."""
    def backend(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                skip_output_reshape=False, **kwargs):
        if not skip_reshape:
            q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
        n = k.shape[2]
        start = layout.get(n)  # queries as many, or fewer (v0.30.0's guided LTX-Video)
        cells = groups(n, start, grid, f) if start is not None else [[i] for i in range(n)]
        if seen is not None:
            seen.append((n, start))
        kp = torch.stack([sum(k[:, :, i] for i in c) / len(c) for c in cells], 2)
        vp = torch.stack([sum(v[:, :, i] for i in c) / len(c) for c in cells], 2)
        scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), kp.float()) / math.sqrt(q.shape[-1])
        if proportional:
            scores = scores + torch.tensor([math.log(len(c)) for c in cells])
        if mask is not None:
            m = mask if mask.dtype != torch.bool else \
                torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
            while m.dim() < 4:
                m = m.unsqueeze(0)
            scores = scores + torch.stack([sum(m[..., i] for i in c) / len(c) for c in cells],
                                          -1)
        out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vp.float()).to(q.dtype)
        return out if skip_output_reshape else out.transpose(1, 2).flatten(2)
    return backend


def one_call(p, noise, ctx, **conds):
    """The denoised latent of one model call at sigma 1 (x is the noise)."""
    return dit_sample(p, noise, ctx, torch.tensor([1.0, 0.0]), **conds)


def close(a, b, tol=0.2):
    return bool(torch.isfinite(a).all()) and float((a - b).norm() / b.norm()) < tol


def check_sampling(base, noise, ctx, sigmas, **conds):
    """Four steps with and without the node: finite, close, not equal; the same seed gives
    the same latent; the input model stays bit-identical."""
    ref = dit_sample(base, noise, ctx, sigmas, **conds)
    ours = pooled(base)
    out = dit_sample(ours, noise, ctx, sigmas, **conds)
    assert not torch.equal(out, ref) and close(out, ref)
    assert torch.equal(dit_sample(ours, noise, ctx, sigmas, **conds), out)
    assert torch.equal(dit_sample(base, noise, ctx, sigmas, **conds), ref)
    return ours


SIGMAS = torch.tensor([1.0, 0.9, 0.75, 0.5, 0.0])


# ----------------------------------------------------------------------------- Lumina 2, Z-Image

def lumina(version, multiple=None, seed=0):
    from comfy.ldm.lumina.model import NextDiT
    torch.manual_seed(seed)
    return NextDiT(pad_tokens_multiple=multiple, version=version)


# (pad multiple, latent, text): (layout by key length, token grid)
LUMINA_CASES = {
    "z-image": (8, (1, 4, 14, 10), 5, {8: None, 40: 0, 48: 8}, (1, 7, 5)),
    "lumina 2": (None, (1, 4, 12, 8), 5, {5: None, 24: 0, 29: 5}, (1, 6, 4)),
    # a caption as long as the image: the refiners' calls cannot be told apart, both whole
    "text as long as the image": (None, (1, 4, 12, 8), 24, {24: None, 48: 24}, (1, 6, 4)),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", list(LUMINA_CASES))
@pytest.mark.parametrize("proportional", [True, False])
def test_lumina_and_z_image_against_a_hand_written_reference(monkeypatch, lines, version, case,
                                                             proportional):
    """The caption refiner whole, the image refiner's call pooled from its first token (its
    padding whole), the joint calls pooled after the padded caption; the padded image's pad
    tokens whole. With a caption as long as the image, both refiners run whole."""
    import comfy.ldm.lumina.model as lumina_model
    multiple, shape, text, layout, grid = LUMINA_CASES[case]
    base = patcher(lumina(version, multiple))
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(shape, generator=g), torch.randn(1, text, 12, generator=g)
    # 0.8.0's caption refiner takes the conditioning's mask (Lumina 2's: no caption padding)
    mask = torch.ones(1, text, dtype=torch.bool) if version == "0.8.0" and not multiple \
        else None
    conds = {"attention_mask": mask} if mask is not None else {}
    ref = one_call(base, noise, ctx, **conds)
    out = one_call(pooled(base, proportional), noise, ctx, **conds)
    assert lines[0].startswith("ToMe: comfy lumina DiT, downsample x2")
    seen = []
    monkeypatch.setattr(lumina_model, "optimized_attention_masked",
                        reference_backend(layout, grid, 2, proportional, seen))
    want = one_call(base, noise, ctx, **conds)
    assert sorted(set(seen)) == sorted(layout.items())
    assert not torch.allclose(want, ref, atol=1e-4)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("version", VERSIONS)
def test_z_image_samples_close_and_the_same_for_the_same_seed(lines, version):
    base = patcher(lumina(version, 8))
    g = torch.Generator().manual_seed(2)
    noise, ctx = torch.randn(1, 4, 14, 10, generator=g), torch.randn(1, 5, 12, generator=g)
    check_sampling(base, noise, ctx, SIGMAS)
    assert lines[-1].startswith("ToMe: pooled ")


@pytest.mark.parametrize("proportional", [True, False])
def test_z_image_omni_against_a_hand_written_reference(monkeypatch, lines, proportional):
    """v0.30.0's Z-Image omni: [captions (the reference's, the prompt's), SigLIP features (the
    reference's, the image's pad tokens), the reference image, the image], each padded to 8.
    The captions' and the features' refiner calls whole; the images' refiner call and the
    joint calls pooled from the image's first token, the reference image whole."""
    import comfy.ldm.lumina.model as lumina_model
    from comfy.ldm.lumina.model import NextDiT
    torch.manual_seed(0)
    base = patcher(NextDiT(pad_tokens_multiple=8, version="0.30.0", siglip_feat_dim=12))
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 14, 10, generator=g), torch.randn(1, 5, 12, generator=g)
    conds = {"ref_latents": [torch.randn(1, 4, 6, 8, generator=g)],
             "ref_contexts": [torch.randn(1, 3, 12, generator=g)],
             "siglip_feats": [torch.randn(1, 2, 3, 12, generator=g)]}
    ref = one_call(base, noise, ctx, **conds)
    out = one_call(pooled(base, proportional), noise, ctx, **conds)
    # captions 8 + 8, SigLIP 8 + 8; reference image 3 x 4 -> 16; image 7 x 5 -> 40
    layout = {16: None, 16 + 40: 16, 32 + 16 + 40: 32 + 16}
    seen = []
    monkeypatch.setattr(lumina_model, "optimized_attention_masked",
                        reference_backend(layout, (1, 7, 5), 2, proportional, seen))
    want = one_call(base, noise, ctx, **conds)
    assert sorted(set(seen)) == sorted(layout.items())
    assert not torch.allclose(want, ref, atol=1e-4)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_lumina_is_read_with_its_layers_and_places_z_image_omni_calls():
    from tome.dits import comfy_lumina
    model = lumina("0.30.0", 8)
    family = dits.find(model)
    assert family is not None and family.name == "comfy lumina"
    facts, doubles, singles = family.read(model)
    assert list(doubles) == list(model.layers) and not list(singles) and facts.patch == 2
    x, ctx = torch.zeros(1, 4, 14, 10), torch.zeros(1, 5, 12)
    assert comfy_lumina.spans(model, x, ctx, {}) == (8, True, 0, 1, 7, 5, 5)
    assert comfy_lumina.spans(model, x, ctx, {"ref_latents": [x]}) == (8 + 8, True, 40, 1, 7,
                                                                      5, 5)
    assert comfy_lumina.spans(lumina("0.30.0"), x, ctx, {"ref_latents": [x]}) is None  # no pad
    # captions 8 + 72 as long as the images 40 + 40: not placed
    assert comfy_lumina.spans(model, x, torch.zeros(1, 72, 12), {"ref_latents": [x]}) is None


def test_spans_leave_an_image_only_call_as_long_as_the_text():
    """``kv.Spans.start``: where a family has text, an image-only call as long as the
    text is not placed (Lumina's caption refiner); joint and other image-only calls are."""
    from tome.kv import Spans
    same = Spans(24, True, 0, 1, 6, 4, 0)
    assert same.start(48) == 24 and same.start(24) is None
    padded = Spans(8, True, 0, 1, 7, 5, 5)
    assert (padded.start(48), padded.start(40), padded.start(8)) == (8, 0, None)
    assert padded.start(40, whole=True) is None
    assert Spans(0, True, 0, 3, 2, 2, 0).start(12) == 0  # Wan: no text, image alone


# ------------------------------------------------------------------- image-only self-attention

def ltxv(version):
    from comfy.ldm.lightricks.model import LTXVModel
    torch.manual_seed(0)
    return LTXVModel(version=version)


def cosmos(version, predict):
    from comfy.ldm.cosmos.model import GeneralDIT
    from comfy.ldm.cosmos.predict2 import MiniTrainDIT
    torch.manual_seed(0)
    return MiniTrainDIT(version=version) if predict == 2 else GeneralDIT()


def kandinsky(version):
    from comfy.ldm.kandinsky5.model import Kandinsky5
    torch.manual_seed(0)
    return Kandinsky5()


def attention_modules():
    import comfy.ldm.cosmos.model
    import comfy.ldm.cosmos.predict2
    import comfy.ldm.kandinsky5.model
    import comfy.ldm.modules.attention
    return {"ltx-video": (comfy.ldm.modules.attention, ("optimized_attention",
                                                        "optimized_attention_masked")),
            "cosmos 1": (comfy.ldm.cosmos.model, ("optimized_attention",)),
            "cosmos 2": (comfy.ldm.cosmos.predict2, ("optimized_attention",)),
            "kandinsky 5": (comfy.ldm.kandinsky5.model, ("optimized_attention",)),
            "kandinsky 5 image": (comfy.ldm.kandinsky5.model, ("optimized_attention",))}


# name: (model, family, latent, token grid (frames first), tokens after the video, conds)
GUIDES = torch.zeros(1, 3, 30, 2)  # one guide frame's 6 x 5 tokens
VIDEO_CASES = {
    "ltx-video": (ltxv, "comfy ltx-video", (1, 8, 3, 6, 5), (3, 6, 5), 0,
                  {"attention_mask": torch.zeros(1, 1, 1, 5)}),
    "ltx-video guided": (ltxv, "comfy ltx-video", (1, 8, 3, 6, 5), (2, 6, 5), 30,
                         {"keyframe_idxs": GUIDES}),
    # v0.30.0: the guided self-attention's queries split, a log(strength) mask on the guides
    "ltx-video guide mask": (ltxv, "comfy ltx-video", (1, 8, 3, 6, 5), (2, 6, 5), 30,
                             {"keyframe_idxs": GUIDES,
                              "guide_attention_entries": [{"strength": 0.5}]}),
    "cosmos 1": (lambda v: cosmos(v, 1), "comfy cosmos", (1, 4, 2, 8, 10), (2, 4, 5), 0, {}),
    "cosmos 2": (lambda v: cosmos(v, 2), "comfy cosmos", (1, 4, 2, 8, 10), (2, 4, 5), 0, {}),
    "cosmos 2 padded": (lambda v: cosmos(v, 2), "comfy cosmos", (1, 4, 2, 7, 9), (2, 4, 5), 0,
                        {}),  # v0.30.0 pads to whole patches, 0.8.0 asserts them
    "kandinsky 5": (kandinsky, "comfy kandinsky 5", (1, 4, 3, 6, 8), (3, 3, 4), 0, {}),
    "kandinsky 5 image": (kandinsky, "comfy kandinsky 5", (1, 4, 10, 14), (1, 5, 7), 0, {}),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", list(VIDEO_CASES))
@pytest.mark.parametrize("proportional", [True, False])
def test_image_only_self_attention_against_a_hand_written_reference(monkeypatch, lines, version,
                                                                    case, proportional):
    """The self-attention over the video (or image) tokens pooled per cell of each frame,
    guide frames after the video whole; the cross-attention to the text and Kandinsky's
    text self-attention whole."""
    make, name, shape, grid, after, conds = VIDEO_CASES[case]
    if case == "cosmos 2 padded" and version == "0.8.0":
        pytest.skip("ComfyUI 0.8.0's predict2 takes whole patches only")
    base = patcher(make(version))
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(shape, generator=g), torch.randn(1, 5, 12, generator=g)
    ref = one_call(base, noise, ctx, **conds)
    out = one_call(pooled(base, proportional), noise, ctx, **conds)
    assert lines[0].startswith(f"ToMe: {name} DiT, downsample x2")
    tokens = math.prod(grid) + after
    seen = []
    module, names = attention_modules()[case.split(" guide")[0].replace(" padded", "")]
    for attr in names:
        monkeypatch.setattr(module, attr,
                            reference_backend({tokens: 0}, grid, 2, proportional, seen))
    want = one_call(base, noise, ctx, **conds)
    assert (tokens, 0) in seen and (5, None) in seen  # the text: cross-attention, its own
    split = case == "ltx-video guide mask" and version != "0.8.0"  # two query groups a block
    assert seen.count((tokens, 0)) == (4 if split else 2)  # two blocks
    assert not torch.allclose(want, ref, atol=1e-4)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", ["ltx-video", "cosmos 2", "kandinsky 5"])
def test_video_families_sample_close_and_the_same_for_the_same_seed(lines, version, case):
    make, _, shape, _, _, conds = VIDEO_CASES[case]
    g = torch.Generator().manual_seed(2)
    noise, ctx = torch.randn(shape, generator=g), torch.randn(1, 5, 12, generator=g)
    check_sampling(patcher(make(version)), noise, ctx, SIGMAS, **conds)
    assert lines[-1].startswith("ToMe: pooled ")


def test_video_families_are_read_and_place_only_what_they_can_tell_apart():
    from tome.dits import comfy_cosmos, comfy_kandinsky, comfy_ltxv
    for make, name, blocks in [(ltxv, "comfy ltx-video", "transformer_blocks"),
                               (lambda v: cosmos(v, 2), "comfy cosmos", "blocks"),
                               (kandinsky, "comfy kandinsky 5", "visual_transformer_blocks")]:
        model = make("0.30.0")
        family = dits.find(model)
        assert family is not None and family.name == name
        assert list(family.read(model)[1]) == list(getattr(model, blocks))
    one = cosmos("0.8.0", 1)
    assert list(dits.find(one).read(one)[1]) == list(one.blocks.values())  # a ModuleDict
    video, text = torch.zeros(1, 8, 3, 6, 5), torch.zeros(1, 5, 12)
    model = ltxv("0.8.0")
    assert comfy_ltxv.spans(model, video, text, {}) == (0, True, 0, 3, 6, 5, 0, (5,))
    assert comfy_ltxv.spans(model, video, text, {"keyframe_idxs": torch.zeros(1, 3, 7, 2)}) \
        is None  # guide tokens that are not whole frames
    assert comfy_ltxv.spans(model, video, torch.zeros(1, 90, 12), {}) is None  # text as long
    assert comfy_cosmos.spans(cosmos("0.8.0", 2), torch.zeros(1, 4, 2, 7, 9), text, {}) \
        == (0, True, 0, 2, 4, 5, 0, (5,))
    assert comfy_cosmos.spans(cosmos("0.8.0", 2), torch.zeros(1, 4, 2, 7, 9), text,
                              {"t5xxl_ids": torch.zeros(1, 30)})[-1] == (5, 512)  # Anima
    k5 = kandinsky("0.8.0")
    assert comfy_kandinsky.spans(k5, torch.zeros(1, 4, 10, 14), text, {}) \
        == (0, True, 0, 1, 5, 7, 0, (5,))
    assert comfy_kandinsky.spans(k5, torch.zeros(1, 4, 4, 6), torch.zeros(1, 6, 12), {}) is None


def test_ltx_2_audio_video_is_not_claimed_as_ltx_video():
    """LTX-2 (``LTXAVModel``, a subclass of ``LTXVModel``) runs audio self-attention and
    audio-video cross-attention in the same call: not placed, so not claimed."""
    from comfy.ldm.lightricks.model import LTXVModel
    LTXAVModel = type("LTXAVModel", (LTXVModel,), {"__module__": "comfy.ldm.lightricks.av_model"})
    assert dits.find(LTXAVModel()) is None or dits.find(LTXAVModel()).name != "comfy ltx-video"


@pytest.mark.parametrize("proportional", [True, False])
def test_wan_in_context_references_stay_whole_against_a_hand_written_reference(
        monkeypatch, lines, proportional):
    """v0.30.0's Wan in-context references (``context_latents``: latents appended after the
    video's tokens, each its own grid): the video pooled per frame, the references' tokens
    whole (before, the call's 60 tokens could not be placed: nothing was pooled)."""
    import comfy.ldm.wan.model as wan_model
    from comfy.ldm.wan.model import WanModel
    torch.manual_seed(0)
    base = patcher(WanModel(), shift=8.0, multiplier=1000)
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 3, 6, 8, generator=g), torch.randn(1, 5, 12, generator=g)
    conds = {"context_latents": [torch.randn(1, 4, 2, 6, 7, generator=g)]}
    ref = one_call(base, noise, ctx, **conds)
    out = one_call(pooled(base, proportional), noise, ctx, **conds)
    assert lines[0].startswith("ToMe: comfy wan DiT, downsample x2")
    seen = []
    monkeypatch.setattr(wan_model, "optimized_attention",
                        reference_backend({36 + 2 * 3 * 4: 0}, (3, 3, 4), 2, proportional,
                                          seen))
    want = one_call(base, noise, ctx, **conds)
    assert sorted(set(seen)) == [(5, None), (60, 0)]
    assert not torch.allclose(want, ref, atol=1e-4)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


LONG_TEXT = {  # name: (model, latent, layout by key length, grid)
    "ltx-video": (lambda: ltxv("0.30.0"), (1, 8, 3, 6, 5), "ltx-video", {90: 0}, (3, 6, 5)),
    "cosmos 2": (lambda: cosmos("0.30.0", 2), (1, 4, 2, 7, 9), "cosmos 2", {40: 0}, (2, 4, 5)),
    "kandinsky 5": (lambda: kandinsky("0.30.0"), (1, 4, 3, 6, 8), "kandinsky 5", {36: 0},
                    (3, 3, 4)),
}


@pytest.mark.parametrize("case", list(LONG_TEXT))
def test_a_text_longer_than_the_video_is_cross_attention_not_extra_keys(monkeypatch, lines,
                                                                        case):
    """120 text tokens, fewer video tokens: the cross-attention's keys are longer than its
    queries, like a self-attention with extra keys; the spans' ``cross`` keeps it whole
    (it was pooled as the video's keys before)."""
    make, shape, module, layout, grid = LONG_TEXT[case]
    base = patcher(make())
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(shape, generator=g), torch.randn(1, 120, 12, generator=g)
    out = one_call(pooled(base), noise, ctx)
    seen = []
    module, names = attention_modules()[module]
    for attr in names:
        monkeypatch.setattr(module, attr, reference_backend(layout, grid, 2, True, seen))
    want = one_call(base, noise, ctx)
    assert (120, None) in seen
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_a_wan_text_longer_than_the_video_is_cross_attention(monkeypatch, lines):
    """Wan's 512-token text against a small video: its cross-attention stays whole."""
    import comfy.ldm.wan.model as wan_model
    from comfy.ldm.wan.model import WanModel
    torch.manual_seed(0)
    base = patcher(WanModel(), shift=8.0, multiplier=1000)
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 2, 6, 8, generator=g), torch.randn(1, 40, 12, generator=g)
    out = one_call(pooled(base), noise, ctx)
    seen = []
    monkeypatch.setattr(wan_model, "optimized_attention",
                        reference_backend({24: 0}, (2, 3, 4), 2, True, seen))
    want = one_call(base, noise, ctx)
    assert sorted(set(seen)) == [(24, 0), (40, None)]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_comfyuis_model_base_named_like_the_diffusion_model_is_not_claimed(lines):
    """ComfyUI's model base for Kandinsky 5 is ``comfy.model_base.Kandinsky5`` (the image
    one its subclass ``Kandinsky5Image``), the name of the diffusion model it holds: only
    the diffusion model (``comfy.ldm``) is the family's (the real v0.30.0 read the base and
    passed the model through)."""
    base = type("Kandinsky5", (BaseModel,), {"__module__": "comfy.model_base"})
    image = type("Kandinsky5Image", (base,), {"__module__": "comfy.model_base"})
    for cls in (base, image):
        model = ModelPatcher(cls(kandinsky("0.30.0").eval(), ModelSamplingDiscreteFlow(3.0, 1.0)))
        assert dits.find(model.model) is None
        g = torch.Generator().manual_seed(1)
        noise, ctx = torch.randn(1, 4, 10, 14, generator=g), torch.randn(1, 5, 12, generator=g)
        assert not torch.equal(one_call(pooled(model), noise, ctx), one_call(model, noise, ctx))
        assert any(line.startswith("ToMe: comfy kandinsky 5 DiT, downsample x2")
                   for line in lines)
        lines.clear()


# ----------------------------------------------------------------------------- CogVideoX (v0.30.0)

@pytest.mark.parametrize("patch_t", [None, 2])
@pytest.mark.parametrize("proportional", [True, False])
def test_cogvideox_against_a_hand_written_reference(monkeypatch, lines, patch_t, proportional):
    """CogVideoX 1.0 (a token grid per latent frame) and 1.5 (two frames a patch, 3 latent
    frames padded to 4): the joint [text, video] calls pooled after the text, per frame."""
    import comfy.ldm.cogvideo.model as cog
    torch.manual_seed(0)
    base = patcher(cog.CogVideoXTransformer3DModel(patch_size_t=patch_t))
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 3, 6, 9, generator=g), torch.randn(1, 5, 12, generator=g)
    ref = one_call(base, noise, ctx)
    out = one_call(pooled(base, proportional), noise, ctx)
    assert lines[0].startswith("ToMe: comfy cogvideox DiT, downsample x2")
    grid = (3 if patch_t is None else 2, 3, 5)
    seen = []
    monkeypatch.setattr(cog, "optimized_attention", reference_backend(
        {5 + math.prod(grid): 5}, grid, 2, proportional, seen))
    want = one_call(base, noise, ctx)
    assert set(seen) == {(5 + math.prod(grid), 5)}
    assert not torch.allclose(want, ref, atol=1e-4)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_cogvideox_samples_close_and_the_same_for_the_same_seed(lines):
    import comfy.ldm.cogvideo.model as cog
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    noise, ctx = torch.randn(1, 4, 3, 6, 9, generator=g), torch.randn(1, 5, 12, generator=g)
    check_sampling(patcher(cog.CogVideoXTransformer3DModel()), noise, ctx, SIGMAS)
    assert lines[-1].startswith("ToMe: pooled ")


@pytest.mark.parametrize("make", [lambda: ltxv("0.8.0"), lambda: cosmos("0.30.0", 2),
                                  lambda: cosmos("0.8.0", 1)])
def test_families_whose_calls_name_no_block_say_a_per_block_setting_pools_nothing(lines, make):
    """LTX-Video, Cosmos (predict2 names its block in v0.30.0 only) and CogVideoX pass no block
    index: read as ``UnnamedDit`` (one factor, no residual reuse); ``blocks`` naming some of
    their blocks pools nothing, said in one line, the model passed through (it said "1/2
    blocks pooled", then "no attention call had the lengths ...")."""
    base = patcher(make())
    assert not dits.find(base.model.diffusion_model).read(base.model.diffusion_model)[0] \
        .names_blocks
    (out,) = nodes.ToMePatch().patch(base, preset="custom", method="downsample",
                                     downsample_factor=2, policy="fixed", blocks="0")
    assert out is base
    assert lines == ["ToMe: blocks='0' gives this DiT's blocks different factors, but its "
                     "attention calls do not name their block; nothing is pooled (set one "
                     "factor for all blocks); the model passes through unchanged"]
