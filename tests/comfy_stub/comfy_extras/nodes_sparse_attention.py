"""Current ComfyUI's ``BlockSparseAttention`` node ("Model Sparse Attention", after v0.30;
public copy ``comfy_extras/nodes_sparse_attention.py`` at ``01dafad3``) as it behaves,
written from its observable behaviour (no ComfyUI code), for the generic models it reaches
through the attention override:

- ``SparseAttnPatch``: its settings (start/end as sigmas, ``min_tokens``, ``dense_blocks``,
  ``vsa``) and ``dense_reason(transformer_options, tokens, block_index)``: why a call stays
  dense whatever its tensors (sigma outside the window, fewer tokens, a dense block), or None.
- ``make_attention_override(patch, previous)``: the override (a closure holding ``patch``
  and ``previous``); a call with a mask, in VSA mode, with a ``dense_reason``, or whose
  tensors ``_ineligible`` declines (no kernel for the device, head dim not 128, ``q.shape
  != k.shape``: "cross-attention or GQA", mixed dtypes) runs ``previous`` (the override
  that was there) or the backend; the others run its kernel.
- the mark (``MARKED``; ComfyUI after v0.30, ``mark_attention_override`` in
  ``comfy_extras/sparse_attention_history.py`` at ``cf3103c5``): the override carries its
  settings object as ``_block_sparse_attention_patch`` and the override it chains as
  ``_block_sparse_attention_previous`` (v0.30.0's node: ``MARKED = False``, no mark);
- ``install_override``: on top of whatever override is there, at patch time and again in
  ``on_prepare_state`` every step (into the sampling's options), once per closure.
- ``apply_block_sparse_attention(model, ...)``: the clone with its override and callbacks.

The stand-in's kernel is SDPA and runs on the CPU too (so tests see it take calls); every
call it takes is recorded in ``TAKEN`` as ``(q shape, k shape)``."""

from __future__ import annotations

import torch.nn.functional as F

HEAD_DIM = 128
KERNEL_DEVICES = ("cuda", "cpu")  # the real kernel: CUDA only
TAKEN: list[tuple] = []
MARKED = True  # the override carries its settings and what it chains (False: v0.30.0)


class SparseAttnPatch:
    def __init__(self, sigma_start, sigma_end, min_tokens, dense_blocks, vsa=False):
        self.sigma_start, self.sigma_end = sigma_start, sigma_end
        self.min_tokens, self.dense_blocks, self.vsa = min_tokens, dense_blocks, vsa
        self.installed = set()

    def reset(self):
        pass

    def dense_reason(self, transformer_options, tokens, block_index):
        sigmas = transformer_options.get("sigmas")
        if sigmas is not None:
            sigma = float(sigmas[0])
            if sigma > self.sigma_start or sigma < self.sigma_end:
                return "outside the window"
        if tokens < self.min_tokens:
            return "too few tokens"
        if self.dense_blocks and block_index in self.dense_blocks:
            return "a dense block"
        return None


def _ineligible(q, k, v, dim_head):
    """Why these ``[B, T, heads, D]`` tensors cannot go to the kernel, or None."""
    if q.device.type not in KERNEL_DEVICES:
        return "no kernel"
    if dim_head != HEAD_DIM:
        return "head dim"
    if q.shape != k.shape or q.shape != v.shape:
        return "cross-attention or GQA (kept dense)"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return "mixed dtypes"
    return None


def make_attention_override(patch, previous):
    def override(func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        options = kwargs.get("transformer_options") or {}

        def dense():
            kw = dict(mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                      skip_output_reshape=skip_output_reshape, **kwargs)
            if previous is None:
                return func(q, k, v, heads, **kw)
            return previous(func, q, k, v, heads, **kw)

        if mask is not None or patch.vsa:
            return dense()
        tokens = q.shape[2] if skip_reshape else q.shape[1]
        if patch.dense_reason(options, tokens, options.get("block_index")) is not None:
            return dense()
        if skip_reshape:
            b, d = q.shape[0], q.shape[-1]
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        else:
            b, d = q.shape[0], q.shape[-1] // heads
            qs, ks, vs = (t.view(b, -1, heads, d) for t in (q, k, v))
        if _ineligible(qs, ks, vs, d) is not None:
            return dense()
        TAKEN.append((tuple(q.shape), tuple(k.shape)))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (qs, ks, vs)))
        if skip_output_reshape:
            return out
        return out.transpose(1, 2).reshape(b, -1, heads * d)

    if MARKED:
        override._block_sparse_attention_patch = patch
        override._block_sparse_attention_previous = previous
    return override


def install_override(patch, transformer_options):
    current = transformer_options.get("optimized_attention_override")
    if current in patch.installed:
        return
    override = make_attention_override(patch, current)
    patch.installed.add(override)
    transformer_options["optimized_attention_override"] = override


def apply_block_sparse_attention(model, start_percent=0.2, end_percent=1.0, min_tokens=12288,
                                 dense_blocks=(), vsa=False):
    sampling = model.get_model_object("model_sampling")
    patch = SparseAttnPatch(float(sampling.percent_to_sigma(start_percent)),
                            float(sampling.percent_to_sigma(end_percent)), min_tokens,
                            set(dense_blocks), vsa)
    m = model.clone()
    install_override(patch, m.model_options["transformer_options"])
    m.add_callback_with_key("on_prepare_state", "block_sparse_attention",
                            lambda patcher, timestep, model_options: install_override(
                                patch, model_options["transformer_options"]))
    m.add_callback_with_key("on_cleanup", "block_sparse_attention", lambda patcher: patch.reset())
    return m
