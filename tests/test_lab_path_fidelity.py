"""The lab's path comparison (``tome_lab/path_fidelity.py``): the tiny DiT's weights sampled
through ComfyUI's path (a ``ModelPatcher`` clone patched by the library, the attention
override per model call, residual reuse reset by the run callbacks) and through the
diffusers path (``tome.apply_patch``), at tiny sizes (32 px, 4-6 Euler steps, one image)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def result():
    from tome_lab import path_fidelity
    torch.manual_seed(0)
    return path_fidelity.compare([(1, 3)], steps=6, size=32)


def test_unpatched_paths_give_the_same_image(result):
    """Same weights, noise and sigmas: ComfyUI's form (sigma as timestep, denoised latent,
    Euler on it, attention through ``optimized_attention``) is the diffusers sampler's image
    within float error."""
    assert result["unpatched"] < 1e-5


def test_presets_fidelity_through_comfyui_equals_the_diffusers_paths(result):
    """Each preset as named through the ComfyUI path is the diffusers path's image, pixel for
    pixel within float error and so within 0.5 dB: the presets' DiT points rotate keys before
    pooling (``rope="before"``), the RoPE option the ComfyUI path applies (its keys arrive
    rotated), so nothing is left out there; residual reuse applied (the path without run
    callbacks, the preset's point without reuse, is far from it)."""
    from tome_lab import path_fidelity
    assert [r["preset"] for r in result["rows"]] == ["quality", "fast"]
    for r in result["rows"]:
        assert r["config"].reuse and r["config"].rope == "before"
        assert r["pixels"] < 1e-4
        assert abs(r["comfyui"] - r["diffusers"]) < 0.5
        assert abs(r["comfyui"] - r["no_reuse"]) > 0.5
        assert r["limits"] == []  # no "rope pooled (keys arrive rotated: ...)" line
        assert 10 < r["diffusers"] < 60 and 10 < r["comfyui"] < 60
    text = path_fidelity.table(result)
    assert "| quality (`all:8`, reuse 5, rope before) |" in text
    assert text.count("\n|") == 4  # header, rule, a row per preset


def test_the_comfyui_form_calls_attention_through_the_override():
    """The stand-in's blocks reach attention as ComfyUI's Flux does: ``[B, heads, S, D]``
    with ``skip_reshape``, ``block_type``/``block_index`` in the call's options, an override
    there called with the backend (which adds masks)."""
    from tome_lab import path_fidelity
    patcher, table = path_fidelity.comfy_model()
    seen = []

    def override(func, q, k, v, heads, **kw):
        options = kw["transformer_options"]
        seen.append((options["block_type"], options["block_index"], q.dim(), q.shape[1],
                     k.shape[2], kw["skip_reshape"], func.__name__))
        return func(q, k, v, heads, **kw)

    clone = patcher.clone()
    clone.model_options["transformer_options"]["optimized_attention_override"] = override
    path_fidelity.comfy_sample(clone, table, [0], steps=1, size=16)
    tokens = 4 + 8 * 8  # text, then the 16 px image packed 2x2
    assert seen == [("double", i, 4, 3, tokens, True, "attention_pytorch") for i in range(3)] + \
        [("single", i, 4, 3, tokens, True, "attention_pytorch") for i in range(3)]


def test_with_guidance_cond_and_uncond_in_one_call_agree_too():
    """Classifier-free guidance (cond and uncond batched in one call, ``cond_or_uncond`` [0,
    1]; the diffusers sampler batches the null class alike): unpatched the same image, and the
    quality preset's ComfyUI image the diffusers path's (both ``rope="before"``)."""
    from tome_lab import path_fidelity
    result = path_fidelity.compare([(2, 1)], steps=4, size=32, presets=("quality",),
                                   guidance=3.0)
    (row,) = result["rows"]
    assert result["unpatched"] < 1e-5 and row["pixels"] < 1e-4
    assert abs(row["comfyui"] - row["diffusers"]) < 0.5
