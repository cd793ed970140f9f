"""The node pack in ComfyUI's V3 schema (``tome/comfy/v3.py``, ``comfy_entrypoint``) against the
stand-ins of ``comfy_api.latest`` and of ComfyUI's pack loader (``tests/comfy_stub/``): the
same node ids, inputs and outputs as the classic declaration, so saved graphs and the example
workflows keep their meaning; the classic mappings where the host has no V3 schema."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from comfy.model_patcher import ModelPatcher  # noqa: E402
from comfy.model_sampling import ModelSamplingDiscrete  # noqa: E402
from comfy.sampling import comfy_blocks, unet_call  # noqa: E402
from comfy_api.latest import ComfyExtension, io  # noqa: E402
from comfy_node import defaults  # noqa: E402
from models import TINY_SD15, ldm_inputs, ldm_unet  # noqa: E402
from test_example_workflows import FOLDER  # noqa: E402

from tome.comfy import entry_points, nodes, v3  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def v3_nodes() -> dict[str, type]:
    listed = asyncio.run(v3.extension(io, ComfyExtension).get_node_list())
    return {cls.GET_SCHEMA().node_id: cls for cls in listed}


def test_the_v3_nodes_declare_what_the_classic_nodes_do():
    found = v3_nodes()
    assert list(found) == list(nodes.NODE_CLASS_MAPPINGS)
    for node_id, classic in nodes.NODE_CLASS_MAPPINGS.items():
        schema = found[node_id].GET_SCHEMA()
        assert schema.display_name == nodes.NODE_DISPLAY_NAME_MAPPINGS[node_id]
        assert (schema.category, schema.description) == (classic.CATEGORY, classic.DESCRIPTION)
        assert schema.is_output_node == getattr(classic, "OUTPUT_NODE", False)
        assert [o.io_type for o in schema.outputs] == list(classic.RETURN_TYPES)
        names = getattr(classic, "RETURN_NAMES", None)
        if names:
            assert [o.display_name for o in schema.outputs] == list(names)
        old, new = classic.INPUT_TYPES(), found[node_id].INPUT_TYPES()
        assert list(new) == list(old)
        for part in old:  # names in the same order: a saved graph's widget values by position
            assert list(new[part]) == list(old[part])
            for name, (kind, options) in old[part].items():
                new_kind, new_options = new[part][name]
                if isinstance(kind, list):  # a combo: ComfyUI serves V3's as ("COMBO", options)
                    assert (new_kind, new_options["options"]) == ("COMBO", kind)
                else:
                    assert new_kind == kind
                for key, value in options.items():  # default, range, tooltip, advanced, ...
                    assert new_options[key] == value, (node_id, name, key)


def test_an_option_the_input_class_does_not_take_goes_into_extra_dict():
    """0.8.0's V3 inputs take no ``advanced`` keyword (v0.30.0's do): the option reaches the
    frontend either way."""
    class OldInt(io.Int.Input):  # 0.8.0's keywords
        def __init__(self, id, display_name=None, optional=False, tooltip=None, lazy=None,
                     default=None, min=None, max=None, step=None,
                     control_after_generate=None, extra_dict=None):
            super().__init__(id, display_name, optional, tooltip, lazy, default, min, max, step,
                             control_after_generate, extra_dict)

    spec = ("INT", {"default": 0, "min": 0, "max": 9, "advanced": True, "tooltip": "t"})
    old = v3.v3_input(SimpleNamespace(Int=SimpleNamespace(Input=OldInt)), "seed", spec, True)
    new = v3.v3_input(io, "seed", spec, True)
    assert old.extra_dict == {"advanced": True} and new.advanced and not new.extra_dict
    assert old.as_dict() == new.as_dict()


def model() -> ModelPatcher:
    m = torch.nn.Module()
    m.diffusion_model = comfy_blocks(ldm_unet(TINY_SD15))
    m.model_sampling = ModelSamplingDiscrete()
    return ModelPatcher(m)


def test_running_the_v3_node_runs_the_classic_node():
    torch.manual_seed(0)
    base = model()
    x, t, ctx = ldm_inputs(2, 32, 32)
    values = defaults(preset="balanced")
    out = v3_nodes()["ToMeTokenMerging"].execute(model=base, **values)
    (classic,) = nodes.ToMePatch().patch(base, **values)
    assert len(out.args) == 1 and out.args[0] is not base
    merged, reference = (unet_call(p, x, t, ctx, 14.6146) for p in (out.args[0], classic))
    assert torch.equal(merged, reference)
    assert not torch.equal(merged, unet_call(base, x, t, ctx, 14.6146))


def test_the_v3_measure_node_keeps_its_table_plot_and_rerun(monkeypatch):
    seen = {}

    def measure(self, model, sizes, remeasure=False):
        seen.update(model=model, sizes=sizes, remeasure=remeasure)
        return {"ui": {"text": ["table"]}, "result": ("table", "plot")}

    monkeypatch.setattr(nodes.ToMeMeasure, "measure", measure)
    node = v3_nodes()["ToMeMeasure"]
    out = node.execute(model="m", sizes="512", remeasure=True)
    assert out.args == ("table", "plot") and out.ui == {"text": ["table"]}
    assert seen == {"model": "m", "sizes": "512", "remeasure": True}
    again = node.fingerprint_inputs(model="m", sizes="512", remeasure=True)
    assert again != again  # NaN: re-measured every time it is queued
    assert node.fingerprint_inputs(model="m", sizes="512", remeasure=False) is False


def test_the_example_workflows_fill_the_v3_node_as_the_classic_one():
    """The frontend fills a node's widgets from a saved graph by position, in the order
    ``/object_info`` lists the inputs: the V3 node's order and defaults are the classic one's."""
    spec = v3_nodes()["ToMeTokenMerging"].INPUT_TYPES()
    widgets = [name for part in spec.values() for name, (kind, _) in part.items()
               if kind != "MODEL"]
    classic = [name for part in nodes.ToMePatch.INPUT_TYPES().values() for name in part
               if name != "model"]
    assert widgets == classic
    for path in sorted(FOLDER.glob("*.json")):
        for node in json.loads(path.read_text())["nodes"]:
            if node["type"] == "ToMeTokenMerging":
                assert len(node["widgets_values"]) == len(widgets), path.name


def _load(version: str, v3_schema: bool) -> list[str]:
    """The pack loaded by the stand-in loader of ``version`` in a fresh Python: the node ids
    it registered, each with whether its class is a V3 node, and the display names."""
    code = ("import sys\n"
            + ("" if v3_schema else "sys.modules['comfy_api.latest'] = None\n")
            + "import nodes\n"
            f"assert nodes.load_custom_node({str(ROOT)!r}, {version!r})\n"
            + ("from comfy_api.latest import io\n" if v3_schema else "io = None\n"))
    code += ("for k, c in sorted(nodes.NODE_CLASS_MAPPINGS.items()):\n"
             "    print(k, bool(io) and issubclass(c, io.ComfyNode),"
             " nodes.NODE_DISPLAY_NAME_MAPPINGS[k])\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT.parent,
                          env={**os.environ, "PYTHONPATH": STUB}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@pytest.mark.parametrize("version", ["0.8.0", "0.30.0"])
def test_a_comfyui_with_the_v3_schema_loads_the_v3_nodes(version):
    """Both loaders take NODE_CLASS_MAPPINGS whenever the module defines it: the pack defines
    only comfy_entrypoint there, or the V3 nodes would never load."""
    assert _load(version, True) == ["ToMeMeasure True ToMe Measure",
                                    "ToMeTokenMerging True ToMe (Token Merging)"]


def test_a_comfyui_without_the_v3_schema_loads_the_classic_nodes():
    assert _load("0.8.0", False) == ["ToMeMeasure False ToMe Measure",
                                     "ToMeTokenMerging False ToMe (Token Merging)"]


def test_the_pack_defines_one_entry_point(monkeypatch):
    from tome.comfy import host
    assert set(entry_points()) == {"comfy_entrypoint"}
    monkeypatch.setattr(host, "node_api", lambda: None)
    assert set(entry_points()) == {"NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"}
