"""The example workflows in ``example_workflows/`` (ComfyUI lists a node pack's
``example_workflows/*.json`` in its template browser): each is a graph in ComfyUI's UI workflow
format whose nodes, inputs, widget values and links fit the ToMe node's ``INPUT_TYPES`` and
ComfyUI's core nodes as its public source declares them (0.8.0 and v0.30.0 agree on these).
The real ComfyUI accepting them (``/prompt``) is recorded in docs/comfyui.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

STUB = str(Path(__file__).resolve().parent / "comfy_stub")
if STUB not in sys.path:
    sys.path.insert(0, STUB)

from tome.comfy import inputs, nodes  # noqa: E402
from tome.config import preset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "example_workflows"
EXPECTED = {"sd15_tome.json", "sdxl_hires_tome.json", "flux_dev_tome.json",
            "wan21_t2v_tome.json", "qwen_image_tome.json", "z_image_turbo_tome.json"}
DITS = ("flux", "wan", "qwen", "z_image")

# a few of KSampler's choices
SAMPLERS = ("euler", "euler_ancestral", "dpmpp_2m", "uni_pc", "res_multistep")
SCHEDULERS = ("normal", "karras", "simple", "sgm_uniform", "beta")
# ComfyUI's core nodes the workflows use, from its public source (nodes.py, comfy_extras/):
# (linked inputs with their types, widget inputs in order with the choices checked here or
# None, output types). "seed+" is an INT with ComfyUI's control_after_generate widget (one more
# widget value, e.g. "fixed").
CORE = {
    "CheckpointLoaderSimple": ({}, [("ckpt_name", None)], ["MODEL", "CLIP", "VAE"]),
    "CLIPTextEncode": ({"clip": "CLIP"}, [("text", None)], ["CONDITIONING"]),
    "EmptyLatentImage": ({}, [("width", None), ("height", None), ("batch_size", None)],
                         ["LATENT"]),
    "KSampler": ({"model": "MODEL", "positive": "CONDITIONING", "negative": "CONDITIONING",
                  "latent_image": "LATENT"},
                 [("seed+", None), ("steps", None), ("cfg", None), ("sampler_name", SAMPLERS),
                  ("scheduler", SCHEDULERS), ("denoise", None)], ["LATENT"]),
    "VAEDecode": ({"samples": "LATENT", "vae": "VAE"}, [], ["IMAGE"]),
    "SaveImage": ({"images": "IMAGE"}, [("filename_prefix", None)], []),
    "LatentUpscaleBy": ({"samples": "LATENT"},
                        [("upscale_method", ("nearest-exact", "bilinear", "area", "bicubic",
                                             "bislerp")), ("scale_by", None)], ["LATENT"]),
    "UNETLoader": ({}, [("unet_name", None),
                        ("weight_dtype", ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast",
                                          "fp8_e5m2"))], ["MODEL"]),
    "DualCLIPLoader": ({}, [("clip_name1", None), ("clip_name2", None), ("type", ("flux",)),
                            ("device", ("default", "cpu"))], ["CLIP"]),
    "CLIPLoader": ({}, [("clip_name", None), ("type", ("wan", "qwen_image", "lumina2")),
                        ("device", ("default", "cpu"))], ["CLIP"]),
    "VAELoader": ({}, [("vae_name", None)], ["VAE"]),
    "FluxGuidance": ({"conditioning": "CONDITIONING"}, [("guidance", None)], ["CONDITIONING"]),
    "ConditioningZeroOut": ({"conditioning": "CONDITIONING"}, [], ["CONDITIONING"]),
    "EmptySD3LatentImage": ({}, [("width", None), ("height", None), ("batch_size", None)],
                            ["LATENT"]),
    "ModelSamplingSD3": ({"model": "MODEL"}, [("shift", None)], ["MODEL"]),
    "ModelSamplingAuraFlow": ({"model": "MODEL"}, [("shift", None)], ["MODEL"]),
    "EmptyHunyuanLatentVideo": ({}, [("width", None), ("height", None), ("length", None),
                                     ("batch_size", None)], ["LATENT"]),
    "SaveAnimatedWEBP": ({"images": "IMAGE"},
                         [("filename_prefix", None), ("fps", None), ("lossless", None),
                          ("quality", None), ("method", ("default", "fastest", "slowest"))], []),
}


def ours(cls_name: str):
    """The pack's node's (linked inputs, widget inputs, outputs) from its ``INPUT_TYPES``."""
    cls = nodes.NODE_CLASS_MAPPINGS[cls_name]
    links, widgets = {}, []
    for part in cls.INPUT_TYPES().values():
        for name, (kind, opts) in part.items():
            if isinstance(kind, list):
                widgets.append((name, tuple(kind)))
            elif kind in ("INT", "FLOAT", "STRING", "BOOLEAN"):
                plus = "+" if opts.get("control_after_generate") else ""
                widgets.append((name + plus, None))
            else:
                links[name] = kind
    return links, widgets, list(cls.RETURN_TYPES)


def declared(cls_name: str):
    return ours(cls_name) if cls_name in nodes.NODE_CLASS_MAPPINGS else CORE[cls_name]


def to_api(workflow: dict) -> dict:
    """The workflow in ComfyUI's API format (what the frontend posts to ``/prompt``): each
    node's widget values by name, each linked input as ``[source id, output slot]``."""
    links = {link[0]: link for link in workflow["links"]}
    graph = {}
    for node in workflow["nodes"]:
        _, widgets, _ = declared(node["type"])
        values, api = list(node["widgets_values"]), {}
        for name, _ in widgets:
            api[name.rstrip("+")] = values.pop(0)
            if name.endswith("+"):
                values.pop(0)  # control_after_generate: the frontend's, not an input
        assert not values, (node["type"], values)
        for slot in node["inputs"]:
            if slot["link"] is not None:
                _, src, out, _, _, _ = links[slot["link"]]
                api[slot["name"]] = [str(src), out]
        graph[str(node["id"])] = {"class_type": node["type"], "inputs": api}
    return graph


def workflows():
    return sorted(FOLDER.glob("*.json"))


def test_the_folder_ships_the_examples_where_comfyui_finds_them():
    # ComfyUI globs custom_nodes/*/example_workflows/*.json (app/custom_node_manager.py)
    assert {p.name for p in workflows()} == EXPECTED
    assert not (ROOT / "docs" / "comfyui-workflow.json").exists()  # replaced by these


@pytest.mark.parametrize("path", workflows(), ids=lambda p: p.stem)
def test_each_workflow_fits_the_nodes_it_names(path):
    wf = json.loads(path.read_text())
    assert wf["version"] == 0.4 and wf["last_node_id"] == max(n["id"] for n in wf["nodes"])
    assert wf["last_link_id"] == max(link[0] for link in wf["links"])
    by_id = {n["id"]: n for n in wf["nodes"]}
    assert len(by_id) == len(wf["nodes"])
    for node in wf["nodes"]:
        links, widgets, outputs = declared(node["type"])
        assert [s["name"] for s in node["inputs"]] == list(links), node["type"]
        assert [s["type"] for s in node["inputs"]] == list(links.values())
        assert all(s["link"] is not None for s in node["inputs"]), node["type"]  # required
        assert [s["type"] for s in node["outputs"]] == outputs
        count = len(widgets) + sum(name.endswith("+") for name, _ in widgets)
        assert len(node["widgets_values"]) == count, node["type"]
    for lid, src, slot, dst, dst_slot, kind in wf["links"]:
        assert lid in by_id[src]["outputs"][slot]["links"]
        assert by_id[dst]["inputs"][dst_slot]["link"] == lid
        assert by_id[src]["outputs"][slot]["type"] == kind == by_id[dst]["inputs"][dst_slot]["type"]
    for node in to_api(wf).values():
        _, widgets, _ = declared(node["class_type"])
        for name, options in widgets:
            if options is not None:
                assert node["inputs"][name] in options, (node["class_type"], name)


@pytest.mark.parametrize("path", workflows(), ids=lambda p: p.stem)
def test_the_tome_node_shows_what_runs(path):
    graph = to_api(json.loads(path.read_text()))
    (tome,) = [n for n in graph.values() if n["class_type"] == "ToMeTokenMerging"]
    spec = inputs.input_types()
    names = {name for part in spec.values() for name in part}
    assert set(tome["inputs"]) == names  # every input, as the frontend posts them
    for part in spec.values():
        for name, (kind, opts) in part.items():
            value = tome["inputs"][name]
            if "min" in opts:
                assert opts["min"] <= value <= opts["max"], name
            if isinstance(kind, list):
                assert value in kind, name
    values = {k: v for k, v in tome["inputs"].items() if k != "model"}
    model_from = graph[tome["inputs"]["model"][0]]["class_type"]
    if path.stem.startswith(DITS):
        # a DiT graph names the preset that runs there and shows its values (web/tome.js fills
        # them in when the preset is chosen): recommended would show the UNet defaults (merge)
        assert values["preset"] == "quality"
        assert inputs.config(values, "dit") == preset("quality")
        assert inputs.config({**values, "preset": inputs.CUSTOM}, "dit") == preset("quality")
        before = ("UNETLoader" if path.stem.startswith("flux") else "ModelSamplingSD3"
                  if path.stem.startswith("wan") else "ModelSamplingAuraFlow")
        assert model_from == before
    else:
        # on a UNet, recommended is balanced, whose values are the node's defaults: shown as run
        assert values["preset"] == inputs.RECOMMENDED
        assert inputs.config(values) == preset("balanced")
        assert inputs.config({**values, "preset": inputs.CUSTOM}) == preset("balanced")
        assert model_from == "CheckpointLoaderSimple"


# The node's size as ComfyUI's frontend computes it (LiteGraph's ``LGraphNode.computeSize``,
# the same in frontend 1.35.9 of ComfyUI 0.8.0 and 1.48.7 of v0.30.0): the title bar
# (NODE_TITLE_HEIGHT 30) is drawn above ``pos``; the body is one NODE_SLOT_HEIGHT (20) per row
# of linked inputs or outputs (whichever are more; widget inputs have no row), then each
# visible widget's height (NODE_WIDGET_HEIGHT 20) plus 4, plus 8 after the widgets, plus 6. A
# node saved smaller is drawn at that size, so the boxes below take the larger of the two.
TITLE, SLOT, WIDGET = 30, 20, 20


def body_height(rows: int, widgets: int) -> int:
    return max(rows, 1) * SLOT + (widgets * (WIDGET + 4) + 8 if widgets else 0) + 6


def folded_widgets() -> int:
    """The ToMe node's widgets in the default canvas: the preset and ``FRONT`` (web/tome.js
    folds the rest) and the extension's show-advanced button."""
    return 1 + len(inputs.FRONT) + 1


def boxes(workflow: dict) -> dict[int, tuple[float, float, float, float]]:
    out = {}
    for node in workflow["nodes"]:
        links, widgets, outputs = declared(node["type"])
        if node["type"] == "ToMeTokenMerging":
            shown = folded_widgets()
        else:
            shown = len(widgets) + sum(name.endswith("+") for name, _ in widgets)
        height = max(node["size"][1], body_height(max(len(links), len(outputs)), shown))
        x, y = node["pos"]
        out[node["id"]] = (x, y - TITLE, x + node["size"][0], y + height)
    return out


def test_the_folded_node_is_the_size_the_frontend_computes():
    # preset, method, ratio, downsample_factor, policy and the button: 20 + 6 * 24 + 8 + 6
    assert folded_widgets() == 6 and body_height(1, folded_widgets()) == 178
    # every input drawn (21 widgets, before the extension): 568 px with the title, as issue 54
    # measured in the real v0.30.0 frontend; 23 since ``paced`` and ``temporal``: a widget
    # (20 + 4) more each
    every = [name for part in inputs.input_types().values() for name in part if name != "model"]
    assert TITLE + body_height(1, len(every)) == 568 + 2 * 24


@pytest.mark.parametrize("path", workflows(), ids=lambda p: p.stem)
def test_each_workflow_opens_without_overlapping_nodes(path):
    wf = json.loads(path.read_text())
    (tome,) = [n for n in wf["nodes"] if n["type"] == "ToMeTokenMerging"]
    # saved at the folded size: neither cut (LiteGraph would grow it) nor padded
    assert tome["size"][1] == body_height(1, folded_widgets())
    assert "showAdvanced" not in tome  # folded on first open
    placed = sorted(boxes(wf).items())
    for i, (a, (ax0, ay0, ax1, ay1)) in enumerate(placed):
        for b, (bx0, by0, bx1, by1) in placed[i + 1:]:
            apart = ax1 <= bx0 or bx1 <= ax0 or ay1 <= by0 or by1 <= ay0
            assert apart, (path.name, a, b)


def test_the_sdxl_workflow_merges_only_in_the_hires_pass():
    graph = to_api(json.loads((FOLDER / "sdxl_hires_tome.json").read_text()))
    samplers = {i: n for i, n in graph.items() if n["class_type"] == "KSampler"}
    first = [n for n in samplers.values() if n["inputs"]["denoise"] == 1.0]
    hires = [n for n in samplers.values() if n["inputs"]["denoise"] < 1.0]
    assert len(first) == len(hires) == 1
    assert graph[first[0]["inputs"]["model"][0]]["class_type"] == "CheckpointLoaderSimple"
    assert graph[hires[0]["inputs"]["model"][0]]["class_type"] == "ToMeTokenMerging"
    upscale = graph[hires[0]["inputs"]["latent_image"][0]]
    assert upscale["class_type"] == "LatentUpscaleBy" and upscale["inputs"]["scale_by"] > 1
