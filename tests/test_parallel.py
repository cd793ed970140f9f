"""Pooling beyond one GPU (issue 51): diffusers' context parallelism on two CPU ranks over
gloo (``tests/parallel_ranks.py`` under ``torchrun``, once for the module), refusals and the
hosts passed through in process.

Before: patched first, ``enable_parallelism`` set its config on ToMe's wrappers, so every
call (pooled or not, even after removal) attended over its own shard alone (4.6e-02 off);
enabled first, the pooled maths met a shard shorter than the plan's grid and every block
ran unpooled while the patch said it pooled.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tome
from tome import parallel

ROOT = Path(__file__).resolve().parent.parent
EXACT = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What the two ranks found (one ``torchrun`` for the module: a few seconds of work,
    most of the wall time the ranks' imports)."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists():
        pytest.skip("torchrun is not available")
    out = tmp_path_factory.mktemp("ranks") / "found.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(ROOT / "tests" / "parallel_ranks.py"), str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("degree", ["ulysses", "ring"])
@pytest.mark.parametrize("order", ["patch first", "parallel first"])
def test_two_ranks_pool_as_one_process(ranks, degree, order):
    """Ulysses (diffusers' native kernel) and Ring (a kernel with a log-sum-exp standing in
    for flash-attn/cuDNN) on two ranks: the pooled output equals the one-process pooled
    output, and after removal the unpatched one, with the patch applied before or after
    ``enable_parallelism``; pooling's own effect is far above that."""
    assert ranks["pooling"] > 1e-3
    assert ranks[f"{degree}, {order}, pooled"]["error"] < EXACT
    assert ranks[f"{degree}, {order}, removed"]["error"] < EXACT


@pytest.mark.parametrize("degree, collective", [("ulysses", "all_to_all_single"),
                                                 ("ring", "all_gather_tensor")])
def test_pooled_keys_travel_pooled(ranks, degree, collective):
    """The keys/values are pooled before they travel: per attention call of the 8x8 grid
    (8 text tokens, 4 heads of 8), Ulysses' all-to-all moves 36 query rows and 12 pooled
    key/value rows of each rank's shard instead of 36 (two thirds of the bytes), Ring's
    gather 12 key/value rows instead of 36 (a third), the bias mask's 12 floats apart."""
    pooled = ranks[f"{degree}, parallel first, pooled"]["bytes"]
    whole = ranks[f"{degree}, parallel first, removed"]["bytes"]
    row = 4 * 8 * 4  # heads x head_dim x float32
    if degree == "ulysses":  # q, k, v and the output, each sending half of its rows
        assert whole[collective] == 4 * 36 * row // 2
        assert pooled[collective] == (36 + 12 + 12 + 36) * row // 2
        assert pooled["all_gather"] == 12 * 4
    else:  # k and v of the shard, gathered whole
        assert whole[collective] == 2 * 36 * row
        assert pooled[collective] == 2 * 12 * row


@pytest.mark.parametrize("family", ["wan", "wan3", "qwen"])
def test_wan_and_qwen_image_pool_as_one_process(ranks, family):
    """Wan (4 frames: two whole frames per rank; 3 frames: one split between the ranks,
    pooled after the all-to-all; the text whole on every rank) and Qwen-Image (its text and
    RoPE split) under Ulysses: the pooled output is a thousand times closer to the
    one-process pooled output than pooling's own effect (large random weights: outputs of
    order 10; before, each rank ran unpooled)."""
    found = ranks[family]
    assert found["error"] < 1e-3 * found["pooling"]


def test_cells_across_shards_pooled_after_the_all_to_all_under_ulysses(ranks):
    """6 rows in two shards of 3 split 2x2 cells between the ranks: under Ulysses the keys
    are pooled after the all-to-all, where the whole sequence is known (the one-process
    pooled output; the all-to-all moves the whole q, k, v and output, 16 rows of 32 floats
    per rank each, plus the rotary embedding's 16 rows of 8 cos/sin pairs gathered)."""
    found = ranks["straddle, ulysses, pooled"]
    assert found["error"] < EXACT
    assert found["bytes"] == {"all_to_all_single": 4 * 16 * 32 * 4 // 2,
                              "all_gather": 2 * 16 * 8 * 4}


def test_what_cannot_be_pooled_right_is_refused(ranks):
    """Cells across the shards under Ring (each rank's keys rotate as they are: no rank
    sees a whole cell) and under Qwen-Image's own pooling maths: refused at the first pooled
    call; diffusers' uneven ``ulysses_anything`` split: refused at apply_patch."""
    assert "whole 2x2 cells" in ranks["straddle, ring"] and "6x4" in ranks["straddle, ring"]
    assert "pools its keys itself" in ranks["qwen across"]
    assert "ulysses_anything" in ranks["anything"]


# ----------------------------------------------------------------------------- in process

@pytest.mark.parametrize("grid, n, factors, temporal, want", [
    ((1, 16, 16), 2, (2,), 1, (1, 8, 16)),
    ((1, 16, 16), 4, (2, 4), 1, (1, 4, 16)),
    ((1, 12, 16), 2, (4,), 1, None),      # 6 rows per rank: 4x4 cells straddle
    ((1, 6, 4), 2, (2,), 1, None),
    ((4, 8, 8), 2, (2,), 2, (2, 8, 8)),   # whole frames, 2 per temporal cell
    ((3, 8, 8), 2, (2,), 1, None),        # a frame split between ranks
    ((4, 8, 8), 4, (2,), 2, None),        # one frame per rank: temporal pairs straddle
])
def test_shard_grid(grid, n, factors, temporal, want):
    assert parallel.shard_grid(*grid, n, factors, temporal) == (want and parallel.Shard(*want))


def _cp(ring=1, ulysses=1, **kw):
    return SimpleNamespace(context_parallel_config=SimpleNamespace(
        ring_degree=ring, ulysses_degree=ulysses, ulysses_anything=False, ring_anything=False,
        **kw))


def _flux():
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1,
                                  num_single_layers=1, attention_head_dim=8,
                                  num_attention_heads=4, joint_attention_dim=16,
                                  pooled_projection_dim=8, axes_dims_rope=(2, 2, 4)).eval()


POOL = {"method": "downsample", "downsample_factor": 2, "measure": False}


def _call(m, h=8, w=8, refs=0):
    """One call of the stand-in Flux on an ``h x w`` grid (and ``refs`` reference tokens
    after it, Kontext's: another first id)."""
    ids = torch.zeros(h * w + refs, 3)
    ids[:h * w, 1] = torch.arange(h).repeat_interleave(w)
    ids[:h * w, 2] = torch.arange(w).repeat(h)
    ids[h * w:, 0] = 1
    with torch.no_grad():
        return m(hidden_states=torch.randn(1, h * w + refs, 8),
                 encoder_hidden_states=torch.randn(1, 8, 16),
                 pooled_projections=torch.randn(1, 8), timestep=torch.tensor([0.5]),
                 img_ids=ids, txt_ids=torch.zeros(8, 3))


def test_reference_tokens_refused_under_context_parallelism():
    """Kontext's reference tokens after the image: diffusers' shards cut [image, references]
    as one sequence, so no rank holds an image of its own: refused at the first pooled call
    (unpatched calls and ToMe without parallelism pool them as before)."""
    m = tome.apply_patch(_flux(), **POOL)
    assert torch.isfinite(_call(m, refs=16)[0]).all()
    m._parallel_config = _cp(ulysses=2)
    with pytest.raises(ValueError, match="tokens beside the image"):
        _call(m, refs=16)


def test_unified_refused_at_apply_patch_and_at_the_first_call():
    """Ulysses x Ring (diffusers' unified attention does not gather a mask in its ring
    step): refused at apply_patch, the model untouched; enabled after patching, refused at
    the first pooled call."""
    m = _flux()
    m._parallel_config = _cp(ring=2, ulysses=2)
    before = {n: type(p) for n, p in m.attn_processors.items()}
    with pytest.raises(ValueError, match="unified"):
        tome.apply_patch(m, **POOL)
    assert {n: type(p) for n, p in m.attn_processors.items()} == before
    m = tome.apply_patch(_flux(), **POOL)
    m._parallel_config = _cp(ring=2, ulysses=2)
    with pytest.raises(ValueError, match="unified"):
        _call(m)


def test_wrappers_pass_parallel_settings_to_the_original():
    """diffusers sets ``_parallel_config`` and ``_attention_backend`` on each attention
    module's processor (``enable_parallelism``, ``set_attention_backend``): on a patched
    model they reach the wrapped original, which every unpooled call runs."""
    m = tome.apply_patch(_flux(), **POOL)
    block = m.transformer_blocks[0].attn
    config = _cp(ulysses=2)
    block.processor._parallel_config = config
    block.processor._attention_backend = "native"
    assert block.processor.original._parallel_config is config
    assert block.processor.original._attention_backend == "native"
    assert hasattr(block.processor, "_parallel_config")
    tome.remove_patch(m)
    assert block.processor._parallel_config is config


@pytest.mark.parametrize("modules, says", [
    ({"custom_nodes.raylight.distributed_worker": None}, "under raylight"),
    ({"xfuser.core.long_ctx_attention": None}, "under xDiT"),
    ({"para_attn.context_parallel": None}, "under ParaAttention"),
    ({"comfy.multigpu": None, "raylightning": None}, None),
])
def test_sequence_parallel_hosts_named(modules, says):
    got = parallel.host_line(modules)
    assert (got is None) if says is None else got.startswith(says)


def test_not_pooled_line_names_the_host(monkeypatch):
    """A sampling where the override never ran, with raylight loaded: the after-sampling
    line says why (raylight's blocks call xfuser's attention past it), not only that it
    was never called."""
    from tome import percall_calls
    counts = percall_calls.Counts("comfy flux")
    counts.count_call({}, 0, True, True)
    assert "never called" in counts.not_pooled()
    monkeypatch.setitem(sys.modules, "raylight", SimpleNamespace())
    assert "under raylight" in counts.not_pooled()


def test_multigpu_worker_threads_share_the_main_patch_and_pool_as_one_gpu():
    """ComfyUI v0.30's MultiGPU CFG Split (``comfy/multigpu.py``): each extra device gets
    ``deepclone_multigpu``, a ``clone()`` of the patched model (the same wrapper objects:
    clone copies the lists) around a fresh BaseModel from the loader, sampled in a persistent
    worker thread while the main thread samples: both run the one OverridePatch at once
    (tests/test_engine.py's two-thread test deep-copies the patch instead). Each thread gives
    bit for bit what its clone gives alone. One device here: the node's split itself is not
    run."""

    from comfy_node import defaults
    from test_engine import REUSE, flux, in_lockstep, sample

    from tome.comfy import nodes

    (ours,) = nodes.ToMePatch().patch(flux(), **defaults(**REUSE))
    clones = []
    for _ in range(2):
        c = ours.clone()
        c.model = flux().model  # the loader's model anew (deepclone_multigpu)
        clones.append(c)
    alone = [sample(c, seed=i) for i, c in enumerate(clones)]
    got = in_lockstep(clones)
    assert clones[0].wrappers and all(
        w0 is w1 for k in ours.wrappers for key in ours.wrappers[k]
        for w0, w1 in zip(clones[0].wrappers[k][key], clones[1].wrappers[k][key]))
    assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])
    assert not torch.equal(alone[0], alone[1])
