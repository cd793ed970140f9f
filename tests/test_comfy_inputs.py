"""The ToMe node's inputs as a newcomer meets them (``tome/comfy/inputs.py``): the preset and the
four inputs most users touch in front, every other input marked advanced, saved graphs kept
(the inputs' order), a default preset that suits the model kind, resolved when the node runs,
and inputs that mean what they show: one set away from its default applies over the preset, the
policy is always the input's (against ``tests/comfy_stub``, ComfyUI 0.8.0's contract)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from comfy.model_base import BaseModel  # noqa: E402
from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingDiscrete, ModelSamplingFlux  # noqa: E402
from comfy.sampling import comfy_blocks  # noqa: E402
from models import TINY_SD15, ldm_unet  # noqa: E402

from tome.comfy import inputs, nodes  # noqa: E402
from tome.config import ToMeConfig, preset, without_reuse  # noqa: E402

# The node's inputs in the order of every release so far: a saved UI workflow keeps its widget
# values by position, so this order may only grow at its end.
ORDER = ["model", "preset", "method", "ratio", "downsample_factor", "max_downsample", "sx", "sy",
         "use_rand", "seed", "start", "end", "policy", "merge_crossattn", "merge_mlp",
         "matching", "share", "rope", "blocks", "proportional", "schedule", "reuse", "paced",
         "temporal"]


def unet():
    m = torch.nn.Module()
    m.diffusion_model = comfy_blocks(ldm_unet(TINY_SD15))
    m.model_sampling = ModelSamplingDiscrete()
    return ModelPatcher(m)


def flux():
    from comfy.ldm.flux.model import Flux
    torch.manual_seed(0)
    return ModelPatcher(BaseModel(Flux().eval(), ModelSamplingFlux(shift=1.15)))


def fresh(**changes):
    """The values of a node just added in the graph editor (every default), with ``changes``."""
    values = {name: opts.get("default") for part in inputs.input_types().values()
              for name, (_, opts) in part.items() if name != "model"}
    return {**values, **changes}


@pytest.fixture
def applied(monkeypatch):
    """The config each node run hands the patch (the run itself goes on)."""
    seen = []
    real = nodes.apply

    def spy(model, config, say=None):
        seen.append(config)
        return real(model, config, say)
    monkeypatch.setattr(nodes, "apply", spy)
    return seen


def test_at_most_five_inputs_besides_the_model_are_in_front():
    spec = inputs.input_types()
    front = [name for part in spec.values() for name, (_, opts) in part.items()
             if not opts.get("advanced")]
    assert front == ["model", "preset", "method", "ratio", "downsample_factor", "policy"]
    advanced = [name for part in spec.values() for name, (_, opts) in part.items()
                if opts.get("advanced")]
    assert advanced and all(spec["required"].get(n, spec["optional"].get(n))[1]["advanced"]
                            is True for n in advanced)
    assert len(front) + len(advanced) == len(ORDER)


def test_the_order_of_the_inputs_is_kept_for_saved_graphs():
    spec = inputs.input_types()
    assert [name for part in (spec["required"], spec["optional"]) for name in part] == ORDER


def test_a_fresh_node_uses_balanced_on_a_unet_and_says_so(lines, applied):
    (out,) = nodes.ToMePatch().patch(unet(), **fresh(seed=3))
    assert out is not None and applied == [preset("balanced", seed=3)]
    assert applied[0].policy == "auto"
    assert lines[0] == ("ToMe: preset recommended is balanced on this UNet (preset custom uses "
                        "the node's inputs)")


def test_a_fresh_node_pools_a_dit_with_the_quality_preset(lines, applied):
    base = flux()
    (out,) = nodes.ToMePatch().patch(base, **fresh())
    assert applied == [preset("quality")] and applied[0].method == "downsample"
    assert out is not base  # pooled: the old default (merge) passed a DiT through unchanged
    assert lines[0].startswith("ToMe: preset recommended is quality on this DiT")
    # ComfyUI's DiT form has no residual reuse: the preset's point without it applies
    assert without_reuse(applied[0]).reuse == 0


def test_a_fresh_node_pools_a_video_dit_with_quality_in_cells_of_two_frames(lines, applied):
    # issue 50: on a video DiT recommended is quality's reuse at x2 in cells of 2 frames (the
    # video frontier); an image DiT keeps quality as it was, a named preset stays as it is
    from comfy.ldm.wan.model import WanModel
    torch.manual_seed(0)
    wan = ModelPatcher(BaseModel(WanModel().eval(), ModelSamplingFlux(shift=8.0)))
    assert (nodes.model_kind(wan), nodes.model_kind(flux()), nodes.model_kind(unet())) == \
        ("video", "dit", "unet")
    nodes.ToMePatch().patch(wan, **fresh())
    nodes.ToMePatch().patch(wan, **fresh(preset="quality"))
    got = applied[0]
    assert (got.schedule, got.temporal, got.reuse, got.paced, got.rope, got.method) == \
        ("all:2", 2, 5, True, "before", "downsample")
    assert applied[1] == preset("quality") and applied[1].temporal == 1
    assert lines[0].startswith("ToMe: preset recommended is quality with schedule all:2, "
                               "temporal 2 on this video DiT")
    # an input set on the node applies over it; custom is the inputs as set
    assert inputs.config(fresh(temporal=4), "video").temporal == 4
    assert inputs.config(fresh(preset="custom"), "video").temporal == 1


def test_presets_at_their_defaults_and_custom_are_as_before(applied):
    # a saved graph left at the defaults under a preset (every example, every node only given
    # a preset) runs the preset, as before; custom runs the inputs as set
    nodes.ToMePatch().patch(unet(), **fresh(preset="fast", seed=7))
    nodes.ToMePatch().patch(unet(), **fresh(preset="custom", ratio=0.25))
    assert applied[0] == preset("fast", seed=7)
    assert (applied[1].method, applied[1].ratio, applied[1].policy) == ("merge", 0.25, "auto")
    with pytest.raises(ValueError, match="ToMe: unknown preset 'turbo'"):
        inputs.config(fresh(preset="turbo"))


def test_a_front_input_changed_under_the_default_preset_applies(lines, applied):
    # issue 52: under recommended, ratio/method/policy set on the canvas used to change nothing
    nodes.ToMePatch().patch(unet(), **fresh(ratio=0.3))
    nodes.ToMePatch().patch(unet(), **fresh(method="downsample", downsample_factor=3))
    assert applied[0] == ToMeConfig(method="merge", ratio=0.3, policy="auto")
    assert applied[1] == ToMeConfig(method="downsample", downsample_factor=3, ratio=0.5,
                                    policy="auto")
    assert lines[0] == "ToMe: preset recommended is balanced on this UNet; set on the node, " \
                       "over it: ratio 0.3"
    # an input set to the preset's own value is no change: the line names only real ones
    assert inputs.preset_line(fresh(preset="quality", method="downsample")) is None
    assert inputs.preset_line(fresh(preset="fast", ratio=0.1)) == \
        "ToMe: preset fast; set on the node, over it: ratio 0.1"


def test_the_policy_is_the_inputs_under_every_preset():
    for name in (inputs.RECOMMENDED, *inputs.PRESETS):
        assert inputs.config(fresh(preset=name, policy="fixed")).policy == "fixed"
        assert inputs.config(fresh(preset=name, policy="fixed"), "dit").policy == "fixed"
    assert inputs.config(fresh(preset="fast")).policy == "auto"


def test_a_dit_input_changed_under_the_default_preset_applies():
    # on a DiT, recommended is quality (x8 everywhere, reuse every 5): a schedule set on the
    # node replaces its schedule, the rest of the preset stays
    got = inputs.config(fresh(schedule="double:4"), "dit")
    assert (got.method, got.schedule, got.reuse, got.rope) == \
        ("downsample", "double:4", 5, "before")


def test_a_dit_factor_under_a_schedule_says_the_schedule_sets_it():
    filled = fresh(**{**inputs.PRESETS["quality"], "downsample_factor": 4})
    assert inputs.preset_line(filled, "dit") == (
        "ToMe: preset recommended is quality on this DiT; set on the node, over it: "
        "downsample_factor 4 (on this DiT the preset's schedule all:8 sets the factors; preset "
        "custom with an empty schedule uses downsample_factor)")
    custom = inputs.config({**filled, "preset": "custom", "schedule": ""}, "dit")
    assert (custom.schedule, custom.downsample_factor) == ("", 4)


def test_the_values_a_preset_fills_in_are_the_preset():
    # what the frontend extension writes into the widgets when a preset is chosen (web/tome.js)
    for name, values in inputs.PRESETS.items():
        filled = fresh(preset=name, **values)
        assert inputs.config(filled) == preset(name)
        assert inputs.preset_line(filled) is None


def test_an_unreadable_model_passes_through_with_the_one_message(lines):
    m = torch.nn.Module()
    m.diffusion_model = torch.nn.Linear(2, 2)
    m.model_sampling = ModelSamplingDiscrete()
    base = ModelPatcher(m)
    (out,) = nodes.ToMePatch().patch(base, **fresh())
    assert out is base and "the model passes through unchanged" in lines[-1]
