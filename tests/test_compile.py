"""torch.compile as users run it, across image sizes, batch sizes and CFG (issue 48): diffusers'
regional compilation (``compile_repeated_blocks(fullgraph=True)``) and a pipeline's transformer
compiled whole on the shipped tiny DiT (a real diffusers ``FluxTransformer2DModel``), and
ComfyUI's TorchCompileModel (the stand-in in ``tests/comfy_stub``).

Dynamo runs with the ``eager`` backend (its guards and recompile limit, no code generation) and
a ``CompileCounter``: graphs are counted, never timed. What is decided: a patched model needs
no more graphs per new size than the unpatched model (the plan's grid reaches the graph as a
tensor's shape: ``dit.DitPlan``, ``percall.CallState.grid``), the compiled output is the eager
one, and a pipeline compiled after patching generates, and comes back unpatched, bit for bit.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
from stubs import tiny_flux_pipeline

import tome
from tome.report import STATE_ATTR as STATE
from tome_lab import tinydit
from tome_lab.tinydit.model import schedule

# (image side in pixels, batch): six sizes and CFG's batch of 2, as a user sends them
SIZES = [(32, 1), (48, 1), (32, 2), (64, 1), (40, 2), (56, 1), (24, 1), (72, 2)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tinydit.build_model().eval()


def _euler(m, size, batch, steps=2):
    x = torch.randn((1, 3, size, size), generator=torch.Generator().manual_seed(size))
    x = x.expand(batch, -1, -1, -1)
    cls = torch.tensor([1, 4][:batch])
    ts = schedule(steps).tolist()
    with torch.no_grad():
        for t, t_next in zip(ts[:-1], ts[1:]):
            x = x + (t_next - t) * m(x, torch.full((batch,), t), cls)
    return x


def _regional(m, sizes, **kw):
    """Graphs compiled per (size, batch) with every block compiled ``fullgraph=True`` (a
    recompile past dynamo's limit raises there), and the outputs."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    m.transformer.compile_repeated_blocks(fullgraph=True, backend=counter)
    graphs, outs = [], []
    try:
        for size, batch in sizes:
            before = counter.frame_count
            outs.append(_euler(m, size, batch, **kw))
            graphs.append(counter.frame_count - before)
    finally:
        torch._dynamo.reset()
    return graphs, outs


@pytest.fixture(scope="module")
def plain(model):
    """Graphs per size and batch of the unpatched model, compiled the same way."""
    return _regional(copy.deepcopy(model), SIZES)[0]


def test_regional_fullgraph_pools_every_size_and_cfg_with_the_graphs_of_the_unpatched(model,
                                                                                      plain):
    """Plain x2 pooling, blocks compiled with ``fullgraph=True``: eight sizes and batches run
    (before: the fifth raised ``FailOnRecompileLimitHit``: a graph per size, guarding on the
    plan's ``h``), no size needs more graphs than the unpatched model's, none after the sizes
    went dynamic, and each output is the eager patched one."""
    m = copy.deepcopy(model)
    tome.apply_patch(m, method="downsample", downsample_factor=2)
    eager = [_euler(m, s, b) for s, b in SIZES]
    graphs, outs = _regional(m, SIZES)
    assert graphs == plain, (graphs, plain)
    assert sum(graphs[3:]) == 0
    for got, want in zip(outs, eager):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["quality", "fast"])
def test_regional_fullgraph_runs_the_reuse_presets_at_every_size(model, plain, name):
    """The DiT presets with residual reuse (every 2 steps here, so three steps hold a
    refresh, a reuse and a second refresh with its slope), blocks compiled ``fullgraph``:
    every size and CFG's batch run (before: the second size raised ``FailOnRecompileLimitHit``,
    reuse's states nothing-kept, refresh and reuse each a graph per size), with the graphs of
    the unpatched model (a refreshing call runs eager: ``reuse._Eager``), and the eager
    patched outputs."""
    m = copy.deepcopy(model)
    tome.apply_patch(m, config=tome.preset(name, policy="fixed", reuse=2))
    eager = [_euler(m, s, b, steps=3) for s, b in SIZES]  # each size starts anew: progress
    graphs, outs = _regional(m, SIZES, steps=3)
    assert graphs == plain, (graphs, plain)
    for got, want in zip(outs, eager):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("settings", [
    {"method": "downsample", "downsample_factor": 2, "start": 0.3},
    {"method": "downsample", "schedule": "all:2@0.3-1,inner:4@0.6-1"}], ids=["window", "factors"])
def test_regional_fullgraph_switches_plans_over_sampling_in_the_graphs_of_the_unpatched(
        model, plain, settings):
    """A plan that changes over sampling, blocks compiled ``fullgraph``: a step window
    (unpooled, then pooled), a schedule of two factors whose inner blocks differ from the
    first and last. Four steps cross each edge; five sizes and batches (static, dynamic,
    CFG's batch) run with the unpatched model's graphs and the eager outputs. Before: the
    plan's variants were guards (``current is None``, the number of plans), a graph per
    variant per size class, and the second size raised ``FailOnRecompileLimitHit``; now
    ``torch.cond`` picks the variant in one graph (``wrappers.switch``). The no-reuse
    fallback's ``single:2@0.3-1`` was measured alike (the unpatched model's graphs)."""
    m = copy.deepcopy(model)
    tome.apply_patch(m, config=tome.ToMeConfig(**settings))
    switched = {part.phases for part in vars(m.transformer)[STATE].parts}
    assert len(switched) == 1 and len(next(iter(switched))) > 1, switched
    sizes = SIZES[:5]
    eager = [_euler(m, s, b, steps=4) for s, b in sizes]
    graphs, outs = _regional(m, sizes, steps=4)
    assert graphs == plain[:5], (graphs, plain)
    for got, want in zip(outs, eager):
        torch.testing.assert_close(got, want)


def test_the_proportional_bias_in_a_graph_is_the_eager_bias():
    """``key_bias`` built from symbolic sizes (tensor ops, while compiling) gives the eager
    Python-built bias at edge cells, frames and temporal pooling, with no graph per size."""
    from tome import dit, graphs
    counter = torch._dynamo.testing.CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def bias(size):
        return dit.DitPlan(0, 0, 4, "before", True, size=size).bias(3, 3 + size.shape[0] *
                                                                     size.shape[1] *
                                                                     size.shape[2] + 2, "cpu")
    torch._dynamo.reset()
    for frames, h, w in [(1, 8, 8), (1, 9, 14), (1, 13, 7), (2, 10, 6)]:
        want = dit.key_bias(3, 3 + frames * h * w + 2, h, w, 4, "cpu", frames=frames)
        torch.testing.assert_close(bias(graphs.grid_tensor(frames, h, w)), want)
    assert counter.frame_count <= 3  # static, dynamic, then frames above 1
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- a pipeline

def _pipeline(m):
    pipe, embeds = tiny_flux_pipeline(m)

    def generate(size=96):
        return pipe(**embeds, height=size, width=size, num_inference_steps=4,
                    output_type="latent", generator=torch.Generator().manual_seed(0)).images
    return pipe, generate


PIPE_SIZES = (96, 64, 128)


@pytest.mark.parametrize("order", ["patch, then compile", "compile, then patch"])
def test_a_pipeline_compiled_whole_generates_and_comes_back_unpatched(model, order):
    """``pipe.transformer = torch.compile(pipe.transformer)`` after (or before) patching with
    the quality preset: generations at three sizes run with dynamo's recompile limit an error
    (before: ``TypeError: ... does not support len()`` from the generation bracket, then a
    graph per size from the hooks' Python ints until the limit), no graph after the second
    size, and give the eager patched latents; ``remove_patch(pipe)`` finds the module under
    the compiled one (before: ``UnsupportedModelError``, the bracket left on the pipeline)
    and the next generation is the unpatched one, bit for bit."""
    m = copy.deepcopy(model)
    pipe, generate = _pipeline(m)
    unpatched = generate()
    config = tome.preset("quality", policy="fixed")
    tome.apply_patch(pipe, config=config)
    eager = [generate(s) for s in PIPE_SIZES]
    tome.remove_patch(pipe)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    graphs = []
    try:
        if order == "patch, then compile":
            tome.apply_patch(pipe, config=config)
            pipe.transformer = torch.compile(pipe.transformer, backend=counter)
        else:
            pipe.transformer = torch.compile(pipe.transformer, backend=counter)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tome.apply_patch(pipe, config=config)
        assert tome.is_patched(pipe)
        compiled = []
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for s in PIPE_SIZES:
                before = counter.frame_count
                compiled.append(generate(s))
                graphs.append(counter.frame_count - before)
        assert graphs[0] >= 1 and sum(graphs[2:]) == 0, graphs
        tome.remove_patch(pipe)
        assert not tome.is_patched(pipe) and "progress_bar" not in vars(pipe)
        after = generate()
    finally:
        torch._dynamo.reset()
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want)
    assert not torch.equal(eager[0], unpatched)
    assert torch.equal(after, unpatched)


# ----------------------------------------------------------------------------- UNets

# (latent height, width, batch) at CFG's batch of 2. The unpatched shallow SD1.5 compiled
# whole (fullgraph, dynamo 2.13) takes 1, 1, 0 graphs: the sizes become dynamic at the
# second, and 32x24 reuses that graph. (TINY_SD15, 5 sizes and a batch of 1: 1, 1, 1, 0, 1
# unpatched and patched alike, docs/speed.md#compiled; 5 minutes a method here.)
UNET_SIZES = [(16, 16, 2), (24, 24, 2), (32, 24, 2)]


@pytest.mark.parametrize("kw", [dict(ratio=0.5), dict(method="downsample", downsample_factor=2)],
                         ids=["merge", "downsample"])
def test_a_unet_compiled_whole_merges_every_size_in_the_graphs_of_the_unpatched(kw):
    """The hook adapter on an ldm UNet, compiled whole with ``fullgraph=True``: each size,
    batch and step (the destinations hashed from the timestep on the device) is the eager
    output, with the unpatched model's graphs (above). Before, every size was new graphs
    (merge on TINY_SD15: 1, 2, 2, 2, 2, 2), as the UNet's pre-hook was traced and its latent
    size became ints the blocks' graph guarded on; now it runs on the host and hands the
    size over as ``plan.Call.grid``'s shape."""
    from models import SHALLOW_SD15, ldm_inputs, ldm_unet
    unet, plain = ldm_unet(SHALLOW_SD15), ldm_unet(SHALLOW_SD15)
    tome.apply_patch(unet, **kw)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    f = torch.compile(unet, backend=counter, fullgraph=True)
    graphs = []
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.no_grad():
            for step, (h, w, batch) in enumerate(UNET_SIZES):
                x, _, ctx = ldm_inputs(batch, h, w)
                t = torch.full((batch,), 900.0 - 200 * step)
                before = counter.frame_count
                got = f(x, t, ctx)
                graphs.append(counter.frame_count - before)
                torch.testing.assert_close(got, unet(x, t, ctx))
                assert not torch.equal(got, plain(x, t, ctx))  # it merged
    finally:
        tome.remove_patch(unet)
        torch._dynamo.reset()
    assert graphs == [1, 1, 0], graphs


# ----------------------------------------------------------------------------- ComfyUI

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
RESOLUTIONS = [(16, 24), (24, 16), (16, 16), (24, 24), (32, 16), (16, 32), (32, 32), (40, 24)]


def _comfy(config, latents, steps=4, backend=None, guard_filter=True, limit_error=True,
           **model):
    """Graphs per resolution through TorchCompileModel's wrapper after the ToMe node, and the
    latents; dynamo's recompile limit made an error, so a silent fallback to eager fails.
    ``backend``: a real one (e.g. inductor) instead of dynamo's counting one (graphs then not
    counted); ``guard_filter``: the node's filter that drops every guard on
    ``transformer_options`` (off: a plain ``torch.compile``); ``limit_error`` False: dynamo's
    recompile limit as in a host (the function runs eager past it); ``model``: the stand-in
    Flux's sizes (``depth``, ``depth_single_blocks``)."""
    if STUB not in sys.path:
        sys.path.insert(0, STUB)
    from comfy_api.torch_helpers import set_torch_compile_wrapper, skip_torch_compile_dict
    from test_compose import dit_model, sample

    from tome.comfy import nodes
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    base = dit_model(**model)
    eager = nodes.ToMePatch().patch(base, **config)[0]
    model = nodes.ToMePatch().patch(base, **config)[0].clone()
    options = {"guard_filter_fn": skip_torch_compile_dict} if guard_filter else None
    set_torch_compile_wrapper(model, backend or counter, options=options)
    graphs = []
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=limit_error):
            for h, w in latents:
                before = counter.frame_count
                got = sample(model, steps=steps, latent=(1, 4, h, w))
                graphs.append(counter.frame_count - before)
                torch.testing.assert_close(got, sample(eager, steps=steps, latent=(1, 4, h, w)))
    finally:
        torch._dynamo.reset()
    return graphs


def test_comfy_torch_compile_model_stays_compiled_across_eight_resolutions():
    """TorchCompileModel after the node, pooling without reuse: eight resolutions, two graphs
    in all (the second where sizes become dynamic; before: one per resolution, then eager
    after the eighth), each sampling the eager latent."""
    from comfy_node import defaults
    from test_compose import REUSE
    graphs = _comfy(defaults(**{**REUSE, "reuse": 0}), RESOLUTIONS)
    assert sum(graphs) <= 2 and sum(graphs[2:]) == 0, graphs


# the same at twice the side: quality's x8 leaves every side at least 2 pooled cells (sides
# of 8 tokens or fewer pool to one cell, a size dynamo specializes: a graph of their own)
LARGER = [(2 * h, 2 * w) for h, w in RESOLUTIONS]


def test_comfy_torch_compile_model_with_reuse_stays_compiled_across_eight_resolutions():
    """TorchCompileModel after the node with the quality preset (fixed policy; 4 steps, so the
    reuse paced to every 2 steps refreshes at steps 0 and 2 and replays at 1 and 3): eight
    resolutions in one process, never past dynamo's recompile limit (made an error here),
    with the graphs of pooling without reuse (two, none after the second resolution), each
    sampling the eager latent. Before: a third graph where the kept residual's size first
    changed (dynamo kept it static until then, tied to the call's symbolic sizes; now kept
    marked dynamic, ``graphs.sized_by_graph``); earlier still, reuse's states were guards
    (about three graphs per resolution; a refreshing call now runs eager, ``reuse._Eager``)."""
    from comfy_node import defaults
    graphs = _comfy(defaults(preset="quality", policy="fixed"), LARGER)
    assert sum(graphs) <= 2 and sum(graphs[2:]) == 0, graphs


@pytest.mark.skipif(not os.environ.get("TOME_INDUCTOR"),
                    reason="inductor's C++ compiles take minutes: set TOME_INDUCTOR=1")
def test_comfy_inductor_compiles_a_ragged_grid_after_tiled_ones_to_the_eager_latent(
        monkeypatch, tmp_path):
    """Inductor (its on-disk cache a fresh folder), the quality preset (x8, reuse): token grids
    8x8, 8x16 (sizes dynamic from here), then 8x12, whose right cells are partial, in one
    process. Each sampling is the eager latent. A run here once gave 8x12 off by rel. L2
    1.6e-2: a stale entry of inductor's on-disk cache (``/tmp/torchinductor_<user>``); from
    a clean cache, in any order, every grid is right (docs/speed.md#compiled)."""
    from comfy_node import defaults
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    _comfy(defaults(preset="quality", policy="fixed"), [(16, 16), (16, 32), (16, 24)],
           backend="inductor")


def _attention_breaks_the_graph(monkeypatch):
    """The stand-in Flux's attention with a graph break inside, as ComfyUI's CPU attention
    has (sub-quadratic attention reads the free memory: ``open`` of /proc/meminfo): dynamo
    then compiles each block's frames on their own, and a block's frame reads the block's
    index from ``transformer_options`` as an input."""
    if STUB not in sys.path:
        sys.path.insert(0, STUB)
    import comfy.ldm.flux.math
    from comfy.ldm.modules import attention as comfy_attention
    inner = comfy_attention.attention_pytorch.__wrapped__

    def broken(*args, **kwargs):
        torch._dynamo.graph_break()
        return inner(*args, **kwargs)
    monkeypatch.setattr(comfy.ldm.flux.math, "optimized_attention",
                        comfy_attention.wrap_attn(broken))


@pytest.mark.parametrize("guard_filter,reuse", [(False, 5), (True, 0)],
                         ids=["no-guard-filter", "no-reuse"])
def test_comfy_compiled_blocks_split_by_a_graph_break_pool_as_eager(monkeypatch, guard_filter,
                                                                     reuse):
    """A graph break inside attention: without TorchCompileModel's guard filter (reuse on),
    or with it where no block differs from another (x8 everywhere, no reuse), the compiled
    latent is the eager one."""
    from comfy_node import defaults
    _attention_breaks_the_graph(monkeypatch)
    config = defaults(preset="quality", policy="fixed") if reuse else defaults(
        preset="custom", method="downsample", schedule="all:8", rope="before", policy="fixed")
    _comfy(config, [(16, 16)], guard_filter=guard_filter)


def test_comfy_torch_compile_model_with_reuse_and_a_graph_break_in_attention(monkeypatch):
    """TorchCompileModel drops every guard on ``transformer_options``; a frame that reads the
    block's index from them (the attention override, compiled on its own after a graph break
    in attention) was traced for one block and then run for every block, each adding that
    block's residual: the latent was off by rel. L2 9.7e-3, with no line. Now such a frame
    guards on how many blocks the call named before (``CallState.note``): a graph per block
    there, each the eager latent (at one size here; two sizes, 128x128-like then twice as
    wide, measured 23 and 29 frames compiled). Where the attention does not break the graph
    (the stand-in as it is; PyTorch attention on a GPU) the blocks are traced inside the
    model's one frame and nothing changes (the eight-resolution tests above)."""
    from comfy_node import defaults
    _attention_breaks_the_graph(monkeypatch)
    _comfy(defaults(preset="quality", policy="fixed"), [(16, 16)])


def test_comfy_blocks_past_the_recompile_limit_split_by_a_graph_break_are_still_right(
        monkeypatch):
    """The same with 12 blocks (6 double, 6 single), more than dynamo's recompile limit of 8
    per function, the limit as ComfyUI leaves it (no error): the frames past it run eager
    (dynamo's warning), the latent is the eager one."""
    from comfy_node import defaults
    _attention_breaks_the_graph(monkeypatch)
    _comfy(defaults(preset="quality", policy="fixed"), [(16, 16)], limit_error=False, depth=6,
           depth_single_blocks=6)


# ----------------------------------------------------------------------------- ComfyUI, UNet

def _comfy_unet():
    """The shallow SD1.5 behind ComfyUI's stand-in patcher, and its KSampler (2 steps)."""
    if STUB not in sys.path:
        sys.path.insert(0, STUB)
    from comfy.sampling import ksample
    from models import SHALLOW_SD15, ldm_inputs
    from test_comfy import model

    def sample(patcher, h, w):
        x, _, ctx = ldm_inputs(2, h, w)
        return torch.cat(ksample(patcher, x, ctx, steps=2))

    return model(SHALLOW_SD15), sample


def _compiled(patcher, backend):
    """ComfyUI's TorchCompileModel node (the stand-in) on ``patcher``, with dynamo's counter as
    its backend."""
    from comfy_api.torch_helpers import TorchCompileModel
    return TorchCompileModel().execute(patcher, backend=backend)[0]


def test_comfy_torch_compile_model_merges_a_unet_at_every_size_in_the_graphs_of_the_unpatched():
    """TorchCompileModel after the node on an SD1.5 UNet (the attn1 patch; ComfyUI's guard
    filter): three sizes, each sampling the eager latent, with the unpatched model's graphs
    (1, 1, 0). Before: 2, 1, 1, as the patch began its call in the graph from Python ints
    (the latent size) and the node's guard was traced with it. (ToDo x2 gave 1, 1, 0 too in a
    one-off probe; compiled ToDo across sizes is tested on the hook adapter above.)"""
    from comfy_node import defaults

    from tome.comfy import nodes
    base, sample = _comfy_unet()
    ours = nodes.ToMePatch().patch(base, **defaults(policy="fixed", ratio=0.5))[0]
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()
    compiled = _compiled(ours, counter)
    graphs = []
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), torch.no_grad():
            for h, w, _ in UNET_SIZES:
                before = counter.frame_count
                got = sample(compiled, h, w)
                graphs.append(counter.frame_count - before)
                torch.testing.assert_close(got, sample(ours, h, w))
                assert not torch.equal(got, sample(base, h, w))  # it merged
    finally:
        torch._dynamo.reset()
    assert graphs == [1, 1, 0], graphs


def test_comfy_torch_compile_model_before_the_node_follows_every_change_of_settings(lines):
    """TorchCompileModel before the node (its output cached by ComfyUI: one compiled module
    and one backend for every run after): ToMe at 0.5, at 0.25, no ToMe, then 0.5 again,
    each sampling its eager latent. ComfyUI's guard filter hides every change of the patches
    from dynamo, so a graph reads a run's settings and call through a module global whose
    guards hold (``patcher.LIVE``), never through the patch function (unguarded there: it
    would replay what it was traced with). The graph traced with no ToMe reads nothing of
    ours, so it would replay unmerged once ToMe is back: the node sees no block at a merging
    level reach its patch, drops the compiled code and runs the call again, traced with the
    patch (one line)."""
    from comfy_node import defaults

    from tome.comfy import nodes
    base, sample = _comfy_unet()
    torch._dynamo.reset()
    compiled = _compiled(base, torch._dynamo.testing.CompileCounter())
    said = []  # RECOMPILED lines so far, after each run
    try:
        with torch.no_grad():
            for ratio in (0.5, 0.25, None, 0.5):
                eager, model = base, compiled
                if ratio is not None:
                    eager, model = (nodes.ToMePatch().patch(m, **defaults(policy="fixed",
                                                                          ratio=ratio))[0]
                                    for m in (base, compiled))
                torch.testing.assert_close(sample(model, 16, 16), sample(eager, 16, 16))
                said.append(lines.count(nodes.RECOMPILED))
        assert said == [0, 0, 0, 1] and nodes.STALE not in lines
    finally:
        torch._dynamo.reset()
