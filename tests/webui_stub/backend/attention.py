"""``backend.attention``: the attention function Neo picks once at import (PyTorch's here;
the name it is bound to is ``attention_function``, its own name says which backend it is).

Called as ``attention_function(q, k, v, heads, mask=None, skip_reshape=False, ...)``: ``q``,
``k``, ``v`` are ``[B, S, heads * D]``, or ``[B, heads, S, D]`` with ``skip_reshape``; the
answer is ``[B, S, heads * D]``. Extra keywords (``transformer_options``) are ignored.
"""

import torch
import torch.nn.functional as F

calls = []  # (q length, k length) of every call, for the tests


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                      skip_output_reshape=False, **kwargs):
    if not skip_reshape:
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
    if not torch.compiler.is_compiling():  # a list read in a graph would be guarded on
        calls.append((q.shape[2], k.shape[2]))
    if mask is not None:  # as Neo's PyTorch attention: [S, S] and [B, S, S] get broadcast axes
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out if skip_output_reshape else out.transpose(1, 2).flatten(2)


attention_function = attention_pytorch  # Neo binds the backend it picked under this name
