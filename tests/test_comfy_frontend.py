"""The pack's ComfyUI frontend extension (``web/tome.js``, served through ``WEB_DIRECTORY``):
its table is ``tome.comfy.inputs.frontend_table()`` (what a chosen preset fills in, which inputs
fold), and the root ``__init__.py`` tells ComfyUI where it is. What it does in the real frontend
is checked by ``tome_lab/comfy_browser_check.py`` (docs/development.md)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from tome.comfy import inputs
from tome.config import preset

ROOT = Path(__file__).resolve().parent.parent
JS = ROOT / "web" / "tome.js"


def table() -> dict:
    (line,) = [ln for ln in JS.read_text().splitlines() if ln.startswith("const TABLE = ")]
    return json.loads(re.fullmatch(r"const TABLE = (.*);", line).group(1))


def test_the_extension_table_is_generated_from_the_inputs():
    # regenerate: python -c "from tome.comfy import inputs; import json;
    #   print(json.dumps(inputs.frontend_table(), separators=(',', ':')))"
    assert table() == inputs.frontend_table()


def test_the_folded_inputs_are_all_but_the_preset_and_the_front_ones():
    spec = inputs.input_types()
    every = [name for part in spec.values() for name in part if name not in ("model", "preset")]
    assert table()["advanced"] == [n for n in every if n not in inputs.FRONT]
    assert all(spec["required"].get(n, spec["optional"].get(n))[1].get("advanced")
               for n in table()["advanced"])


def test_each_fill_runs_its_preset_and_keeps_the_seed_and_policy():
    for name, fill in table()["fills"].items():
        assert "seed" not in fill and "policy" not in fill
        values = {**fill, "preset": name, "seed": 5, "policy": "fixed"}
        want = "balanced" if name == inputs.RECOMMENDED else name
        assert inputs.config(values) == preset(want, seed=5, policy="fixed")
        # a fill names every other input: nothing set before it stays
        assert set(fill) == {n for n in (*inputs.MAIN, *inputs.ADVANCED)} - {"seed", "policy"}


def test_comfyui_finds_the_web_directory():
    tree = ast.parse((ROOT / "__init__.py").read_text())
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    assert ast.literal_eval(assigned["WEB_DIRECTORY"]) == "./web"
    assert (ROOT / "web" / "tome.js").is_file()
