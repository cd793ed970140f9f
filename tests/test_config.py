"""``ToMeConfig`` (``tome/config.py``) and the public API's keywords: every range a message,
a slider or a node input quotes is the one enforced; bad input (a number out of range, a
mistyped keyword, a schedule too long) is a ``ValueError`` naming it before anything
changes."""

from __future__ import annotations

import math
import re

import pytest
import torch
from models import ldm_inputs, ldm_unet, run, snapshot

import tome
from tome import dit
from tome.comfy import inputs
from tome.config import FIELDS, ToMeConfig, preset

# The ranges the settings document (help, sliders, node inputs), written out here so that a
# range changed in one place only is caught.
RANGES = {"sx": (1, 8), "sy": (1, 8), "downsample_factor": (1, 8), "reuse": (0, 20),
          "temporal": (1, 4), "start": (0.0, 1.0), "end": (0.0, 1.0)}


@pytest.fixture(scope="module")
def unet():
    return ldm_unet()


def test_every_bounded_field_documents_its_range_in_the_metadata():
    bounded = {name: (f.metadata["minimum"], f.metadata["maximum"])
               for name, f in FIELDS.items() if "maximum" in f.metadata}
    assert bounded == RANGES
    assert "maximum" not in FIELDS["ratio"].metadata  # its limit is the stride's rule


@pytest.mark.parametrize("name", sorted(RANGES))
def test_the_metadata_range_is_the_one_enforced(name):
    lo, hi = RANGES[name]
    other = {"start": {"end": 1.0}, "end": {"start": 0.0}}.get(name, {})
    for ok in (lo, hi):
        assert getattr(ToMeConfig(**{**other, name: ok}), name) == ok
    step = 1 if isinstance(lo, int) else 1e-6
    kind = {0: "a non-negative integer", 1: "a positive integer"}[lo] if step == 1 \
        else "a number"
    quoted = f"[{lo:g}, {hi:g}]"
    for bad in (lo - step, hi + step, hi * 10**6, -math.inf, math.inf, math.nan):
        with pytest.raises(ValueError, match=rf"invalid {name}=.*must be {kind} in "
                                             rf"{re.escape(quoted)}"):
            ToMeConfig(**{**other, name: bad})


def test_the_node_inputs_show_the_enforced_ranges():
    for name, (lo, hi) in RANGES.items():
        _, options = inputs.spec(name)
        assert (options["min"], options["max"]) == (lo, hi), name


@pytest.mark.parametrize("values, message", [
    ({"sx": 10**6}, "sx=1000000: must be a positive integer in [1, 8]"),
    ({"sy": 9}, "sy=9: must be a positive integer in [1, 8]"),
    ({"downsample_factor": 2**40}, "downsample_factor=1099511627776: must be a positive "
                                   "integer in [1, 8]"),
    ({"reuse": 10**30}, "reuse=1000000000000000000000000000000: must be a non-negative "
                        "integer in [0, 20]"),
    ({"reuse": 21}, "reuse=21: must be a non-negative integer in [0, 20]"),
    ({"sx": 2.0}, "sx=2.0: must be a positive integer in [1, 8]"),
    ({"start": math.nan}, "start=nan: must be a number in [0, 1]"),
    ({"max_downsample": 2.0}, "max_downsample=2.0: must be one of (1, 2, 4, 8)"),
    ({"max_downsample": True}, "max_downsample=True: must be one of (1, 2, 4, 8)"),
    ({"method": ["downsample"]}, "method=['downsample']: must be a string"),
    ({"schedule": 4}, "schedule=4: must be a string"),
    ({"blocks": "1" * 5000}, "blocks='111"),
    ({"schedule": "all:9"}, "'all:9': factor 1-8"),
])
def test_out_of_range_values_are_value_errors(values, message):
    with pytest.raises(ValueError) as e:
        ToMeConfig(**values)
    assert message in str(e.value) and str(e.value).startswith("ToMe: invalid ")
    assert len(str(e.value)) < 400  # a long value is quoted cut


@pytest.mark.parametrize("values, message", [
    ({"sx": "1e6"}, "sx=1000000: must be a positive integer in [1, 8]"),
    ({"reuse": "1e30"}, "reuse=1000000000000000019884624838656: must be a non-negative"),
    ({"downsample_factor": 2**40}, "downsample_factor=1099511627776: must be a positive"),
    ({"end": "inf"}, "end=inf: must be a number in [0, 1]"),
])
def test_loose_values_are_checked_against_the_same_ranges(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ToMeConfig.from_dict(values)


def test_a_mistyped_setting_is_a_value_error_naming_it_and_the_close_name(unet):
    x, t, c = ldm_inputs()
    before, ref = snapshot(unet), run(unet, x, t, c)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['ratoi'\] \(did you mean "
                                         r"'ratio'\?\)"):
        tome.apply_patch(unet, ratoi=0.5)
    with pytest.raises(ValueError, match=r"\['confg'\] \(did you mean 'config'\?\)"):
        tome.apply_patch(unet, confg=preset("fast"))
    with pytest.raises(ValueError, match=r"\['downsample_facter'\] \(did you mean "
                                         r"'downsample_factor'\?\)"):
        tome.apply_patch(unet, config=preset("fast"), downsample_facter=4)
    with pytest.raises(ValueError, match="config=.*must be a ToMeConfig"):
        tome.apply_patch(unet, config={"ratio": 0.5})
    with pytest.raises(ValueError, match="measure=0: must be True, False or a measuring"):
        tome.apply_patch(unet, policy="auto", measure=0)  # 0 is not False: it would measure
    assert not tome.is_patched(unet) and snapshot(unet) == before
    assert torch.equal(run(unet, x, t, c), ref)
    with pytest.raises(ValueError, match=r"\['ratoi'\] \(did you mean 'ratio'\?\)"):
        ToMeConfig.from_dict({"ratoi": 0.5})
    with pytest.raises(ValueError, match=r"\['ratoi'\] \(did you mean 'ratio'\?\)"):
        ToMeConfig().replace(ratoi=0.5)
    with pytest.raises(ValueError, match=r"\['ratoi'\] \(did you mean 'ratio'\?\)"):
        preset("fast", ratoi=0.5)
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['zzz'\]; known: "):
        ToMeConfig.from_dict({"zzz": 1})


def test_tomesd_arguments_beside_a_config_are_applied_or_refused_never_ignored(unet):
    x, t, c = ldm_inputs()
    before, ref = snapshot(unet), run(unet, x, t, c)
    with pytest.raises(ValueError, match=r"sx=1000000: must be a positive integer in \[1, 8\]"):
        tome.apply_patch(unet, sx=10**6, config=ToMeConfig())
    with pytest.raises(ValueError, match=r"ratio=0.9: must be in \[0, 0.75\]"):
        tome.apply_patch(unet, 0.9, config=ToMeConfig())
    assert not tome.is_patched(unet) and snapshot(unet) == before
    assert torch.equal(run(unet, x, t, c), ref)
    tome.apply_patch(unet, 0.3, max_downsample=2, config=ToMeConfig(seed=4), use_rand=False)
    try:
        assert tome.patch_report(unet).config == ToMeConfig(ratio=0.3, max_downsample=2, seed=4,
                                                            use_rand=False)
    finally:
        tome.remove_patch(unet)
    tome.apply_patch(unet, config=ToMeConfig(ratio=0.2, sx=4))  # defaults beside it: its own
    try:
        assert tome.patch_report(unet).config == ToMeConfig(ratio=0.2, sx=4)
    finally:
        tome.remove_patch(unet)


def test_a_bad_value_leaves_a_previous_patch_as_it_was(unet):
    x, t, c = ldm_inputs()
    tome.apply_patch(unet, ratio=0.5)
    try:
        patched, hooks = run(unet, x, t, c), snapshot(unet)
        for bad in ({"sx": 10**6}, {"downsample_factor": 2**40}, {"reuse": 10**30},
                    {"ratoi": 0.5}):
            with pytest.raises(ValueError):
                tome.apply_patch(unet, **bad)
            assert snapshot(unet) == hooks and torch.equal(run(unet, x, t, c), patched)
    finally:
        tome.remove_patch(unet)


def test_a_schedule_has_at_most_max_items():
    longest = ",".join(["all:2"] * dit.MAX_ITEMS)
    assert len(ToMeConfig(schedule=longest).schedule.split(",")) == dit.MAX_ITEMS == 64
    with pytest.raises(ValueError, match=r"invalid schedule='all:2,.*\(600001 characters\): "
                                         r"100000 items: at most 64"):
        ToMeConfig(schedule=",".join(["all:2"] * 100_000))
    with pytest.raises(ValueError, match="65 items: at most 64"):
        ToMeConfig.from_dict({"schedule": longest + ",all:4"})


@pytest.mark.parametrize("text, block, want", [
    ("all:2", 1, (2,)),                              # one factor all along: nothing to switch
    ("all:2@0.3-1", 1, (0, 2)),                      # unpooled before the window
    ("all:2@0-1,inner:4@0.6-1", 0, (2,)),            # the first block is not inner
    ("all:2@0-1,inner:4@0.6-1", 1, (2, 4)),
    ("all:2@0.3-0.5,all:4@0.5-0.7", 2, (0, 2, 4)),   # a gap after: unpooled again
    ("single:2", 0, (0,)),                           # block 0 of kind double: never named
])
def test_a_schedule_lists_every_factor_a_block_takes_over_sampling(text, block, want):
    """What a compiled block switches between (``wrappers.switch``): each factor a block gets
    at some progress, read at every window edge and between edges."""
    s = dit.Schedule.parse(text)
    assert s.factors(block, "double", 4) == want
    assert set(want) == {s.factor(block, "double", 4, p / 100) for p in range(101)}


def test_a_schedule_is_parsed_once_not_per_patch_or_call(monkeypatch):
    """A config parses its schedule when it is built; patching and the model's calls reuse
    that parse (a schedule's items are read per block and call, never parsed there)."""
    diffusers = pytest.importorskip("diffusers")
    from models import randomised
    flux = randomised(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=24, axes_dims_rope=(4, 6, 6)))
    config = ToMeConfig(method="downsample", schedule="0-1:4@0-0.5,all:2@0.2-1", reuse=2)
    parsed = []
    real = dit.Schedule.__init__

    def built(self, items, text):
        parsed.append(text)
        real(self, items, text)
    monkeypatch.setattr(dit.Schedule, "__init__", built)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.zeros(48), torch.arange(6).repeat_interleave(8).float(),
                       torch.arange(8).repeat(6).float()], 1)
    call = dict(hidden_states=torch.randn(1, 48, 16, generator=g),
                encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
                pooled_projections=torch.randn(1, 24, generator=g), img_ids=ids,
                txt_ids=torch.zeros(5, 3))
    tome.apply_patch(flux, config=config)
    try:
        with torch.no_grad():
            for t in (0.9, 0.6, 0.3):
                flux(**call, timestep=torch.full((1,), t))
        assert tome.patch_report(flux).patched_blocks == 4
    finally:
        tome.remove_patch(flux)
    assert parsed == []


def test_the_dit_presets_rotate_keys_before_pooling():
    """The presets' DiT points pool rotated keys (``rope="before"``): what ComfyUI's path
    applies anyway (its keys arrive rotated), so a preset as named is the same image on every
    path (docs/quality.md, the presets through ComfyUI's path)."""
    for name in ("quality", "fast"):
        assert preset(name).rope == "before"
        assert preset(name, rope="pooled").rope == "pooled"  # the user's change stands


def test_without_reuse_maps_a_preset_with_the_users_rope_to_its_point_without_reuse():
    """A preset's DiT point is known by its schedule and reuse: a user who set the rope
    themselves still gets that preset's point without reuse where reuse cannot run, with
    their rope (and whatever else they set); the preset as named keeps its own rope there."""
    from tome.config import without_reuse
    flux = ["double", "double", "single", "single"]
    for name, point in (("quality", "single:2@0.3-1"), ("fast", "all:2@0.3-1")):
        for changes in ({}, {"rope": "pooled"}, {"rope": "pooled", "proportional": False}):
            config = preset(name, **changes)
            off = without_reuse(config, flux)
            assert (off.schedule, off.reuse) == (point, 0)
            assert off == config.replace(schedule=point, reuse=0)  # nothing else changes
        assert without_reuse(preset(name, rope="pooled")).rope == "pooled"
        assert without_reuse(preset(name)).rope == "before"
    # The quality preset's second point where a model has no single-stream block, rope kept.
    assert without_reuse(preset("quality", rope="pooled"), ["double"] * 2) == \
        preset("quality", rope="pooled").replace(schedule="all:2@0.5-1", reuse=0)
    # A schedule and reuse that are no preset's point keep their schedule, without reuse.
    other = ToMeConfig(method="downsample", schedule="all:8", reuse=7, rope="pooled")
    assert without_reuse(other, flux) == other.replace(reuse=0)
