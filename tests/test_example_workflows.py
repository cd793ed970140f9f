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
from tome.config import ToMeConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FOLDER = ROOT / "example_workflows"
EXPECTED = {"sd15_tome.json", "sdxl_hires_tome.json", "flux_dev_tome.json",
            "wan21_t2v_tome.json"}

SAMPLERS = ("euler", "euler_ancestral", "dpmpp_2m", "uni_pc")  # a few of KSampler's choices
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
    "CLIPLoader": ({}, [("clip_name", None), ("type", ("wan",)),
                        ("device", ("default", "cpu"))], ["CLIP"]),
    "VAELoader": ({}, [("vae_name", None)], ["VAE"]),
    "FluxGuidance": ({"conditioning": "CONDITIONING"}, [("guidance", None)], ["CONDITIONING"]),
    "ConditioningZeroOut": ({"conditioning": "CONDITIONING"}, [], ["CONDITIONING"]),
    "EmptySD3LatentImage": ({}, [("width", None), ("height", None), ("batch_size", None)],
                            ["LATENT"]),
    "ModelSamplingSD3": ({"model": "MODEL"}, [("shift", None)], ["MODEL"]),
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


def test_the_folder_ships_the_four_examples_where_comfyui_finds_them():
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
def test_the_tome_node_gets_every_input_in_range_and_the_recommended_preset(path):
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
    assert values["preset"] == inputs.RECOMMENDED
    assert inputs.config({**values, "preset": inputs.CUSTOM}) == ToMeConfig(policy="auto")
    model_from = graph[tome["inputs"]["model"][0]]["class_type"]
    dit = path.stem.startswith(("flux", "wan"))
    assert model_from == ("ModelSamplingSD3" if path.stem.startswith("wan") else
                          "UNETLoader" if dit else "CheckpointLoaderSimple")


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
