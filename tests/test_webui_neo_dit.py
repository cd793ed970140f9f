"""Forge Neo's DiTs through the WebUI stand-in: the attention swap (``tome/swap.py``) on the
stand-ins of Neo 2.26's Flux, Wan, Qwen-Image and Lumina/Z-Image (``tests/webui_stub/backend``:
attention functions bound by name at import, the UnetPatcher's single wrapper slot, the
sigmas Neo hands), driven by the real script as Neo drives a generation."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from webui_stub.harness import WebUI, neo, shared

from tome import adapters, kv, swap
from tome.config import ToMeConfig
from tome.dits import neo_nunchaku
from tome.webui import host

flux, wan, qwen, lumina, kernel, dynamic_args = (neo.flux, neo.wan, neo.qwen, neo.lumina,
                                                 neo.kernel, neo.dynamic_args)
POINTS = ((flux, "attention"), (wan, "attention"), (qwen, "attention_function"),
          (lumina, "attention_function"))
ORIGINAL = {m: getattr(m, n) for m, n in POINTS}


def dit(**named):
    return {"enabled": True, "method": "downsample", "downsample_factor": 2, "policy": "fixed",
            **named}


def latent(webui, tome=None, **fields):
    fields = {"steps": 4, **fields}
    return torch.stack(webui.generate(tome=tome, **fields).images)


@pytest.fixture(autouse=True)
def _clean():
    kernel.calls.clear()
    dynamic_args.ref_latents = []
    yield
    assert all(getattr(m, n) is ORIGINAL[m] for m, n in POINTS)  # never left swapped


def test_flux_is_pooled_reproducible_and_restored_after_the_generation(capsys):
    webui = WebUI(neo.NeoModel("flux"))
    off = latent(webui)
    on = latent(webui, dit())
    again = latent(webui, dit())
    after = latent(webui)
    assert torch.isfinite(on).all() and not torch.equal(on, off)
    assert (on - off).norm() / off.norm() < 0.5
    assert torch.equal(on, again)  # same seed, same output
    assert torch.equal(after, off)  # nothing of the swap outlives its generation
    out = capsys.readouterr().out
    assert out.count("ToMe: DiT (forge neo flux) first pass downsample x2; 4/4 blocks pooled "
                     "(blocks all, rope pooled)") == 2
    assert "ToMe DiT: first pass x2 in all blocks; proportional attention; rope pooled" in out
    assert not isinstance(shared.sd_model.forge_objects_original.unet.model_options.get(
        "model_function_wrapper"), swap.Swap)


@pytest.mark.parametrize("kind", ["flux", "chroma"])
def test_flux_keys_are_pooled_per_cell_with_the_text_whole(kind):
    webui = WebUI(neo.NeoModel(kind))
    latent(webui, dit(), cfg_scale=1)
    text, image = neo.TEXT_TOKENS, 8 * 8  # a 128 px image: 16x16 latent, 2x2 patches
    assert set(kernel.calls) == {(text + image, text + 16)}


@pytest.mark.parametrize("rope", ["before", "pooled"])
def test_both_rope_options_reach_flux(rope):
    webui = WebUI(neo.NeoModel("flux"))
    off = latent(webui)
    on = latent(webui, dit(rope=rope))
    other = latent(webui, dit(rope="pooled" if rope == "before" else "before"))
    assert not torch.equal(on, off) and not torch.equal(on, other)


def flux_call(b, heads, text, h, w, d):
    """Neo's stand-in Flux (its UnetPatcher) and one attention call's random q, k, v ``[b,
    heads, text + h * w, d]`` with the rotation (``pe``) of the text and an ``h x w`` image
    grid."""
    unet = neo.NeoModel("flux").forge_objects.unet
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, heads, text + h * w, d, generator=g) for _ in range(3))
    ids = torch.zeros(b, text + h * w, 3)
    ids[:, text:, 1] = torch.arange(h).repeat_interleave(w).float()
    ids[:, text:, 2] = torch.arange(w).repeat(h).float()
    return unet, q, k, v, unet.model.diffusion_model.pe_embedder(ids)


def test_pooled_flux_call_matches_a_hand_written_reference():
    """One attention call of Neo's Flux: our swap's answer is attention over the rotated
    queries and keys with each 2x2 cell of image keys (and values) averaged ("before"), or the
    raw keys averaged and rotated by the cell's mean rotation ("pooled")."""
    b, heads, text, h, w, d = 1, 2, 3, 4, 6, 16
    unet, q, k, v, pe = flux_call(b, heads, text, h, w, d)

    def cells(x):  # [B, H, S, D]: the image part's 2x2 cell means
        img = x[:, :, text:].unflatten(2, (h, w)).permute(0, 1, 4, 2, 3).flatten(0, 1)
        img = F.avg_pool2d(img, 2).flatten(2).transpose(1, 2).unflatten(0, (b, heads))
        return torch.cat([x[:, :, :text], img], 2)

    for rope in ("before", "pooled"):
        clone, _ = adapters.patch_model_patcher(unet, ToMeConfig(
            method="downsample", downsample_factor=2, rope=rope, proportional=False))
        ours = clone.model_options["model_function_wrapper"]
        spans = kv.Spans(text, True, 0, 1, h, w)
        state = ours.begin(spans, None, q.device, b)
        pooled = swap.pooled(adapters.neo_form("forge neo flux").points[0])
        pooled.original = flux.attention
        with ours.running(ours, spans, state):
            got = pooled(q, k, v, pe)
        rq, rk = flux.apply_rope(q, k, pe)
        if rope == "before":
            keys = cells(rk)
        else:
            m = cells(pe.expand(b, heads, -1, -1, -1, -1).flatten(-3)).unflatten(-1, (-1, 2, 2))
            m = m / (m[..., 0, 0] ** 2 + m[..., 1, 0] ** 2).sqrt()[..., None, None]
            keys = flux.apply_rope1(cells(k), m)
        want = F.scaled_dot_product_attention(rq, keys, cells(v)).transpose(1, 2).flatten(2)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_wan_video_keys_are_pooled_within_each_frame():
    webui = WebUI(neo.NeoModel("wan"))
    off = latent(webui, cfg_scale=1)
    kernel.calls.clear()
    on = latent(webui, dit(), cfg_scale=1)
    frames, image = neo.FRAMES, 8 * 8
    self_attention = [c for c in kernel.calls if c[0] == c[1] or c[1] != neo.TEXT_TOKENS]
    assert set(self_attention) == {(frames * image, frames * 16)}
    assert (frames * image, neo.TEXT_TOKENS) in kernel.calls  # cross-attention untouched
    assert torch.isfinite(on).all() and not torch.equal(on, off)


@pytest.mark.parametrize("kind", ["qwen", "lumina"])
def test_qwen_image_and_z_image_are_pooled(kind):
    webui = WebUI(neo.NeoModel(kind))
    off = latent(webui, cfg_scale=1)
    kernel.calls.clear()
    on = latent(webui, dit(), cfg_scale=1)
    assert torch.isfinite(on).all() and not torch.equal(on, off)
    assert (on - off).norm() / off.norm() < 0.5
    if kind == "lumina":  # caption 7 -> 8, image 64 (a multiple of 8): refiners unpooled
        assert set(kernel.calls) == {(8, 8), (64, 64), (72, 24)}
    else:
        assert set(kernel.calls) == {(neo.TEXT_TOKENS + 64, neo.TEXT_TOKENS + 16)}


def test_kontext_references_stay_whole():
    webui = WebUI(neo.NeoModel("flux"))
    dynamic_args.ref_latents = [torch.randn(1, 16, 8, 8)]  # 4x4 reference tokens
    latent(webui, dit(), cfg_scale=1)
    text = neo.TEXT_TOKENS
    assert set(kernel.calls) == {(text + 64 + 16, text + 16 + 16)}


def test_globals_are_restored_when_the_model_raises():
    model = neo.NeoModel("flux")
    webui = WebUI(model)
    off = latent(webui)
    block = model.forge_objects.unet.model.diffusion_model.single_blocks[1]

    def fail(module, args, kwargs):
        assert flux.attention is not ORIGINAL[flux]  # swapped while the model runs
        raise RuntimeError("interrupted inside the model")

    handle = block.register_forward_pre_hook(fail, with_kwargs=True)
    with pytest.raises(RuntimeError, match="interrupted inside the model"):
        latent(webui, dit())
    handle.remove()
    assert flux.attention is ORIGINAL[flux]
    assert torch.equal(latent(webui), off)


def test_a_wrapper_already_there_is_chained_around_ours():
    model = neo.NeoModel("flux")
    seen = []

    def theirs(apply_model, params):  # another extension's, set before ToMe
        seen.append(flux.attention is ORIGINAL[flux])
        return apply_model(params["input"], params["timestep"], **params["c"])

    model.forge_objects_after_applying_lora.unet.set_model_unet_function_wrapper(theirs)
    webui = WebUI(model)
    off = latent(webui, cfg_scale=1)
    seen.clear()
    on = latent(webui, dit(), cfg_scale=1)
    assert seen == [True] * 4  # called at every step, outside our swap
    assert not torch.equal(on, off)
    assert set(kernel.calls[-4:]) == {(neo.TEXT_TOKENS + 64, neo.TEXT_TOKENS + 16)}


def test_a_swapper_before_ours_gets_the_pooled_keys():
    """Neo's Radial Attention assigns ``wan.attention`` inside its wrapper (and never puts it
    back): chained outside ours, its function is what ours calls with pooled keys."""
    model = neo.NeoModel("wan")
    lengths = []

    def radial(*args, **kwargs):
        lengths.append(args[1].shape[1])
        return ORIGINAL[wan](*args, **kwargs)

    def radial_wrapper(apply_model, params):
        wan.attention = radial
        return apply_model(params["input"], params["timestep"], **params["c"])

    model.forge_objects_after_applying_lora.unet.set_model_unet_function_wrapper(radial_wrapper)
    webui = WebUI(model)
    try:
        latent(webui, dit(), cfg_scale=1)
        assert wan.attention is radial  # theirs put back, not Neo's: what was there before us
        assert set(lengths) == {neo.FRAMES * 16}
    finally:
        wan.attention = ORIGINAL[wan]


def test_a_replacement_inside_the_call_that_never_calls_ours_is_said_once(capsys):
    model = neo.NeoModel("flux")
    net = model.forge_objects.unet.model.diffusion_model
    held = []

    def take_over(module, args, kwargs):  # another extension, swapping after us
        held.append(flux.attention)
        flux.attention = lambda q, k, v, pe, mask=None, transformer_options={}: \
            ORIGINAL[flux](q, k, v, pe, mask, transformer_options)

    def give_back(module, args, kwargs, out):
        flux.attention = held.pop()

    net.register_forward_pre_hook(take_over, with_kwargs=True)
    net.register_forward_hook(give_back, with_kwargs=True)
    webui = WebUI(model)
    off = latent(webui)
    on = latent(webui, dit())
    assert torch.equal(on, off)
    out = capsys.readouterr().out
    assert out.count(swap.Swap.SILENT) == 1
    assert out.count(swap.Swap.NEVER_CALLED) == 1  # not again after the pass
    assert "attention calls" not in out


def test_a_mask_over_the_calls_keys_is_pooled_with_them(capsys):
    """A call's own mask (over its keys) is pooled with them: an all-attending mask gives
    the pooled image of no mask, and no line says a mask was left unpooled."""
    plain = latent(WebUI(neo.NeoModel("flux")), dit(), cfg_scale=1)
    model = neo.NeoModel("flux")

    def masked(apply_model, params):
        n = neo.TEXT_TOKENS + 64
        return apply_model(params["input"], params["timestep"], **params["c"],
                           attention_mask=torch.zeros(1, n, n))

    model.forge_objects_after_applying_lora.unet.set_model_unet_function_wrapper(masked)
    webui = WebUI(model)
    off = latent(webui, cfg_scale=1)
    on = latent(webui, dit(), cfg_scale=1)
    assert not torch.equal(on, off)
    torch.testing.assert_close(on, plain, atol=1e-5, rtol=1e-4)
    assert "attention mask" not in capsys.readouterr().out


def test_nunchaku_is_skipped_with_one_line(capsys):
    webui = WebUI(neo.NeoModel("nunchaku"))
    off = latent(webui)
    res = webui.generate(tome=dit(), steps=4)
    assert torch.equal(torch.stack(res.images), off)
    out = capsys.readouterr().out
    assert out.count(neo_nunchaku.LINE.removeprefix("ToMe: ")) == 1
    assert "ToMe skipped" in res.info


def test_proportional_attention_goes_in_as_the_kernels_mask(capsys):
    """One Flux call with proportional attention: the host's kernel gets ``log(tokens in the
    cell)`` on the pooled image keys and 0 on the text keys as its mask, and the answer is a
    hand-written einsum softmax with that bias on the image cells' scores only (a 5x6 grid:
    the bottom row's cells hold 2 tokens, the others 4); the generation differs from plain
    pooling and no line says the bias was not applied."""
    b, heads, text, h, w, d = 1, 2, 3, 5, 6, 16
    unet, q, k, v, pe = flux_call(b, heads, text, h, w, d)
    cells = [[text + i * w + j for i in range(i0, min(i0 + 2, h)) for j in range(j0, j0 + 2)]
             for i0 in range(0, h, 2) for j0 in range(0, w, 2)]

    def pool(x):  # [B, H, S, D]: the text rows, then each cell's mean, by loops
        return torch.stack([x[:, :, r] for r in range(text)]
                           + [sum(x[:, :, r] for r in c) / len(c) for c in cells], 2)

    clone, _ = adapters.patch_model_patcher(unet, ToMeConfig(
        method="downsample", downsample_factor=2, rope="before", proportional=True))
    ours = clone.model_options["model_function_wrapper"]
    spans = kv.Spans(text, True, 0, 1, h, w)
    state = ours.begin(spans, None, q.device, b)
    pooled = swap.pooled(adapters.neo_form("forge neo flux").points[0])
    masks = []

    def host(q, k, v, pe, mask=None, transformer_options={}):  # noqa: B006 (as Neo)
        masks.append(mask)
        return flux.attention(q, k, v, pe, mask, transformer_options)

    before, pooled.original = pooled.original, host
    try:
        with ours.running(ours, spans, state):
            got = pooled(q, k, v, pe)
    finally:
        pooled.original = before
    bias = torch.tensor([0.0] * text + [math.log(len(c)) for c in cells])
    assert [len(c) for c in cells] == [4] * 6 + [2] * 3
    (mask,) = masks
    torch.testing.assert_close(mask.flatten(), bias)
    rq, rk = flux.apply_rope(q, k, pe)
    scores = torch.einsum("bhqd,bhkd->bhqk", rq, pool(rk)) / math.sqrt(d) + bias
    want = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), pool(v))
    torch.testing.assert_close(got, want.transpose(1, 2).flatten(2), rtol=1e-5, atol=1e-5)

    webui = WebUI(neo.NeoModel("flux"))
    plain = latent(webui, dit(proportional=False), cfg_scale=1)
    biased = latent(webui, dit(proportional=True), cfg_scale=1)
    assert torch.isfinite(biased).all() and not torch.equal(plain, biased)
    assert "not applied on this host" not in capsys.readouterr().out


def _compile_like_neo(kmodel, compile):
    """``kmodel.apply_model`` as Neo's sd_forge_compile wraps it: ``compile(diffusion_model)``
    in place of ``diffusion_model`` for each call, put back after it (undo: ``del
    kmodel.apply_model``)."""
    net, apply_model = kmodel.diffusion_model, kmodel.apply_model

    def apply_compiled(*args, **kwargs):
        kmodel.diffusion_model = compile(net)
        try:
            return apply_model(*args, **kwargs)
        finally:
            kmodel.diffusion_model = net

    kmodel.apply_model = apply_compiled


def test_a_compiled_model_is_not_recompiled_from_step_to_step():
    """Neo's compile extension compiles ``diffusion_model`` inside ``apply_model``: the swapped
    global is one stable object with plain-int state, so the graphs compiled at the first
    pooled step serve every later step and generation (and pool as eager does)."""
    from torch._dynamo.testing import CompileCounter

    model = neo.NeoModel("flux")
    webui = WebUI(model)
    eager = latent(webui, dit(), cfg_scale=1)
    kmodel, counter = model.forge_objects.unet.model, CompileCounter()
    compiled = torch.compile(kmodel.diffusion_model, backend=counter)
    _compile_like_neo(kmodel, lambda net: compiled)
    torch._dynamo.reset()
    try:
        first = latent(webui, dit(), cfg_scale=1)
        frames = counter.frame_count
        second = latent(webui, dit(), cfg_scale=1)
        assert counter.frame_count == frames
    finally:
        del kmodel.apply_model
        torch._dynamo.reset()
    torch.testing.assert_close(first, eager)
    assert torch.equal(first, second)


SD15_SIZES = [(128, 128), (192, 192), (256, 192)]  # latents 16x16, 24x24, 32x24


def _skip_transformer_options(guard_entries):  # Neo's guard_filter_fn preset (ComfyUI's)
    return [("transformer_options" not in entry.name) for entry in guard_entries]


def test_neo_compile_merges_an_sd15_unet_at_every_size_in_the_graphs_of_the_unpatched():
    """Neo's compile extension (its ``guard_filter_fn`` preset: ``diffusion_model`` compiled
    inside ``apply_model``, every guard on ``transformer_options`` dropped) on an SD1.5 UNet
    patched through the attn1 patch: three sizes at CFG 7, each the eager latent and merged,
    with the unpatched model's graphs (1, 1, 0). The patch's ``model_function_wrapper``
    starts each call on the host (``patcher.FunctionStart``); before, the call began at the
    first block inside the graph, from the latent size as ints: a graph per size (1, 1, 1).
    (ToDo on this path: the ComfyUI test in test_compile, the same patch.)"""
    from torch._dynamo.testing import CompileCounter

    settings = {"enabled": True, "policy": "fixed", "ratio": 0.5}
    model = neo.NeoModel("sd15")
    webui = WebUI(model)

    def run(tome, width, height):
        return latent(webui, tome, steps=2, width=width, height=height)

    eager = [run(settings, w, h) for w, h in SD15_SIZES]
    plain = [run(None, w, h) for w, h in SD15_SIZES]
    kmodel, counter = model.forge_objects.unet.model, CompileCounter()
    _compile_like_neo(kmodel, lambda net: torch.compile(
        net, backend=counter, options={"guard_filter_fn": _skip_transformer_options}))
    torch._dynamo.reset()
    graphs = []
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for (w, h), want, unmerged in zip(SD15_SIZES, eager, plain):
                before = counter.frame_count
                got = run(settings, w, h)
                graphs.append(counter.frame_count - before)
                torch.testing.assert_close(got, want)
                assert not torch.equal(got, unmerged)
    finally:
        del kmodel.apply_model
        torch._dynamo.reset()
    assert graphs == [1, 1, 0], graphs


def test_an_sd15_unet_keeps_the_function_wrapper_another_extension_set_before():
    """The UnetPatcher has one ``model_function_wrapper`` slot: the patch's call start chains
    the one another extension set before it (called inside ours, every call), and merges."""
    model = neo.NeoModel("sd15")
    webui = WebUI(model)
    calls = []

    def theirs(apply_model, params):
        calls.append(params["input"].shape)
        return apply_model(params["input"], params["timestep"], **params["c"])

    plain = latent(webui, None, steps=2, width=128, height=128)
    model.forge_objects.unet.set_model_unet_function_wrapper(theirs)
    merged = latent(webui, {"enabled": True, "policy": "fixed", "ratio": 0.5}, steps=2,
                    width=128, height=128)
    assert len(calls) == 2 and not torch.equal(merged, plain)


def test_residual_reuse_applies_per_identity_and_is_freed_after_the_generation(capsys,
                                                                              monkeypatch):
    """Forge Neo: the quality point (x8 everywhere, reuse every 5 steps; the fixed policy)
    keeps the unpooled attention's residual: at steps 0 and 5 every call also attends over
    the whole image's keys, the other steps over the pooled ones only; the image differs from
    x8 without reuse, is the same for the same seed, nothing is kept once the generation is
    over, and the next generation without ToMe gives the unpatched image."""
    model = neo.NeoModel("flux")
    webui = WebUI(model)
    off = latent(webui, steps=8)
    kernel.calls.clear()
    swaps, begin = [], swap.Swap.begin
    monkeypatch.setattr(swap.Swap, "begin", lambda self, *a: swaps.append(self) or begin(
        self, *a))
    on = latent(webui, dit(schedule="all:8", reuse=5), steps=8)
    (ours,) = set(swaps)
    assert ours.reuse.every == 5 and ours.reuse.held_bytes() == 0  # freed at the end
    text, image = neo.TEXT_TOKENS, 8 * 8
    full = [c for c in kernel.calls if c == (text + image, text + image)]
    pooled = [c for c in kernel.calls if c == (text + image, text + 1)]
    assert full and len(pooled) == 4 * len(full)  # 2 refresh steps of 8 at every call
    without = latent(webui, dit(schedule="all:8", reuse=0), steps=8)
    assert torch.isfinite(on).all() and not torch.equal(on, without)
    assert float((on - off).norm()) < float((without - off).norm())
    assert torch.equal(latent(webui, dit(schedule="all:8", reuse=5), steps=8), on)
    assert torch.equal(latent(webui, steps=8), off)
    assert "not applied on this host: residual reuse" not in capsys.readouterr().out


def test_each_pass_prints_its_tally_of_attention_calls_once(capsys):
    """After each sampling pass the WebUI prints the line ComfyUI's node prints after each
    sampling, the pass named, once per pass even over two batches. The stand-in Flux has 2
    double- and 2 single-stream blocks, so a model call makes 4 attention calls; with CFG
    (cond and uncond in one batch) one model call per step: 4 steps make 16 calls, the
    3-step hires pass 12. ``blocks double`` pools the 2 double-stream blocks' calls and
    leaves the 2 single-stream ones at x1."""
    webui = WebUI(neo.NeoModel("flux"))
    webui.generate(tome=dit(blocks="double"), steps=4, n_iter=2, enable_hr=True, hr_scale=2.0,
                   hr_second_pass_steps=3)
    lines = [x for x in capsys.readouterr().out.splitlines() if "attention calls" in x]
    assert lines == [
        "ToMe: first pass pooled 8 of 16 attention calls; the rest: blocks at x1 8",
        "ToMe: hires pass pooled 6 of 12 attention calls; the rest: blocks at x1 6"]
    webui.generate(tome=dit(), steps=2, cfg_scale=1)  # one call per step, batch 1: 2 x 4
    assert [x for x in capsys.readouterr().out.splitlines() if "attention calls" in x] == [
        "ToMe: first pass pooled 8 of 8 attention calls"]


def test_the_summary_line_says_what_the_schedule_and_reuse_run(capsys):
    """A DiT's console summary names what runs (the schedule's factor per block and reuse),
    not the method's plain factor: ``x8 in all blocks; residual reuse every 5 steps``, never
    ``downsample x2`` for an ``all:8`` schedule."""
    webui = WebUI(neo.NeoModel("flux"))
    latent(webui, dit(schedule="all:8", reuse=5), steps=6)
    out = capsys.readouterr().out
    assert "ToMe: DiT (forge neo flux) first pass x8 in all blocks; residual reuse every 5 " \
           "steps; 4/4 blocks pooled" in out, out
    assert "first pass downsample x2" not in out


def _refreshes(webui, steps, paced=False, **fields):
    """(full, pooled) attention calls per pass of one x8 generation with reuse 5."""
    kernel.calls.clear()
    latent(webui, dit(schedule="all:8", reuse=5, paced=paced), steps=steps, cfg_scale=1,
           **fields)
    out = {}
    for side in (8, 16):  # the first pass's 8x8 image tokens, a x2 hires pass's 16x16
        n = neo.TEXT_TOKENS + side * side
        out[side] = (sum(c == (n, n) for c in kernel.calls),
                     sum(c == (n, neo.TEXT_TOKENS + side * side // 64) for c in kernel.calls))
    return out


def test_paced_reuse_follows_each_passs_steps():
    """Neo hands no model call the sampler's sigmas (no ``sample_sigmas``), so the WebUI
    tells each pass its step count: ``paced`` reuse 5 refreshes every 3 steps at 8 steps
    (0, 3, 6: 3 of 8 steps also attend over every key) and every 2 in a 4-step hires pass
    (0, 2); unpaced at 0 and 5. In the real Neo 2.26 ``quality`` gave the unpaced pixels
    before (paced did nothing there)."""
    webui = WebUI(neo.NeoModel("flux"))
    full, pooled = _refreshes(webui, 8, paced=True)[8]
    assert full and 3 * pooled == 8 * full
    full, pooled = _refreshes(webui, 8)[8]
    assert full and pooled == 4 * full
    hires = _refreshes(webui, 8, paced=True, enable_hr=True, hr_scale=2.0,
                       hr_second_pass_steps=4)
    assert 3 * hires[8][1] == 8 * hires[8][0]
    full, pooled = hires[16]
    assert full and pooled == 2 * full


@pytest.mark.parametrize("name, fix, expected", [
    ("first", False, 20), ("hires", False, 6), ("img2img", False, 9), ("img2img", True, 20)])
def test_the_steps_each_pass_samples(monkeypatch, name, fix, expected):
    """The WebUI's rule (``setup_img2img_steps``): txt2img samples ``steps``, the hires pass
    its own steps, img2img int(20 x 0.4) + 1 = 9 unless ``img2img_fix_steps`` is on."""
    monkeypatch.setitem(host.opts().data, "img2img_fix_steps", fix)
    p = SimpleNamespace(steps=20, hr_second_pass_steps=6, denoising_strength=0.4)
    assert host.sampled_steps(p, name) == expected
