"""``tome.methods``: the registry, and proof that a method is one room: a third method defined
and registered in this file alone works through the library patch, the Forge stand-in, the
auto policy, the WebUI's infotext round trip and the lab's setting parser."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import TINY_SD15, ldm_inputs, ldm_unet, run

import tome
from tome import config, methods, policy
from tome.adapters import patch_model_patcher as patch_unet
from tome.config import ToMeConfig
from tome_lab.settings import Setting


class SubsamplePlan:
    def __init__(self, factor: int):
        self.factor = factor

    def kv(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, ::self.factor]


class Subsample(methods.Method):
    """Toy: self-attention's keys and values are every ``downsample_factor``-th token."""

    name = "subsample"
    value_field = "downsample_factor"
    ignores = methods.MERGE_FIELDS
    unmerges = False
    self_attention_only = True
    thresholds = {"cpu": 64, "cuda": 64, "mps": 64}

    def active(self, c: ToMeConfig) -> bool:
        return c.downsample_factor > 1

    def plan(self, planner, call, x, level, h, w, decoder):
        factor = planner.config.downsample_factor
        planner.record(level, x.shape[1], x.shape[1] - x.shape[1] // factor)
        return SubsamplePlan(factor)

    def reduce(self, plan, x):
        return x, plan.kv(x)


@pytest.fixture
def subsample():
    method = methods.register(Subsample())
    yield method
    methods.unregister(method.name)


def test_config_names_are_the_registry():
    assert config.choices("method") == methods.names() == tuple(methods.REGISTRY)
    for name, method in methods.REGISTRY.items():
        assert method.name == name and set(method.ignores) <= set(config.FIELDS)
        assert set(method.thresholds) <= set(policy.KINDS)
        assert method.value_field in config.FIELDS


def test_a_registered_method_is_a_choice_until_unregistered():
    method = methods.register(Subsample())
    try:
        assert "subsample" in config.choices("method") and ToMeConfig(method="subsample").active
    finally:
        methods.unregister(method.name)
    assert "subsample" not in config.choices("method")
    with pytest.raises(ValueError, match="method='subsample'"):
        ToMeConfig(method="subsample")


def test_only_random_destinations_make_the_seed_matter():
    assert methods.get("merge").seeded(ToMeConfig())
    assert not methods.get("merge").seeded(ToMeConfig(use_rand=False))
    assert not methods.get("downsample").seeded(ToMeConfig(method="downsample"))


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="method='warp'"):
        ToMeConfig(method="warp")


def test_a_new_method_works_in_the_library(subsample):
    unet, (x, t, c) = ldm_unet(TINY_SD15), ldm_inputs()
    with torch.no_grad():
        base = run(unet, x, t, c)
        tome.apply_patch(unet, method="subsample", downsample_factor=4, use_rand=False)
        out = run(unet, x, t, c)
        report = tome.patch_report(unet)
        assert report.levels == {1: 5} and report.tokens[1] == (256, 256 - 64)
        assert "subsample" not in report.summary() and "downsample_factor 4" in report.summary()
        tome.remove_patch(unet)
        assert torch.equal(run(unet, x, t, c), base)
    assert out.shape == base.shape and not torch.equal(out, base)
    # its thresholds drive the auto policy: 256 tokens pay at its 64, not the default 4096
    assert policy.decide_level(ToMeConfig(method="subsample", policy="auto"), 1, 256,
                               "cpu").merged


def test_a_new_method_works_through_the_patcher_contract(subsample):
    from stubs import Patcher, self_attention_block

    patcher = Patcher(ldm_unet(TINY_SD15))
    unet, patch = patch_unet(patcher, ToMeConfig(method="subsample",
                                                       downsample_factor=2))
    x = torch.randn(2, 16 * 16, 8)
    out = self_attention_block(unet, x, (2, 4, 16, 16))
    n = F.layer_norm(x, x.shape[-1:])
    expected = x + F.scaled_dot_product_attention(n, n[:, ::2], n[:, ::2])
    torch.testing.assert_close(out, expected)
    assert patch.tokens == {1: (256, 128)}


def test_a_new_method_round_trips_through_the_webui_infotext(subsample):
    from webui_stub.harness import WebUI

    from tome.webui import script_args

    webui = WebUI()
    res = webui.generate(tome={"enabled": True, "method": "subsample", "downsample_factor": 3,
                               "policy": "fixed"})
    assert "ToMe method: subsample, ToMe downsample factor: 3" in res.info
    assert "ToMe ratio" not in res.info  # a field the method ignores is not written
    pasted = script_args.parse_args(webui.paste("txt2img", res.info))
    assert pasted.config == script_args.parse_args([res.p.script_args[
        webui.script().args_from]]).config.replace(policy="fixed")
    assert [c.config.method for c in webui.calls if c.config] == ["subsample"] * 3


def test_a_new_method_parses_in_the_lab(subsample):
    s = Setting.parse("subsample:4:max_downsample=2")
    assert s.config.method == "subsample" and s.config.downsample_factor == 4
    assert s.label == "subsample 4 max_downsample=2" and s.reduction == 4.0
    assert Setting.parse(s.spec) == s
