"""ComfyUI after v0.30.0, read on paper (issue 52): stand-ins written from the newer source
(``tests/comfy_stub``, each file naming the commit it was read at), each against a hand-written
reference where the node pools it.

- Z-Image's ``direct_context``: tokens appended to the caption, placed (the caption is longer
  than ``context``);
- Qwen-Image 2.1: block-causal calls per segment, only the target's pooled;
- SenseNova-U1.5: a prefix's keys, then the image's queries; grouped-query heads;
- Prism: passed through with its line;
- core's block-sparse attention recognised by the mark on its override;
- ComfyUI's wrapper and callback kinds read from ``comfy.patcher_extension`` (a renamed value
  still reaches our wrapper); our override's identity; containers and ``preferred_attention``.

The reference (``backend``): an attention backend with ComfyUI's signature that pools by hand:
per key length, where the image starts (None: whole); the image keys and values averaged per
2x2 cell by loops, ``log(cell size)`` on the cells' scores, the host's mask kept (a cell's
entry the mean of its tokens'), keys with fewer heads repeated to the queries' first (GQA), an
einsum softmax."""

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
from comfy_extras import nodes_sparse_attention  # noqa: E402

from tome import dits, override  # noqa: E402
from tome import modelpatcher as mp  # noqa: E402
from tome.comfy import host, nodes  # noqa: E402


def patcher(net):
    return ModelPatcher(BaseModel(net.eval(), ModelSamplingDiscreteFlow(3.0, 1.0)))


def pooled(base, proportional=True):
    (out,) = nodes.ToMePatch().patch(base, preset="custom", method="downsample",
                                     downsample_factor=2, policy="fixed",
                                     proportional=proportional)
    return out


def one_call(p, noise, ctx, **conds):
    """The denoised latent of one model call at sigma 1."""
    return dit_sample(p, noise, ctx, torch.tensor([1.0, 0.0]), **conds)


def cells(n, start, grid):
    """Each key before ``start`` alone, the image's 2x2 cells (fewer at the edges), each key
    after the image alone."""
    if start is None:
        return [[i] for i in range(n)]
    _, h, w = grid
    out = [[i] for i in range(start)]
    out += [[start + i * w + j for i in range(i0, min(i0 + 2, h))
             for j in range(j0, min(j0 + 2, w))]
            for i0 in range(0, h, 2) for j0 in range(0, w, 2)]
    return out + [[i] for i in range(start + h * w, n)]


def backend(layout, grid, proportional=True, seen=None):
    def attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                  skip_output_reshape=False, **kwargs):
        if not skip_reshape:
            d = q.shape[-1] // heads
            q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        n = k.shape[2]
        groups = cells(n, layout.get(n), grid)
        if seen is not None:
            seen.append((n, layout.get(n)))
        kp = torch.stack([sum(k[:, :, i] for i in c) / len(c) for c in groups], 2)
        vp = torch.stack([sum(v[:, :, i] for i in c) / len(c) for c in groups], 2)
        scores = torch.einsum("bhqd,bhkd->bhqk", q.double(), kp.double()) / math.sqrt(q.shape[-1])
        if proportional:
            scores = scores + torch.tensor([math.log(len(c)) for c in groups], dtype=torch.float64)
        if mask is not None:
            m = mask.double() if mask.dtype != torch.bool else \
                torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
            scores = scores + torch.stack([sum(m[..., i] for i in c) / len(c) for c in groups], -1)
        out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), vp.double()).to(q.dtype)
        return out if skip_output_reshape else out.transpose(1, 2).flatten(2)
    return attention


def check(monkeypatch, lines, module, base, noise, ctx, layout, grid, proportional=True,
          name=None, **conds):
    """One model call through the node against the model with ``backend`` in place."""
    ref = one_call(base, noise, ctx, **conds)
    out = one_call(pooled(base, proportional), noise, ctx, **conds)
    if name is not None:
        assert any(x.startswith(f"ToMe: {name} DiT, downsample x2") for x in lines), lines
    seen = []
    monkeypatch.setattr(module, "optimized_attention_masked" if hasattr(
        module, "optimized_attention_masked") else "optimized_attention",
        backend(layout, grid, proportional, seen))
    want = one_call(base, noise, ctx, **conds)
    assert sorted(set(seen)) == sorted(layout.items())
    assert not torch.allclose(want, ref, atol=1e-4)  # it pools
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- Z-Image

@pytest.mark.parametrize("multiple,shape,extra,layout,grid", [
    # Z-Image: caption 5 + 4 direct -> 16 padded; image 7 x 5 = 35 -> 40
    (8, (1, 4, 14, 10), 4, {16: None, 40: 0, 56: 16}, (1, 7, 5)),
    # Lumina 2's layout (no padding): caption 5 + 3 direct; image 6 x 4
    (None, (1, 4, 12, 8), 3, {8: None, 24: 0, 32: 8}, (1, 6, 4)),
])
def test_z_image_direct_context_tokens_count_as_caption(monkeypatch, lines, multiple, shape,
                                                       extra, layout, grid):
    """``direct_context`` (``[B, N, dim]``) joins the prompt's caption before its padding:
    the joint calls are placed after the longer caption and pooled (they were not: the
    caption was read from ``context`` alone)."""
    import comfy.ldm.lumina.model as lumina_model
    from comfy.ldm.lumina.model import NextDiT
    torch.manual_seed(0)
    base = patcher(NextDiT(pad_tokens_multiple=multiple, version="0.30.0"))
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(shape, generator=g), torch.randn(1, 5, 12, generator=g)
    check(monkeypatch, lines, lumina_model, base, noise, ctx, layout, grid,
          name="comfy lumina", direct_context=torch.randn(1, extra, 32, generator=g))


def test_z_image_omni_with_direct_context_is_placed():
    from comfy.ldm.lumina.model import NextDiT

    from tome.dits import comfy_lumina
    model = NextDiT(pad_tokens_multiple=8, version="0.30.0")
    x, ctx = torch.zeros(1, 4, 14, 10), torch.zeros(1, 5, 12)
    conds = {"ref_latents": [x], "direct_context": torch.zeros(1, 4, 32)}
    # captions: the reference's 8 pad tokens, the prompt's 5 + 4 -> 16
    assert comfy_lumina.spans(model, x, ctx, conds) == (8 + 16, True, 40, 1, 7, 5, 5)


# ----------------------------------------------------------------------------- Qwen-Image 2.1

def qwen21():
    from comfy.ldm.qwen_image21.model import QwenImage21Transformer2DModel
    torch.manual_seed(0)
    return QwenImage21Transformer2DModel()


@pytest.mark.parametrize("proportional", [True, False])
@pytest.mark.parametrize("refs,layout", [
    # text 5, target 6 x 8: the text's call (5 keys) whole, the target's (53 keys) pooled
    ((), {5: None, 53: 5}),
    # text[:2], a 4 x 4 reference at slot 2, text[2:], target: keys 2, 18, 21 whole; 69 pooled
    (((1, 4, 4, 4), 2), {2: None, 18: None, 21: None, 69: 21}),
])
def test_qwen_image_21_pools_the_targets_call_only(monkeypatch, lines, proportional, refs,
                                                   layout):
    """Block-causal calls per segment: the text runs (a causal mask) and the references see
    the keys up to their end, whole; the target's queries see every key, the target's
    pooled after the text and references."""
    import comfy.ldm.qwen_image21.model as q21
    base = patcher(qwen21())
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 5, 12, generator=g)
    conds = {}
    if refs:
        conds = {"ref_latents": [torch.randn(refs[0], generator=g)], "image_slots": [refs[1]]}
    check(monkeypatch, lines, q21, base, noise, ctx, layout, (1, 6, 8), proportional,
          name="comfy qwen-image 2.1", **conds)


def test_qwen_image_21_is_read_and_a_first_reference_as_large_as_the_target_is_not_placed():
    from tome.dits import comfy_qwen21
    model = qwen21()
    family = dits.find(model)
    assert family is not None and family.name == "comfy qwen-image 2.1"
    facts, doubles, singles = family.read(model)
    assert not list(doubles) and list(singles) == list(model.transformer_blocks)
    assert facts.patch == 1
    x, ctx = torch.zeros(1, 4, 6, 8), torch.zeros(1, 5, 12)
    assert comfy_qwen21.spans(model, x, ctx, {}) == (5, True, 0, 1, 6, 8, 0, (5,))
    same = {"ref_latents": [torch.zeros(1, 4, 8, 6)], "image_slots": [0]}
    assert comfy_qwen21.spans(model, x, ctx, same) is None  # its own call: 48 keys, like ours


def test_a_layers_preferred_attention_is_dropped_under_any_override(lines):
    """Current ComfyUI drops a layer's ``preferred_attention`` (per-checkpoint int8 attention)
    whenever an override is installed: under the node, every call runs the selected backend
    (what docs/comfyui.md says); without it, the layer's own function."""
    from comfy.ldm.modules.attention import ComfyAttention, attention_pytorch
    base = patcher(qwen21())
    used = []

    def int8(*args, **kwargs):
        used.append(1)
        return attention_pytorch(*args, **kwargs)

    for block in base.model.diffusion_model.transformer_blocks:
        block.preferred = ComfyAttention(int8)
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 5, 12, generator=g)
    one_call(base, noise, ctx)
    assert len(used) == 2 * 2  # two blocks, two segments
    used.clear()
    one_call(pooled(base), noise, ctx)
    assert not used


# ----------------------------------------------------------------------------- SenseNova

def sensenova():
    from comfy.ldm.sensenova.model import SenseNovaU15
    torch.manual_seed(0)
    return SenseNovaU15()


@pytest.mark.parametrize("proportional", [True, False])
def test_sensenova_image_queries_over_a_prefix_with_grouped_heads(monkeypatch, lines,
                                                                  proportional):
    """7 prompt tokens (their causal call whole), a 100 x 150 px image -> 128 x 160 padded ->
    4 x 5 tokens: the image's call (7 + 20 keys, 2 key heads for 4 query heads) pooled after
    the prefix."""
    import comfy.ldm.sensenova.model as sn
    base = patcher(sensenova())
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 3, 100, 150, generator=g)
    ids = torch.randint(0, 50, (1, 7), generator=g)
    check(monkeypatch, lines, sn, base, noise, None, {7: None, 27: 7}, (1, 4, 5),
          proportional, name="comfy sensenova", text_input_ids=ids)


def test_sensenova_spans_from_the_prompt_or_a_precomputed_prefix():
    from tome.dits import comfy_sensenova
    model = sensenova()
    assert dits.find(model).name == "comfy sensenova"
    x = torch.zeros(1, 3, 10, 70)  # 16 x 96 after padding: 1 x 3 tokens
    assert comfy_sensenova.spans(model, x, None, {"text_input_ids": torch.zeros(1, 9)}) \
        == (9, True, 0, 1, 1, 3, 0)
    keys = [torch.zeros(1, 2, 11, 8)] * 2
    assert comfy_sensenova.spans(model, x, None, {"prefix_keys": keys})[0] == 11
    assert comfy_sensenova.spans(model, x, None, {}) is None


# ----------------------------------------------------------------------------- Prism

def test_prism_passes_through_with_its_line(monkeypatch):
    """Prism's video self-attention runs in its own 3-D block-sparse kernel, never the
    override: the node passes it through with one line (it said "not a DiT it can pool")."""
    from torch import nn
    told = []
    monkeypatch.setattr(host, "console", told.append)

    def forward(self, x, *args, **kwargs):
        return x
    prism = type("Prism", (nn.Module,), {"__module__": "comfy.ldm.prism.model",
                                         "forward": forward})()
    prism.fusion_blocks = nn.ModuleList([nn.Identity()])
    base = patcher(prism)
    (out,) = nodes.ToMePatch().patch(base, preset="custom", method="downsample",
                                     policy="fixed")
    assert out is base and not base.wrappers
    ours = [x for x in told if x.startswith("ToMe")]
    assert len(ours) == 1 and "Prism runs its video self-attention in its own 3-D " \
        "block-sparse kernel" in ours[0] and "nothing is pooled" in ours[0], told


# ----------------------------------------------------------------------------- block-sparse

def test_block_sparse_attention_is_recognised_by_its_mark_wherever_it_lives():
    """Current ComfyUI marks its block-sparse override (``_block_sparse_attention_patch``):
    the mark names it wherever its code lives (a callable of another module, its settings
    held under another name); an unmarked override of another module is not taken for it."""
    patch = nodes_sparse_attention.SparseAttnPatch(1.0, 0.0, 0, set())

    class Moved:  # core's override, moved and refactored: only the mark is the contract
        _block_sparse_attention_patch = patch
        _block_sparse_attention_previous = None

        def __call__(self, func, *args, **kwargs):
            return func(*args, **kwargs)

    assert host.sparse_patch(Moved()) is patch
    fn = nodes_sparse_attention.make_attention_override(patch, None)
    assert host.sparse_patch(fn) is patch
    assert host.sparse_patch(lambda func, *a, **k: func(*a, **k)) is None
    q = torch.zeros(1, 8, 2, 128)  # CPU: the node's kernel declines, so nothing is left
    assert host.leaves(Moved(), (q, q, q, 2), {"skip_reshape": True}) is None


def test_v0_30s_unmarked_block_sparse_override_is_still_recognised(monkeypatch):
    """v0.30.0's node carries no mark: its closure's ``patch`` still names it."""
    monkeypatch.setattr(nodes_sparse_attention, "MARKED", False)
    patch = nodes_sparse_attention.SparseAttnPatch(1.0, 0.0, 0, set())
    fn = nodes_sparse_attention.make_attention_override(patch, None)
    assert not hasattr(fn, host.SPARSE_MARK) and host.sparse_patch(fn) is patch
    q = torch.zeros(1, 8, 2, 128)  # the stand-in's kernel takes CPU calls: left to it
    assert host.leaves(fn, (q, q, q, 2), {"skip_reshape": True}) == host.SPARSE


# ----------------------------------------------------------------------------- names, identity

def test_a_renamed_wrapper_kind_still_reaches_our_wrapper(monkeypatch, lines):
    """ComfyUI's ``WrappersMP``/``CallbacksMP`` values are read from its module at use: a
    ComfyUI that renames ``apply_model`` (here ``apply_model_v2``) still calls our wrapper,
    and our run callbacks sit under its names; nothing is missing."""
    import comfy.ldm.lumina.model as lumina_model  # noqa: F401
    from comfy.ldm.lumina.model import NextDiT
    from comfy.patcher_extension import CallbacksMP, WrappersMP
    monkeypatch.setattr(WrappersMP, "APPLY_MODEL", "apply_model_v2")
    monkeypatch.setattr(CallbacksMP, "ON_PRE_RUN", "on_pre_run_v2")
    torch.manual_seed(0)
    base = patcher(NextDiT(pad_tokens_multiple=8, version="0.30.0"))
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 14, 10, generator=g), torch.randn(1, 5, 12, generator=g)
    ref = one_call(base, noise, ctx)
    ours = pooled(base)
    assert "apply_model_v2" in ours.wrappers and "on_pre_run_v2" in ours.callbacks
    assert override.carried(ours)
    assert not torch.equal(one_call(ours, noise, ctx), ref)
    assert lines[-1].startswith("ToMe: pooled "), lines[-1]
    assert host.patcher_names_missing() == []
    override.strip(ours)
    assert not override.carried(ours) and not ours.callbacks.get("on_pre_run_v2", {}).get("tome")


def test_names_fall_back_to_0_8_0s_strings_and_missing_ones_are_named(monkeypatch):
    monkeypatch.delitem(sys.modules, mp.PATCHER_EXTENSION)
    assert mp.comfy_name("WrappersMP", "APPLY_MODEL") == "apply_model"
    assert mp.comfy_names_missing() == []
    bare = type(sys)("comfy.patcher_extension")
    bare.WrappersMP = type("WrappersMP", (), {"APPLY_MODEL": "apply_model"})
    monkeypatch.setitem(sys.modules, mp.PATCHER_EXTENSION, bare)
    assert "CallbacksMP.ON_PRE_RUN" in mp.comfy_names_missing()
    assert "WrappersMP.APPLY_MODEL" not in mp.comfy_names_missing()


def test_our_override_has_a_stable_identity_and_takes_tensors_not_containers():
    """What a pack that checks which attention ran reads (``__module__``, ``__qualname__``,
    ``tome_override``); never ``attention_preprocess_v1`` (we change key lengths) nor
    ``container_function`` (ComfyUI then hands q, k, v as tensors)."""
    from comfy.ldm.modules.attention import AttentionTensorContainer, attention_pytorch
    pool = override.KvPool()
    assert pool.tome_override == override.IDENTITY == "tome.override.KvPool/1"
    assert f"{pool.__module__}.{pool.__qualname__}" == "tome.override.KvPool"
    assert not hasattr(pool, "attention_preprocess_v1")
    assert not hasattr(pool, "container_function")
    q = torch.randn(1, 2, 6, 8)
    want = attention_pytorch(q, q, q, 2, skip_reshape=True)
    got = attention_pytorch(*(AttentionTensorContainer(q) for _ in range(3)), 2,
                            skip_reshape=True, transformer_options={override.OVERRIDE: pool})
    torch.testing.assert_close(got, want)


def test_kandinsky_6_passes_through_with_its_line(monkeypatch):
    """Kandinsky 6 is called with a joint video and audio latent (a pair): the override's
    wrapper does not read it, so the node says so and installs nothing (it said "not a DiT
    it can pool")."""
    from torch import nn
    told = []
    monkeypatch.setattr(host, "console", told.append)

    def forward(self, x, *args, **kwargs):
        return x
    k6 = type("Kandinsky6NativeAVDiT", (nn.Module,),
              {"__module__": "comfy.ldm.kandinsky6.model", "forward": forward})()
    k6.visual_blocks = nn.ModuleList([nn.Identity()])
    base = patcher(k6)
    (out,) = nodes.ToMePatch().patch(base, preset="custom", method="downsample",
                                     policy="fixed")
    assert out is base and not base.wrappers
    ours = [x for x in told if x.startswith("ToMe")]
    assert len(ours) == 1 and "Kandinsky 6 is called with a joint video and audio latent" \
        in ours[0] and "nothing is pooled" in ours[0], told
