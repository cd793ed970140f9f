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

After v0.30.0 (read at Comfy-Org/ComfyUI@05080f60): ``wrap_attn`` pops a layer's
``preferred_attention`` (a ``ComfyAttention`` whose ``function`` is a per-checkpoint kernel,
e.g. int8) and calls that function where no override is installed, so an installed override
drops it; q, k, v may come in ``AttentionTensorContainer``s (single-owner holders), which an
override receives as tensors (taken out) unless it defines ``container_function``, called
then with the containers instead.
"""

import functools

import torch.nn.functional as F


class AttentionTensorContainer:
    """One tensor handed to a backend once (``take``)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def take(self):
        tensor, self.tensor = self.tensor, None
        if tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return tensor


class ComfyAttention:
    """A layer's preferred attention: ``function`` (None: the selected backend)."""

    def __init__(self, function=None):
        self.function = function


def wrap_attn(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        preferred = kwargs.pop("preferred_attention", None)
        boxed = len(args) >= 3 and isinstance(args[0], AttentionTensorContainer)
        remove = False
        try:
            if "_inside_attn_wrapper" not in kwargs:
                options = kwargs.get("transformer_options", None)
                remove = True
                kwargs["_inside_attn_wrapper"] = True
                if options is not None and "optimized_attention_override" in options:
                    override = options["optimized_attention_override"]
                    if boxed and hasattr(override, "container_function"):
                        return override.container_function(*args, **kwargs)
                    if boxed:
                        args = tuple(c.take() for c in args[:3]) + args[3:]
                    return override(func, *args, **kwargs)
                if preferred is not None and preferred.function is not None:
                    return preferred.function(*args, **kwargs)
            if boxed:
                args = tuple(c.take() for c in args[:3]) + args[3:]
            return func(*args, **kwargs)
        finally:
            if remove:
                del kwargs["_inside_attn_wrapper"]
    return wrapper


def _split(q, k, v, heads, skip_reshape, gqa=False):
    """``[B, heads, S, D]`` of each; ``gqa`` (``enable_gqa``, after v0.30.0): keys and values
    with fewer heads, repeated to the queries' (as ``comfy.ops.repeat_kv_for_gqa``)."""
    if not skip_reshape:
        b, d = q.shape[0], q.shape[-1] // heads  # the queries' head width for all three (SD3's
        q, k, v = (t.view(b, -1, t.shape[-1] // d, d).transpose(1, 2)  # v is 4-D)
                   if t.dim() == 3 else t.view(b, -1, heads, d).transpose(1, 2)
                   for t in (q, k, v))
    if gqa and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    return q, k, v


def _out(out, skip_output_reshape):
    return out if skip_output_reshape else out.transpose(1, 2).flatten(2)


def _mask4(mask):
    while mask.ndim < 4:
        mask = mask.unsqueeze(0)
    return mask


@wrap_attn
def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                      skip_output_reshape=False, **kwargs):
    q, k, v = _split(q, k, v, heads, skip_reshape, kwargs.get("enable_gqa", False))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else _mask4(mask))
    return _out(out, skip_output_reshape)


@wrap_attn
def attention_basic(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                    skip_output_reshape=False, **kwargs):
    q, k, v = _split(q, k, v, heads, skip_reshape, kwargs.get("enable_gqa", False))
    sim = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        sim = sim + _mask4(mask)
    out = sim.softmax(-1).to(v.dtype) @ v
    return _out(out, skip_output_reshape)


@wrap_attn
def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                   skip_output_reshape=False, **kwargs):
    q, k, v = _split(q, k, v, heads, skip_reshape, kwargs.get("enable_gqa", False))
    out = F.scaled_dot_product_attention(q, k, v)  # the kernel drops ``attn_mask`` silently
    return _out(out, skip_output_reshape)


optimized_attention = attention_pytorch
optimized_attention_masked = optimized_attention
