"""tome.memory: measuring never starts a run that would not fit (issue: a CPU host was killed
by the out-of-memory killer measuring SD1.5 at 1024 px with the basic attention)."""

from __future__ import annotations

import sys
import types
from collections import namedtuple

import psutil
import pytest
import torch
from models import TINY_SD15, ldm_inputs, ldm_unet

import tome
from tome import measurements as C
from tome import memory
from tome.config import ToMeConfig
from tome.patch import run_block

VM = namedtuple("VM", "available")


@pytest.fixture
def small_memory(monkeypatch):
    """The machine reports 64 MiB available (psutil, as a real host would)."""
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM(64 << 20))


@pytest.mark.parametrize("backend, full", [
    ("ldm.modules.attention.CrossAttention.forward", True),  # stock ldm: einsum, full
    ("backend.nn.unet.CrossAttention.forward backend.attention.attention_basic", True),
    ("backend.nn.unet.CrossAttention.forward backend.attention.attention_pytorch", False),
    ("ldm_patched.ldm.modules.attention.CrossAttention.forward "
     "ldm_patched.ldm.modules.attention.attention_sub_quad", False),
    ("modules.sd_hijack_optimizations.split_cross_attention_forward_invokeAI", False),
    ("modules.sd_hijack_optimizations.scaled_dot_product_attention_forward", False),
    ("modules.sd_hijack_optimizations.xformers_attention_forward", False),
    ("AttnProcessor2_0", False),
    ("AttnProcessor", True),
    ("AttnProcessor2_0 sdp:math", True),  # CUDA with only SDPA's math back-end
    ("AttnProcessor2_0 sdp:flash,math", False),
    ("FluxAttnProcessor dispatch_attention_fn:native", False),  # diffusers' default: SDPA
    ("FluxAttnProcessor dispatch_attention_fn:_native_math", True),
    ("something.new", True),  # unknown: assume the worst
])
def test_which_attention_holds_the_whole_score_matrix(backend, full):
    assert memory.full_scores(backend) is full


def test_sd15_at_1024_px_needs_the_score_matrices_only_with_basic_attention():
    from ldm.modules.attention import BasicTransformerBlock

    block = BasicTransformerBlock(320, 8, 40, context_dim=768)  # SD1.5's top level
    full = memory.block_bytes(block, 128 * 128, 2, 320, full=True)
    lean = memory.block_bytes(block, 128 * 128, 2, 320, full=False)
    # 2 x 8 heads x 16384 x (16384 + 77) fp32 scores, twice (scores and softmax): 32 GiB
    assert 32 << 30 < full < 33 << 30
    assert lean < 1 << 30
    # 768 px fits on a 24 GiB machine running a WebUI; 1024 px does not
    at_768 = memory.block_bytes(block, 96 * 96, 2, 320, full=True)
    assert at_768 * memory.MARGIN + memory.HEADROOM < 14 << 30


def test_available_memory_reads_psutil(small_memory):
    assert memory.available(torch.device("cpu")) == 64 << 20


def test_the_module_level_kernel_of_forge_and_comfyui_is_named(monkeypatch):
    mod = types.ModuleType("fake_forge_unet")

    def attention_basic(q, k, v, heads, mask=None):
        return q

    attention_basic.__module__ = "backend.attention"
    mod.attention_function = attention_basic

    class CrossAttention(torch.nn.Module):
        pass

    CrossAttention.__module__ = mod.__name__
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert memory.kernel(CrossAttention()) == "backend.attention.attention_basic"
    assert memory.kernel(torch.nn.Linear(1, 1)) == ""


def test_a_size_that_does_not_fit_is_skipped_with_one_line_and_not_remembered(
        small_memory, tmp_path, monkeypatch):
    said = []
    cache = C.MeasurementCache(tmp_path / "m.json")
    service = C.Measurer(cache, say=said.append, rounds=1, warmup=0)
    unet = ldm_unet(TINY_SD15)
    assert service.get(unet, (16, 16), 2, ToMeConfig(), runner=run_block) is None
    assert len(said) == 1 and said[0].startswith(
        "ToMe: not measured at 128x128 px, batch 2: timing the unmerged block needs about ")
    assert "(a full attention score matrix: ldm.modules.attention.CrossAttention.forward)" \
        in said[0] and said[0].endswith("0.1 GiB of memory is available; the token "
                                        "thresholds decide")
    assert service.reason == said[0] and not (tmp_path / "m.json").exists()
    # memory freed later: measured then (a skip is never cached)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM(64 << 30))
    assert service.get(unet, (16, 16), 2, ToMeConfig(), runner=run_block) is not None
    assert service.reason is None and (tmp_path / "m.json").exists()


def test_a_generation_whose_size_does_not_fit_is_decided_by_the_thresholds(small_memory,
                                                                           tmp_path):
    said = []
    service = C.Measurer(C.MeasurementCache(tmp_path / "m.json"), say=said.append)
    unet = ldm_unet(TINY_SD15)
    x = ldm_inputs(2, 16, 16)
    base = unet(*x)
    tome.apply_patch(unet, ratio=0.5, policy="auto", measure=service)
    try:
        out = unet(*x)
        (d,) = tome.patch_report(unet).decisions.values()
    finally:
        tome.remove_patch(unet)
    assert "below the CPU threshold (4096)" in d.reason and torch.equal(out, base)
    assert len(said) == 1 and "not measured at 128x128 px" in said[0]
