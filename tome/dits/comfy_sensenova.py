"""ComfyUI's SenseNova-U1.5 (``comfy.ldm.sensenova.model.SenseNovaU15``, after v0.30.0, read
at Comfy-Org/ComfyUI@ec0c6b63): a language model's layers (``language_model.model.layers``,
``block_index`` named, no ``block_type``) generating an image in pixels, one token per 32 x 32
pixels (the image padded to 16 a side, then to a multiple of 32). In each layer the prompt's
prefix attends to itself (causal mask), then the image's queries attend to ``[prefix keys,
image keys]``: that call is pooled (the prefix whole). Keys and values have fewer heads than
the queries (grouped-query attention, ``enable_gqa``): pooling is along the tokens, so the
same. A precomputed prefix (``prefix_keys``) skips the prefix's own calls; its length is the
keys'."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .family import COMFYUI, Dit, Family, HostPoint, comfy_class

PATCH = 32  # pixels per token side (its two stride-16 and stride-2 embeddings)


def read(model: nn.Module) -> tuple[Dit, Any, Any]:
    return Dit(PATCH, True, 256, 1000.0, True), model.language_model.model.layers, ()


def prefix_length(conds: dict) -> int | None:
    """The prefix's tokens: a precomputed prefix's keys (``[B, kv heads, P, D]``), else the
    prompt's token ids; None without either."""
    keys = conds.get("prefix_keys")
    if keys:
        return int(keys[0].shape[2])
    ids = conds.get("text_input_ids")
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None


def spans(model: nn.Module, x: torch.Tensor, context: Any, conds: dict) -> tuple | None:
    """``(prefix, True, 0, 1, h, w, 0)``: the prefix's keys first, the image's ``h x w``
    tokens; None without a prefix. The prefix's own call (as many keys as its tokens) is
    never placed (``Spans.start``: a call as long as the text)."""
    p = prefix_length(conds)
    if x.dim() != 4 or p is None:
        return None
    h, w = (math.ceil(max(int(s), 16) / PATCH) for s in x.shape[-2:])
    return p, True, 0, 1, h, w, 0


FAMILY = Family("comfy sensenova", comfy_class("SenseNovaU15"), read,
                host=HostPoint(COMFYUI, spans))
