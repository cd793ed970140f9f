"""Time-axis cells (``ToMeConfig.temporal``): a video's keys and values pooled over runs of
frames too (2x2x2 cells), against references written by hand; frames a model keeps whole stay
whole; the setting round-trips through the WebUI's infotext and the ComfyUI node."""

from __future__ import annotations

import math

import pytest
import torch
from models import randomised

import tome
from tome import dit
from tome.config import ToMeConfig

diffusers = pytest.importorskip("diffusers")
F_, H, W = 3, 4, 6  # latent frames, token grid per frame


def test_a_frame_pair_s_keys_are_averaged_as_by_hand():
    """3 frames of 2x4 tokens between 1 token before and 2 after, 2x2x2 cells: frames 0 and 1
    pooled together (8 tokens a cell), frame 2 alone (4 a cell); the others untouched."""
    frames, h, w, c = 3, 2, 4, 5
    x = torch.randn(2, 1 + frames * h * w + 2, c, dtype=torch.float64)

    def tok(t, i, j):
        return x[:, 1 + t * h * w + i * w + j]
    want = [x[:, 0]]
    for ts in ((0, 1), (2,)):
        for j0 in (0, 2):
            cell = [tok(t, i, j) for t in ts for i in (0, 1) for j in (j0, j0 + 1)]
            want.append(sum(cell) / len(cell))
    want += [x[:, -2], x[:, -1]]
    got = dit.pool_span(x, 1, h, w, 2, 1, frames, 2)
    torch.testing.assert_close(got, torch.stack(want, 1), rtol=0, atol=1e-12)
    bias = dit.key_bias(1, x.shape[1], h, w, 2, "cpu", frames=frames, temporal=2)
    assert bias.tolist() == pytest.approx([0, math.log(8), math.log(8), math.log(4),
                                           math.log(4), 0, 0])


def test_pooled_positions_of_a_frame_pair_are_the_mean_angle():
    """RoPE ("pooled"): a 2x2x2 cell's key is rotated by the mean angle of its 8 tokens."""
    frames, h, w = 2, 2, 2
    t, i, j = torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w),
                             indexing="ij")
    rates = torch.tensor([0.3, 0.1, 0.05], dtype=torch.float64)  # per channel
    angle = (t.reshape(-1, 1) * rates + i.reshape(-1, 1) * rates * 2
             + j.reshape(-1, 1) * rates * 3)  # [8 tokens, 3 channels]
    cos, sin = dit.pool_cos_sin(angle.cos(), angle.sin(), 0, h, w, 2, 0, frames, 2)
    mean = angle.mean(0, keepdim=True)
    torch.testing.assert_close(cos, mean.cos())
    torch.testing.assert_close(sin, mean.sin())


def test_factor_one_pools_no_frames():
    """A block the schedule leaves at factor 1 is not pooled in time either."""
    plan = dit.DitPlan(H, W, 2, "pooled", False, F_, 2)
    assert plan.pooled == 2 * (H // 2) * (W // 2)
    x = torch.randn(1, F_ * H * W, 3)
    assert torch.equal(plan.with_factor(1).pool(x, 0, 1), x)


@pytest.fixture(scope="module")
def wan():
    return randomised(diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64))


def _inputs(per_token=False):
    g = torch.Generator().manual_seed(0)
    ts = torch.full((2,), 700.0)
    if per_token:  # Wan 2.2 TI2V image-to-video: the first frame is the condition (t = 0)
        ts = torch.full((2, F_ * H * W), 700.0)
        ts[:, :H * W] = 0
    return dict(hidden_states=torch.randn(2, 4, F_, 2 * H, 2 * W, generator=g), timestep=ts,
                encoder_hidden_states=torch.randn(2, 7, 16, generator=g))


class _Keys:
    """The keys of every SDPA call (diffusers' native backend and ToMe's both end there)."""

    def __init__(self, monkeypatch):
        self.seen: list[torch.Tensor] = []
        real = torch.nn.functional.scaled_dot_product_attention

        def spy(query, key, value, *args, **kwargs):
            self.seen.append(key)
            return real(query, key, value, *args, **kwargs)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)


def _run(model, inputs, monkeypatch, **settings):
    keys = _Keys(monkeypatch)
    if settings:
        tome.apply_patch(model, method="downsample", policy="fixed", **settings)
    try:
        with torch.no_grad():
            return model(**inputs).sample, keys.seen
    finally:
        tome.remove_patch(model)
        monkeypatch.undo()


def test_wan_pools_pairs_of_frames(wan, monkeypatch):
    """diffusers' Wan with ``temporal=2``: ceil(3 / 2) frame cells of 2x2 tokens per frame's
    cells; the first block's pooled keys are the per-frame pooled keys' pair means."""
    inputs = _inputs()
    per, per_keys = _run(wan, inputs, monkeypatch, rope="before")
    deep, deep_keys = _run(wan, inputs, monkeypatch, rope="before", temporal=2)
    cells = (H // 2) * (W // 2)
    assert per_keys[0].shape[-2] == F_ * cells
    assert deep_keys[0].shape[-2] == 2 * cells  # self-attention; then cross-attention
    k = per_keys[0]  # rope before: rotated, then pooled; a mean of means over equal cells
    pair = (k[..., :cells, :] + k[..., cells:2 * cells, :]) / 2
    torch.testing.assert_close(deep_keys[0][..., :cells, :], pair, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(deep_keys[0][..., cells:, :], k[..., 2 * cells:, :])
    assert not torch.equal(per, deep) and torch.isfinite(deep).all()


def test_wan_ti2v_keeps_its_condition_frame_whole_with_time_cells(wan, monkeypatch):
    """Wan 2.2 TI2V's first frame (the given image) keeps its keys as they are; time cells
    pool the generated frames after it (2 of them: one pair)."""
    inputs = _inputs(per_token=True)
    _, full = _run(wan, inputs, monkeypatch)
    _, deep = _run(wan, inputs, monkeypatch, rope="before", temporal=2)
    assert deep[0].shape[-2] == H * W + (H // 2) * (W // 2)
    torch.testing.assert_close(deep[0][..., :H * W, :], full[0][..., :H * W, :])


def test_the_setting_round_trips_through_infotext():
    from tome.webui import infotext
    from tome.webui import script_args as S
    cfg = ToMeConfig(method="downsample", temporal=2)
    s = S.ScriptSettings(True, cfg)
    written = infotext.build(s, {"first": cfg}, ignores=())
    assert written["ToMe temporal"] == 2
    params = {k: str(v) for k, v in written.items()}
    assert infotext.reader("temporal", 1)(params) == 2
    assert "ToMe temporal" not in infotext.build(s, {"first": cfg})  # a UNet image: not read


def test_the_setting_round_trips_through_the_node():
    from comfy_node import defaults

    from tome.comfy import inputs
    spec = inputs.input_types()["optional"]["temporal"]
    assert spec[0] == "INT" and (spec[1]["min"], spec[1]["max"]) == (1, 4)
    assert inputs.config(defaults(method="downsample", temporal=2), "dit").temporal == 2
    assert inputs.config(defaults(preset="quality", temporal=2), "dit").temporal == 2
    with pytest.raises(ValueError, match="temporal"):
        ToMeConfig(temporal=0)


def test_time_cells_are_part_of_the_measurement_key_and_earlier_keys_stay(wan):
    """A timing with 2x2x2 cells is not one without; without them the key is what it was
    before the setting existed (cached readings keep their keys)."""
    from tome import layout
    from tome.measurements import key_config
    read = layout.read(wan)
    one, two = (key_config(read, ToMeConfig(method="downsample", temporal=t)) for t in (1, 2))
    assert two["temporal"] == 2 and "temporal" not in one
