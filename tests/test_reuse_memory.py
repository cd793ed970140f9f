"""Residual reuse's memory (issue 38): what reuse will keep is estimated before it keeps it
(``tome/memory.py``) and checked against free memory, it keeps less where that does not fit
(the ladder, down to the settings' point without reuse, one console line), nothing stays
kept after a generation, Wan 2.2's two experts never hold theirs at once, and the auto policy
times the refresh share a generation with reuse runs.

The byte counts here are written out from the tiny DiT's shape (6 pooled blocks, 4 text + 32 x
32 image tokens, 3 heads x 32, float32), not taken from the estimator."""

from __future__ import annotations

import functools
import math
import types

import pytest
import torch
from models import randomised

import tome
from tome import attend, budget, dit, memory, processors
from tome.config import preset, without_reuse
from tome.measure import measure
from tome.report import STATE_ATTR

diffusers = pytest.importorskip("diffusers")

BLOCKS, TEXT, IMAGE, WIDTH, FP32 = 6, 4, 32 * 32, 96, 4
# One residual of every pooled block, one batch row (reuse keeps its slope too: twice this).
RESIDUALS = BLOCKS * (TEXT + IMAGE) * WIDTH * FP32


@functools.lru_cache(maxsize=1)
def _tiny():
    from tome_lab.tinydit import model
    return model


def tiny_dit():
    return _tiny().load_model()


def steps(model, n, total=20, cfg=False, classes=(0,)):
    """The first ``n`` of ``total`` Euler steps as ``tinydit.sample`` runs them; ``cfg``: the
    null class in a second call per step (true CFG, as Flux's and Wan's pipelines call)."""
    tinydit = _tiny()
    g = torch.Generator().manual_seed(0)
    cls = torch.tensor(classes)
    x = torch.randn((len(cls), 3, 64, 64), generator=g)
    ts = tinydit.schedule(total).tolist()
    with torch.no_grad():
        for t, t_next in list(zip(ts[:-1], ts[1:]))[:n]:
            tt = torch.full((len(cls),), t)
            v = model(x, tt, cls)
            if cfg:
                v = v + 0.5 * (v - model(x, tt, torch.full_like(cls, tinydit.NULL)))
            x = x + (t_next - t) * v
    return x


def state(model):
    return vars(model.transformer)[STATE_ATTR]


def free_for(need, rows=1):
    """Free memory in which ``need`` kept bytes just fit, with the forward's activations of a
    call of ``rows`` batch rows (16 copies of one block's input), the margin and headroom."""
    reserve = memory.ACTIVATION_COPIES * rows * (TEXT + IMAGE) * WIDTH * FP32
    return math.ceil((need + reserve) * memory.MARGIN) + memory.HEADROOM


def test_the_estimate_equals_what_reuse_holds_after_its_refreshes():
    """quality: x8 in all blocks, refresh every 5 steps. The budget estimates at the first
    call what reuse keeps once it has refreshed twice (each block's residual and slope), and
    after the refresh at step 5 that is exactly what it holds; the report says it."""
    model = tiny_dit()
    tome.apply_patch(model, config=preset("quality", policy="fixed"))
    try:
        st = state(model)
        steps(model, 1)
        assert st.budget.need == 2 * RESIDUALS and st.budget.keep == attend.Keep()
        st.reuse.reset()  # the host's run start: a new generation
        steps(model, 6)
        assert st.reuse.held_bytes() == st.budget.need == 2 * RESIDUALS
        assert tome.patch_report(model).summary().endswith(
            f"reuse keeps {2 * RESIDUALS / 2**20:.1f} MiB (residual + slope)")
        st.reuse.reset()
        steps(model, 6, classes=(0, 1))  # two batch rows: twice as much
        assert st.reuse.held_bytes() == st.budget.need == 4 * RESIDUALS
    finally:
        tome.remove_patch(model)


@pytest.mark.parametrize("family,blocks,size", [
    ("flux", (2, 2), "256"), ("sd3", (2, 0), "256"), ("qwen", (2, 0), "256"),
    ("wan", (2, 0), "128x96x9")])
def test_the_estimate_is_what_each_family_holds(family, blocks, size):
    """Joint attention (Flux's double and single blocks, Qwen-Image), SD3.5's image-only
    second attention, Wan's self-attention over a video: after two refreshes each holds what
    the budget estimated at its first call."""
    from tome_lab import dit_shapes
    model = dit_shapes.build(family, blocks, True, torch.float32)
    tome.apply_patch(model, config=preset("quality", policy="fixed", reuse=1))
    try:
        st = vars(model)[STATE_ATTR]
        with torch.no_grad():
            for t in (0.9, 0.8):
                model(**dit_shapes.inputs(model, family, dit_shapes.Size.parse(size),
                                          torch.float32, True, t=t))
        assert st.reuse.held_bytes() == st.budget.need > 0
    finally:
        tome.remove_patch(model)


def test_a_second_call_per_step_is_counted_before_it_keeps_anything(monkeypatch):
    """True CFG calls the model twice per step: the second call is a call identity of its
    own, counted (and checked) at its first call; here the memory fits one call's residuals
    and slopes but not two, so reuse steps down at the uncond's first call, before it keeps
    anything, and what it then holds is the step's estimate."""
    model = tiny_dit()
    tome.apply_patch(model, config=preset("quality", policy="fixed"))
    monkeypatch.setattr(memory, "available", lambda device: free_for(2 * RESIDUALS))
    lines = []
    try:
        st = state(model)
        st.budget.say = lines.append
        steps(model, 7, cfg=True)  # both refresh at 0 and 5 (the cond's kept is converted)
        step = attend.Keep(dtype=torch.bfloat16)
        assert st.budget.keep == step and len(lines) == 1
        assert st.reuse.held_bytes() == st.budget.need == budget.reuse_bytes(
            [budget.Part(i, TEXT + IMAGE, IMAGE, WIDTH) for i in range(BLOCKS)], 2,
            torch.float32, step)
    finally:
        tome.remove_patch(model)


def test_too_little_free_memory_steps_down_the_ladder_to_no_reuse(monkeypatch, capsys):
    """With the free memory of each ladder step (fake), reuse keeps that step and says so in
    one console line (none where everything fits); with less than the last step, reuse is off
    and the preset's point without reuse runs: its schedule, its image, nothing kept; with
    the memory back, the next generation reuses everything again."""
    model = tiny_dit()
    config = preset("quality", policy="fixed")
    free = {"now": 0}
    monkeypatch.setattr(memory, "available", lambda device: free["now"])
    full = 2 * RESIDUALS
    image = 2 * BLOCKS * IMAGE * WIDTH  # residual + slope of the image rows, one byte each
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    expected = [(attend.Keep(), full),
                (attend.Keep(dtype=bf16), full // 2),
                (attend.Keep(dtype=bf16, image_only=True), 2 * image),
                (attend.Keep(dtype=fp8, image_only=True), image),
                (attend.Keep(slope=False, dtype=fp8, image_only=True), image // 2)]
    assert budget.ladder(torch.float32, "cpu") == [k for k, _ in expected]
    try:
        for keep, held in expected:
            tome.apply_patch(model, config=config)
            free["now"] = free_for(held)
            capsys.readouterr()
            steps(model, 6)
            st = state(model)
            out = capsys.readouterr().out
            assert st.budget.keep == keep
            assert st.reuse.held_bytes() == held
            if keep == attend.Keep():
                assert out == ""
            else:
                assert out.count("\n") == 1 and out.startswith("ToMe: residual reuse would keep")
                assert keep.words() in out
        free["now"] = free_for(image // 2) - 1  # the bottom: no reuse
        tome.apply_patch(model, config=config)
        off = steps(model, 6)
        st = state(model)
        out = capsys.readouterr().out
        assert out.count("\n") == 1 and "it is off" in out
        assert st.budget.keep.blocks == 0 and st.reuse.held_bytes() == 0
        assert st.call.schedule.items == dit.schedule_of(without_reuse(config)).items
        assert tome.patch_report(model).summary().endswith(
            "reuse off (not enough memory): x2 in single blocks, steps 0.3-1")
        free["now"] = free_for(full)  # memory back: the next generation reuses again
        steps(model, 6)
        assert st.budget.keep == attend.Keep()
        assert st.call.schedule.items == dit.schedule_of(config).items
        assert st.reuse.held_bytes() == full
    finally:
        tome.remove_patch(model)
    tome.apply_patch(model, config=without_reuse(config))
    try:
        assert torch.equal(steps(model, 6), off)
    finally:
        tome.remove_patch(model)


# ----------------------------------------------------------------------------- experts

def _wan(seed):
    torch.manual_seed(seed)
    return randomised(diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64))


def _wan_call(model, t):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        model(hidden_states=torch.randn(1, 4, 3, 16, 24, generator=g),
              timestep=torch.full((1,), t),
              encoder_hidden_states=torch.randn(1, 7, 16, generator=g))


def test_the_second_expert_frees_the_firsts_residuals():
    """Wan 2.2 A14B: the high-noise expert runs the first steps, the low-noise one
    (``transformer_2``) the rest. At the second's first call the first's residuals are
    freed, and at the next generation's first call the second's."""
    pipe = types.SimpleNamespace(transformer=_wan(0), transformer_2=_wan(1))
    tome.apply_patch(pipe, config=preset("quality", policy="fixed"))
    try:
        first, second = (vars(m)[STATE_ATTR].reuse for m in (pipe.transformer,
                                                              pipe.transformer_2))
        for t in (999.0, 900.0):
            _wan_call(pipe.transformer, t)
        assert first.held_bytes() > 0 and second.held_bytes() == 0
        for t in (500.0, 400.0):
            _wan_call(pipe.transformer_2, t)
        assert first.held_bytes() == 0 and second.held_bytes() > 0
        _wan_call(pipe.transformer, 999.0)  # the next generation
        assert first.held_bytes() > 0 and second.held_bytes() == 0
    finally:
        tome.remove_patch(pipe)


# ----------------------------------------------------------------------------- auto policy

def test_the_runner_times_the_refresh_share(monkeypatch):
    """With reuse every N, a timed pooled run also runs the unpooled attention on 1/N of the
    queries against all keys (a refresh every N steps); without reuse it does not. A period
    given as a callable may be fractional (a step cache's skips: every 5 in half the steps
    computed is every 2.5 of them). The clock counts attention work (query rows x key rows),
    so the measured speed-up is the work's."""
    model = tiny_dit()
    layout = tome.layout.read(model)
    calls: list[tuple[int, int]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(*args, **kwargs):
        q, k = (args[i] if len(args) > i else kwargs[n] for i, n in ((0, "query"), (1, "key")))
        calls.append((q.shape[-2], k.shape[-2]))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    seen: dict[str, list] = {}

    def clock(phase, fn):
        calls.clear()
        fn()
        seen.setdefault(phase, []).append(list(calls))
        return float(sum(q * k for q, k in calls))

    speed = {}
    for every in (0, 5, 2.5):
        seen.clear()
        config = preset("quality", policy="fixed", reuse=math.ceil(every))
        period = every if every != 2.5 else (lambda: 2.5)
        m = measure(model, (32, 32), 1, config, runner=processors.runner(layout, period),
                    clock=clock, rounds=3, warmup=0)
        full = seen["unmerged"][0]
        assert len({q for q, _ in full}) == 1 and all(q == k for q, k in full)
        s = full[0][0]  # text + image rows of the timed block
        pooled = [(s, k) for _, k in seen["merged"][0] if k < s]
        share = [(q, k) for q, k in seen["merged"][0] if k == s]
        assert pooled and share == ([(math.ceil(s / every), s)] if every else [])
        speed[every] = m.rows[0].speedup
        assert speed[every] == pytest.approx(s * s / (s * pooled[0][1] + sum(
            q * k for q, k in share)))
    assert speed[2.5] < speed[5] < speed[0]


def test_reuse_is_part_of_the_measurement_key():
    from tome.measurements import key_config
    layout = tome.layout.read(tiny_dit())
    a, b = (key_config(layout, preset("quality", reuse=n)) for n in (0, 5))
    assert a != b


# ----------------------------------------------------------------------------- generation end

class _Pipeline(diffusers.DiffusionPipeline):
    """A diffusers pipeline's shape as ToMe meets it: registered ``transformer``, and the
    denoising loop inside ``self.progress_bar`` (every diffusers pipeline's), calling the
    tiny DiT like ``tinydit.sample``; ``fail``: the step that raises (an error or an
    interrupt), ``held``: what reuse held at each step."""

    def __init__(self, transformer):
        super().__init__()
        self.register_modules(transformer=transformer)

    def __call__(self, model, n=6, fail=None, error=RuntimeError):
        self.held = []
        tinydit = _tiny()
        x = torch.randn((1, 3, 64, 64), generator=torch.Generator().manual_seed(0))
        ts = tinydit.schedule(n).tolist()
        with self.progress_bar(total=n) as bar, torch.no_grad():
            for i, (t, t_next) in enumerate(zip(ts[:-1], ts[1:])):
                if i == fail:
                    raise error("stopped")
                x = x + (t_next - t) * model(x, torch.full((1,), t), torch.tensor([0]))
                self.held.append(state(model).reuse.held_bytes())
                bar.update()
        return x


@pytest.mark.parametrize("error", [None, RuntimeError, KeyboardInterrupt])
def test_nothing_is_kept_after_a_generation_ends_or_raises(error):
    model = tiny_dit()
    pipe = _Pipeline(model.transformer)
    pipe.set_progress_bar_config(disable=True)
    tome.apply_patch(pipe, config=preset("quality", policy="fixed"))
    try:
        if error is None:
            pipe(model)
        else:
            with pytest.raises(error):
                pipe(model, fail=3, error=error)
        assert pipe.held and min(pipe.held) > 0  # it kept while sampling
        assert state(model).reuse.held_bytes() == 0
    finally:
        tome.remove_patch(pipe)


# ----------------------------------------------------------------------------- the lab

def test_the_frontier_prints_what_reuse_keeps_and_each_ladder_steps_fidelity(tmp_path):
    """``python -m tome_lab.dit_frontier --ladder``: the quality preset at each ladder step
    and without reuse, with what reuse held, and the estimator's table of released models
    (Flux at 2048 px, Wan at 480p x 81 frames) with the step a 24 and an 80 GiB card land on."""
    from tome_lab import dit_frontier
    rows = dit_frontier.run(tmp_path, steps=6, seeds=(0,), ladder_only=True)
    names = [r["setting"] for r in rows]
    assert names[0] == "unpooled" and len(names) == 2 + len(budget.ladder(torch.float32, "cpu"))
    held = [r["held"] for r in rows[1:]]
    assert held[-1] == 0 and all(a > b for a, b in zip(held, held[1:]))
    assert all(r["psnr"] > 0 for r in rows[1:])
    text = (tmp_path / "frontier.md").read_text()
    assert "reuse keeps" in text and "| Wan 2.1 1.3B | 832x480x81 | 2 | 32760 |" in text
    assert "| Flux-dev | 2048 | 1 | 16384 | 11.0 GiB |" in text and "80 GiB card" in text


def test_without_reuse_never_falls_back_to_a_point_naming_no_block():
    """The quality preset's point without reuse pools Flux's single-stream blocks; Wan and
    Qwen-Image have none, so theirs is the next point (every block, x2 over steps 0.5-1), not
    nothing (seen in the real ComfyUI 0.8.0: Wan passed through)."""
    quality, fast = preset("quality"), preset("fast")
    assert without_reuse(quality, ["double", "single", "single"]).schedule == "single:2@0.3-1"
    assert without_reuse(quality, ["double", "double"]).schedule == "all:2@0.5-1"
    assert without_reuse(fast, ["double", "double"]).schedule == "all:2@0.3-1"
    assert without_reuse(quality).schedule == "single:2@0.3-1"  # no model: the first point


def test_reuse_off_for_memory_on_wan_still_pools(monkeypatch, capsys):
    """Where reuse does not fit at all, a Wan (self-attention blocks only) runs the quality
    preset's point without reuse that names its blocks: its image differs from the model's."""
    from tome_lab import dit_shapes
    monkeypatch.setattr(memory, "available", lambda device: 0)
    model = dit_shapes.build("wan", (2, 0), True, torch.float32)
    inputs = dit_shapes.inputs(model, "wan", dit_shapes.Size.parse("128x96x9"), torch.float32,
                               True, t=0.2)
    with torch.no_grad():
        ref = model(**inputs)
    tome.apply_patch(model, config=preset("quality", policy="fixed"))
    try:
        with torch.no_grad():
            out = model(**inputs)
        st = vars(model)[STATE_ATTR]
        assert st.budget.keep.blocks == 0 and st.reuse.held_bytes() == 0
        assert "x2 in all blocks, steps 0.5-1" in capsys.readouterr().out
        assert not torch.equal(out[0] if isinstance(out, tuple) else out.sample,
                               ref[0] if isinstance(ref, tuple) else ref.sample)
    finally:
        tome.remove_patch(model)
