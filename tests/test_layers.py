"""The package's layering (docs/development.md): each module imports only from its own layer
or below, there is no import circle, only the WebUI layer touches the WebUI, and only the
ComfyUI layer touches ComfyUI (lazily: inside functions).

Every import counts, the ones inside functions too: a late import is still a dependency.
Imports for type annotations only (under ``if TYPE_CHECKING:``) do not run and do not count.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tome"

# Bottom to top. A module may import from its own layer and the ones below.
LAYERS = [
    ("tome.requirements", "tome.console", "tome.brackets", "tome.ratio", "tome.graphs"),
    ("tome.merge",),
    ("tome.methods",),
    ("tome.schedule",),  # the DiT schedule: which factor pools which block when
    ("tome.dit",),      # the DiT form of the downsample method (pure tensor code)
    ("tome.reuse",),    # residual reuse: what it keeps, per thread, block part and identity
    ("tome.attend",),   # attention over pooled keys: the bias per kernel
    ("tome.kv",),       # one attention step for every DiT host: pool, rotate, bias, reuse
    ("tome.parallel",),  # pooling under context parallelism: each rank's shard, or refused
    ("tome.percall_calls",),  # what a patch's model and attention calls did: counts, tally
    ("tome.dits",),     # the DiT families (one file each) and their registry, read by layout
    ("tome.values",),   # loose values to a setting's type; the words for its range
    ("tome.config",),   # validates method names against the methods' registry
    ("tome.policy", "tome.layout", "tome.memory", "tome.budget"),
    ("tome.timing_results",),  # what measure found: pure data, kept by measurements
    ("tome.plan",),
    ("tome.callplan",),  # the one planner of a DiT model call, for every bracket
    ("tome.report",),
    ("tome.handle",),   # the patch handle: what a host drives a ModelPatcher patch by
    # the ModelPatcher contract's helpers; the per-call DiT core under the override and swap
    ("tome.modelpatcher", "tome.percall", "tome.wrappers"),
    ("tome.patch", "tome.patcher", "tome.processors", "tome.measure", "tome.override",
     "tome.swap", "tome.percall_runner"),
    ("tome.adapters",),  # the one choice of adapter, from the layout and the host's contract
    ("tome.measurements",),
    ("tome.survey",),   # the host kit: the measuring service, "measure now" for every host
    ("tome",),          # the package's public API (__init__)
    ("tome.webui", "tome.comfy"),    # the hosts' layers, and everything under them
]


def _name(path: pathlib.Path) -> str:
    parts = ("tome", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The ``tome`` modules ``path`` imports, relative imports resolved."""
    name = _name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", None) == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)}
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # ``from . import merge`` names a module
                found.add(f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base)
    return {m for m in found if m == "tome" or m.startswith("tome.")}


def _is_module(name: str) -> bool:
    rel = pathlib.Path(*name.split(".")[1:])
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def _layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or (n != "tome" and module.startswith(n + ".")) for n in names):
            return i
    raise AssertionError(f"{module} is in no layer: add it to LAYERS and docs/development.md")


GRAPH = {_name(p): _imports(p) - {_name(p)} for p in ROOT.rglob("*.py")}


def test_no_upward_import():
    upward = [f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
              if _layer(d) > _layer(m)]
    assert not upward, upward


def test_no_import_circle():
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        assert m not in path, " -> ".join(path[path.index(m):] + [m])
        if m in done:
            return
        for d in GRAPH.get(m, ()):
            if d != "tome":  # the package __init__ is the API layer, checked above
                visit(d, path + [m])
        done.add(m)

    for m in GRAPH:
        visit(m, [])


def test_only_the_webui_layer_imports_the_webui():
    outside = [m for m, p in ((_name(p), p) for p in ROOT.rglob("*.py"))
               if not m.startswith("tome.webui") and "from modules" in p.read_text()]
    assert not outside, outside


def test_the_library_never_imports_the_lab():
    """The lab (``tome_lab/``: benchmarks, the demo, the tiny models' weights) sits beside the
    package and is not shipped with it: no module of ``tome`` may import it, even lazily."""
    found = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{_name(path)} -> {n}" for n in names if n.split(".")[0] == "tome_lab"]
    assert not found, found
    assert not (ROOT / "lab").exists() and not (ROOT / "bench.py").exists()


def test_torch_minimum_is_one_number():
    from tome.requirements import MIN_TORCH
    pyproject = (ROOT.parent / "pyproject.toml").read_text()
    assert f'"torch>={".".join(map(str, MIN_TORCH))}"' in pyproject


def test_adapters_and_the_measurement_never_import_each_other():
    """Measuring runs a block through whichever adapter's ``run_block`` it is handed: the
    timing room stays below both adapters, and neither adapter reaches up into it."""
    adapters = {"tome.patch", "tome.patcher", "tome.processors", "tome.override", "tome.swap",
                "tome.percall", "tome.percall_runner", "tome.modelpatcher", "tome.wrappers"}
    measuring = {"tome.measure", "tome.measurements"}
    crossing = [f"{m} -> {d}" for m in adapters | measuring for d in GRAPH[m]
                if {m, d} & adapters and {m, d} & measuring]
    assert not crossing, crossing


def test_the_host_layers_never_import_each_other():
    crossing = [f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
                for a, b in (("tome.webui", "tome.comfy"), ("tome.comfy", "tome.webui"))
                if (m == a or m.startswith(a + ".")) and (d == b or d.startswith(b + "."))]
    assert not crossing, crossing


COMFY_MODULES = ("comfy", "folder_paths", "server", "comfy_extras", "comfy_api", "nodes")


def _host_imports(path: pathlib.Path) -> list[tuple[str, bool]]:
    """(ComfyUI module, imported inside a function) for each import of ComfyUI in ``path``."""
    tree = ast.parse(path.read_text())
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef,
                                                              ast.AsyncFunctionDef))
              for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        found += [(n, id(node) in inside) for n in names
                  if n.split(".")[0] in COMFY_MODULES]
    return found


def test_only_the_comfy_layer_imports_comfyui_and_only_lazily():
    found = {_name(p): _host_imports(p) for p in ROOT.rglob("*.py")}
    outside = [m for m, imports in found.items() if imports and not m.startswith("tome.comfy")]
    eager = [f"{m}: {n}" for m, imports in found.items() for n, late in imports if not late]
    assert not outside and not eager, (outside, eager)
    assert found["tome.comfy.host"], "the ComfyUI layer's host module is where ComfyUI is read"
    assert not [m for m, imports in found.items() if imports and m != "tome.comfy.host"]


def test_the_per_call_shims_share_the_core_not_each_other():
    """ComfyUI's override and Forge Neo's swap are shims over ``percall``; neither imports the
    other or the UNet's attn1 adapter (the ModelPatcher helpers are ``modelpatcher``)."""
    shims = {"tome.override", "tome.swap", "tome.patcher"}
    crossing = [f"{m} -> {d}" for m in shims for d in GRAPH[m] if d in shims]
    assert not crossing, crossing
    assert {"tome.percall"} <= GRAPH["tome.override"] & GRAPH["tome.swap"]


def test_only_the_family_files_name_a_family():
    """Everything in which DiTs differ lives in ``tome/dits/``: no other library module
    imports a family file or names a registered family (the adapters find a family's host
    point through the registry, ``Family.host``)."""
    from tome import dits
    files = {f"tome.dits.{p.stem}" for p in (ROOT / "dits").glob("*.py")} - {
        "tome.dits.__init__", "tome.dits.family"}
    names = [f.name for f in dits.BUILTIN_FAMILIES]
    outside = [p for p in ROOT.rglob("*.py") if "dits" not in p.relative_to(ROOT).parts]
    importing = [f"{_name(p)} -> {d}" for p in outside for d in GRAPH[_name(p)] & files]
    assert not importing, importing
    naming = [f"{_name(p)}: {n!r}" for p in outside for n in names
              if f'"{n}"' in p.read_text() or f"'{n}'" in p.read_text()]
    assert not naming, naming


def test_no_library_module_is_over_450_lines():
    long = {_name(p): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long


ADAPTER_MODULES = ("tome.percall", "tome.override", "tome.swap", "tome.patcher",
                   "tome.modelpatcher", "tome.processors", "tome.patch", "tome.percall_runner",
                   "tome.wrappers")


def test_the_host_layers_and_the_lab_import_no_adapter_module():
    """The hosts drive a patch through ``adapters`` and its ``PatchHandle`` (callbacks passed
    in, the after-sampling line asked for), never the adapters' objects; the lab likewise
    (it reads the public API)."""
    found = {m: sorted(i for i in imports if i in ADAPTER_MODULES)
             for m, imports in GRAPH.items()
             if m.startswith(("tome.webui", "tome.comfy"))}
    lab = ROOT.parent / "tome_lab"
    for path in sorted(lab.rglob("*.py")):
        text = path.read_text()
        names = [m for m in ADAPTER_MODULES if f"{m} import" in text or f"import {m}" in text
                 or f"from tome import {m.rpartition('.')[2]}" in text
                 or f"{m}." in text]
        if names:
            found[str(path.relative_to(lab.parent))] = names
    assert not {m: i for m, i in found.items() if i}
