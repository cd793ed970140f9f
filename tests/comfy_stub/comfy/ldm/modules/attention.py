"""``comfy.ldm.modules.attention`` as ComfyUI 0.8.0 behaves (written from its observed
behaviour, not its code).

- ``wrap_attn``: every backend is wrapped; a call without ``_inside_attn_wrapper`` in its
  keywords sets it, and when its ``transformer_options`` hold ``optimized_attention_override``
  returns ``override(func, *args, **kwargs)`` (``func``: the backend, still wrapped, so
  calling it from the override runs the backend itself); the flag is removed again after.
- Backends ``(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
  skip_output_reshape=False, **kwargs)``: ``skip_reshape`` takes ``[B, heads, S, D]``,
  otherwise ``[B, S, heads * D]``; the output is ``[B, S, heads * D]``, or ``[B, heads, S,
  D]`` with ``skip_output_reshape``. ``attention_pytorch`` and ``attention_basic`` add a mask
  (2-D/3-D/4-D, broadcast over batch, heads and queries); ``attention_sage`` hands the mask
  to a kernel that ignores it (``sageattn`` takes it into ``**kwargs``).
- ``optimized_attention`` and ``optimized_attention_masked``: the selected backend (the
  models bind these names when imported).
"""

import functools

import torch.nn.functional as F


def wrap_attn(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        remove = False
        try:
            if "_inside_attn_wrapper" not in kwargs:
                options = kwargs.get("transformer_options", None)
                remove = True
                kwargs["_inside_attn_wrapper"] = True
                if options is not None and "optimized_attention_override" in options:
                    return options["optimized_attention_override"](func, *args, **kwargs)
            return func(*args, **kwargs)
        finally:
            if remove:
                del kwargs["_inside_attn_wrapper"]
    return wrapper


def _split(q, k, v, heads, skip_reshape):
    if skip_reshape:
        return q, k, v
    b, d = q.shape[0], q.shape[-1] // heads  # the queries' head width for all three (SD3's
    return tuple(t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))  # v is 4-D)


def _out(out, skip_output_reshape):
    return out if skip_output_reshape else out.transpose(1, 2).flatten(2)


def _mask4(mask):
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    return mask


@wrap_attn
def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                      skip_output_reshape=False, **kwargs):
    q, k, v = _split(q, k, v, heads, skip_reshape)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else _mask4(mask))
    return _out(out, skip_output_reshape)


@wrap_attn
def attention_basic(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                    skip_output_reshape=False, **kwargs):
    q, k, v = _split(q, k, v, heads, skip_reshape)
    sim = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        sim = sim + _mask4(mask)
    out = sim.softmax(-1).to(v.dtype) @ v
    return _out(out, skip_output_reshape)


@wrap_attn
def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                   skip_output_reshape=False, **kwargs):
    q, k, v = _split(q, k, v, heads, skip_reshape)
    out = F.scaled_dot_product_attention(q, k, v)  # the kernel drops ``attn_mask`` silently
    return _out(out, skip_output_reshape)


optimized_attention = attention_pytorch
optimized_attention_masked = optimized_attention
