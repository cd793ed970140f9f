"""What ComfyUI is and does, for the node pack: the only module of the layer that imports
ComfyUI's own modules (``folder_paths``, ``comfy.utils``, ``comfy.model_management``), always
inside a function, so the layer imports (and its tests run) without ComfyUI.

- ``console``: the one voice (one line per event, ``print`` as ComfyUI's nodes do);
- ``cache_path`` and ``measuring_service``: one measuring service per process, its cache file
  under ComfyUI's user directory (``<user>/tome/measurements.json``);
- ``progress``: ComfyUI's progress bar while measuring;
- ``load_for_sampling``: the model on its sampling device before the measure node times it;
- ``attention_override``: whether this ComfyUI has the attention override DiTs are pooled by;
- ``leaves``: the calls a chained override takes only unpooled (ComfyUI's block-sparse
  attention), recognised by the mark on its override (its closure in v0.30.0) and decided
  by its own code;
- ``patcher_names_missing``: ComfyUI's wrapper and callback kinds this ComfyUI lacks
  (``adapters.comfy_name`` reads the others from it);
- ``node_api``: ComfyUI's V3 node schema (``comfy_api.latest``), where it has one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from .. import adapters, survey
from .. import console as _console
from ..measurements import Measurer


def console(line: str) -> None:
    """One console line, never glued to the sampler's progress bar (``tome.console.line``)."""
    _console.line(line)


def cache_path() -> Path:
    """``$TOME_CACHE_DIR`` if set, else ``<ComfyUI user dir>/tome/measurements.json``, else the
    library's default."""
    try:
        import folder_paths
        user = folder_paths.get_user_directory()
    except (ImportError, AttributeError):
        user = None
    return survey.cache_file(os.path.join(user, "tome") if user else None)


_bars: list[Any] = []


def progress(text: str | None) -> None:
    """The measuring service's progress hook: a one-step ComfyUI progress bar on the node that
    is running (the sampler) while a size is measured; best effort."""
    try:
        import comfy.utils
        if text is not None:
            bar = comfy.utils.ProgressBar(1)
            bar.update_absolute(0)
            _bars[:] = [bar]
        elif _bars:
            _bars.pop().update_absolute(1)
    except Exception:  # noqa: BLE001,S110 (a progress bar must never fail a sampling run)
        pass


_services: list[Measurer] = []


def measuring_service() -> Measurer:
    """The process's one measuring service, shared by every ToMe node and the measure node."""
    if not _services:
        _services.append(survey.service(cache_path().parent, console, progress))
    return _services[0]


def attention_override() -> bool:
    """Whether this ComfyUI's attention backends honour
    ``transformer_options["optimized_attention_override"]`` (``wrap_attn``, ComfyUI 0.3.60
    and later); True where ComfyUI cannot be imported (the library's own tests)."""
    try:
        import comfy.ldm.modules.attention as attention
    except Exception:  # noqa: BLE001 (not inside ComfyUI)
        return True
    return hasattr(attention, "wrap_attn")


def load_for_sampling(model_patcher: Any) -> Any:
    """Load the patcher's model on its sampling device as sampling does; that device (None
    where ComfyUI does not answer: the measurement then says where the UNet is)."""
    try:
        import comfy.model_management as mm
        mm.load_models_gpu([model_patcher])
    except Exception:  # noqa: BLE001 (not loaded: measuring says so in its line)
        return None
    return getattr(model_patcher, "load_device", None)


SPARSE = "ComfyUI's block-sparse attention"
SPARSE_MODULE = "nodes_sparse_attention"  # comfy_extras' module of the BlockSparseAttention node
# The mark current ComfyUI puts on its block-sparse override (``mark_attention_override`` in
# ``comfy_extras/sparse_attention_history.py``, read at Comfy-Org/ComfyUI@cf3103c5): the
# settings object, and the override it chains (``_block_sparse_attention_previous``).
SPARSE_MARK = "_block_sparse_attention_patch"


def sparse_patch(override: Any) -> Any:
    """The settings object of ComfyUI's block-sparse attention where ``override`` is its
    override, else None: its mark (``SPARSE_MARK``, current ComfyUI, which re-installs the
    override every step), else (v0.30.0's node, unmarked) a closure of its module holding
    ``patch``; either way one with ``dense_reason``."""
    patch = getattr(override, SPARSE_MARK, None)
    if patch is None and getattr(override, "__module__", "").rpartition(".")[2] == SPARSE_MODULE:
        code, cells = getattr(override, "__code__", None), getattr(override, "__closure__", None)
        if code is not None and cells:
            patch = dict(zip(code.co_freevars, (c.cell_contents for c in cells))).get("patch")
    return patch if callable(getattr(patch, "dense_reason", None)) else None


def patcher_names_missing() -> list[str]:
    """The ``WrappersMP``/``CallbacksMP`` names the pack registers under that this ComfyUI's
    ``comfy.patcher_extension`` lacks (a rename: our wrappers would sit under 0.8.0's string);
    empty where ComfyUI cannot be imported."""
    try:
        import comfy.patcher_extension  # noqa: F401 (loaded: modelpatcher reads it)
    except Exception:  # noqa: BLE001 (not inside ComfyUI)
        return []
    return adapters.comfy_names_missing()


def node_api() -> tuple[Any, Any] | None:
    """``(io, ComfyExtension)`` from ``comfy_api.latest`` where this ComfyUI has the V3 node
    schema (``io.ComfyNode``, ``io.Schema``; 0.8.0 and later), else None (an older ComfyUI, or
    none: the classic ``NODE_CLASS_MAPPINGS`` then)."""
    try:
        from comfy_api.latest import ComfyExtension, io
    except Exception:  # noqa: BLE001 (an older ComfyUI, or not inside ComfyUI)
        return None
    if not all(hasattr(io, name) for name in ("ComfyNode", "Schema", "NodeOutput")):
        return None
    return io, ComfyExtension


def _declines(q: Any, k: Any, v: Any, dim_head: int) -> str | None:
    """A marked block-sparse override whose module has no ``_ineligible``: the conditions
    its node documents (a CUDA kernel, head dim 128, queries, keys and values of one shape)."""
    if q.device.type != "cuda" or dim_head != 128 or not q.shape == k.shape == v.shape:
        return "dense"
    return None


def leaves(override: Any, args: tuple, kwargs: dict) -> str | None:
    """``SPARSE`` where ``override`` (chained under ours) is ComfyUI's block-sparse attention
    and would run its sparse kernel on this call's full tensors (no mask, not VSA, its own
    ``dense_reason`` and ``_ineligible`` say yes): pooled keys make it decline (``q.shape !=
    k.shape``), so the call is left to it whole; else None (pooled as usual)."""
    patch = sparse_patch(override)
    if patch is None or getattr(patch, "vsa", False) or len(args) < 3:
        return None
    ineligible = getattr(sys.modules.get(getattr(override, "__module__", "")), "_ineligible",
                         None) or (_declines if hasattr(override, SPARSE_MARK) else None)
    if ineligible is None:
        return None
    q, k, v = args[:3]
    heads = args[3] if len(args) > 3 else kwargs.get("heads")
    if (args[4] if len(args) > 4 else kwargs.get("mask")) is not None or not heads:
        return None
    options = kwargs.get("transformer_options") or {}
    if kwargs.get("skip_reshape"):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    else:
        qs, ks, vs = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
    if patch.dense_reason(options, qs.shape[1], options.get("block_index")) is not None:
        return None
    return SPARSE if ineligible(qs, ks, vs, qs.shape[-1]) is None else None
