"""``comfy.ldm.aura.mmdit.MMDiT`` (AuraFlow) as ComfyUI 0.8.0 behaves (tiny width; written from
its public source's structure and call shapes, not its code).

- ``forward(x, timestep, context, transformer_options={}, **kwargs)`` runs the
  ``diffusion_model`` wrappers around ``_forward``: the latent ``[B, C, H, W]`` is cut into 2x2
  patches (``init_x_linear``), a centred crop of a learned square position table
  (``positional_encoding``) is added, the text is projected (``cond_seq_linear``) behind 8
  learned ``register_tokens``; ``double_layers`` (``MMDiTBlock``) run joint attention over
  ``[registers + text, image]``, then ``single_layers`` (``DiTBlock``) over their
  concatenation; the image part goes back through ``final_linear`` into a latent.
- Attention: ``optimized_attention(q, k, v, heads, skip_reshape=True,
  transformer_options=...)`` with ``[B, heads, S, D]`` tensors (q and k layer-normed per
  head, no RoPE); no ``block_type`` / ``block_index`` in ``transformer_options``.
- The class is called ``MMDiT``, as A1111's SD3 is; it has no ``x_embedder``,
  ``joint_blocks`` or ``pe_embedder``. ``patch_size`` is an int.
"""

import math

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.modules.attention import optimized_attention


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def _attend(q, k, v, heads, options):
    """``[B, S, heads * D]`` projections -> per-head layer norm of q and k -> the call."""
    q, k, v = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
    q, k = F.layer_norm(q, q.shape[-1:]), F.layer_norm(k, k.shape[-1:])
    return optimized_attention(q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3),
                               v.permute(0, 2, 1, 3), heads, skip_reshape=True,
                               transformer_options=options)


class SingleAttention(torch.nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.w1q, self.w1k, self.w1v, self.w1o = (torch.nn.Linear(dim, dim, bias=False)
                                                  for _ in range(4))

    def forward(self, c, transformer_options={}):  # noqa: B006 (as ComfyUI)
        out = _attend(self.w1q(c), self.w1k(c), self.w1v(c), self.n_heads, transformer_options)
        return self.w1o(out)


class DoubleAttention(torch.nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.w1q, self.w1k, self.w1v, self.w1o = (torch.nn.Linear(dim, dim, bias=False)
                                                  for _ in range(4))
        self.w2q, self.w2k, self.w2v, self.w2o = (torch.nn.Linear(dim, dim, bias=False)
                                                  for _ in range(4))

    def forward(self, c, x, transformer_options={}):  # noqa: B006
        q = torch.cat([self.w1q(c), self.w2q(x)], dim=1)
        k = torch.cat([self.w1k(c), self.w2k(x)], dim=1)
        v = torch.cat([self.w1v(c), self.w2v(x)], dim=1)
        out = _attend(q, k, v, self.n_heads, transformer_options)
        c, x = out.split([c.shape[1], x.shape[1]], dim=1)
        return self.w1o(c), self.w2o(x)


class MMDiTBlock(torch.nn.Module):
    def __init__(self, dim, heads, global_conddim):
        super().__init__()
        self.modC = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(global_conddim, 3 * dim))
        self.modX = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(global_conddim, 3 * dim))
        self.mlpC, self.mlpX = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.attn = DoubleAttention(dim, heads)

    def forward(self, c, x, global_cond, transformer_options={}, **kwargs):  # noqa: B006
        c_shift, c_scale, c_gate = self.modC(global_cond).chunk(3, dim=1)
        x_shift, x_scale, x_gate = self.modX(global_cond).chunk(3, dim=1)
        ca, xa = self.attn(modulate(F.layer_norm(c, c.shape[-1:]), c_shift, c_scale),
                           modulate(F.layer_norm(x, x.shape[-1:]), x_shift, x_scale),
                           transformer_options=transformer_options)
        c, x = c + c_gate.unsqueeze(1) * ca, x + x_gate.unsqueeze(1) * xa
        return c + self.mlpC(F.silu(c)), x + self.mlpX(F.silu(x))


class DiTBlock(torch.nn.Module):
    def __init__(self, dim, heads, global_conddim):
        super().__init__()
        self.modCX = torch.nn.Sequential(torch.nn.SiLU(),
                                         torch.nn.Linear(global_conddim, 3 * dim))
        self.attn = SingleAttention(dim, heads)
        self.mlp = torch.nn.Linear(dim, dim)

    def forward(self, cx, global_cond, transformer_options={}, **kwargs):  # noqa: B006
        shift, scale, gate = self.modCX(global_cond).chunk(3, 1)
        a = self.attn(modulate(F.layer_norm(cx, cx.shape[-1:]), shift, scale),
                      transformer_options=transformer_options)
        cx = cx + gate.unsqueeze(1) * a
        return cx + self.mlp(F.silu(cx))


class MMDiT(torch.nn.Module):
    def __init__(self, in_channels=4, out_channels=4, patch_size=2, dim=32, n_layers=3,
                 n_double_layers=2, n_heads=2, global_conddim=32, cond_seq_dim=12,
                 max_seq=16 * 16):
        super().__init__()
        self.t_embedder = torch.nn.Linear(16, global_conddim)
        self.cond_seq_linear = torch.nn.Linear(cond_seq_dim, dim, bias=False)
        self.init_x_linear = torch.nn.Linear(patch_size * patch_size * in_channels, dim)
        self.positional_encoding = torch.nn.Parameter(torch.randn(1, max_seq, dim) * 0.1)
        self.register_tokens = torch.nn.Parameter(torch.randn(1, 8, dim) * 0.1)
        self.double_layers = torch.nn.ModuleList(
            [MMDiTBlock(dim, n_heads, global_conddim) for _ in range(n_double_layers)])
        self.single_layers = torch.nn.ModuleList(
            [DiTBlock(dim, n_heads, global_conddim) for _ in range(n_double_layers, n_layers)])
        self.final_linear = torch.nn.Linear(dim, patch_size * patch_size * out_channels,
                                            bias=False)
        self.modF = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Linear(global_conddim, 2 * dim))
        self.out_channels, self.patch_size = out_channels, patch_size
        self.n_double_layers, self.n_layers = n_double_layers, n_layers
        self.h_max = self.w_max = round(max_seq ** 0.5)

    def patchify(self, x):
        b, c, h, w = x.shape
        p = self.patch_size
        x = F.pad(x, (0, (p - w % p) % p, 0, (p - h % p) % p))
        x = x.view(b, c, x.shape[-2] // p, p, x.shape[-1] // p, p)
        return x.permute(0, 2, 4, 1, 3, 5).flatten(-3).flatten(1, 2)

    def apply_pos_embeds(self, x, h, w):
        h, w = (h + 1) // self.patch_size, (w + 1) // self.patch_size
        table = self.positional_encoding.reshape(1, self.h_max, self.w_max, -1)
        top, left = (self.h_max - h) // 2, (self.w_max - w) // 2
        return x + table[:, top:top + h, left:left + w].reshape(1, h * w, -1)

    def forward(self, x, timestep, context, transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, transformer_options, **kwargs)

    def _forward(self, x, timestep, context, transformer_options={}, **kwargs):  # noqa: B006
        b, _, h, w = x.shape
        x = self.apply_pos_embeds(self.init_x_linear(self.patchify(x)), h, w)
        c = self.cond_seq_linear(context)
        c = torch.cat([self.register_tokens.repeat(c.shape[0], 1, 1), c], dim=1)
        half = torch.exp(-math.log(10000) * torch.arange(8) / 8)
        t = timestep.float()[:, None] * 1000 * half[None]
        global_cond = self.t_embedder(torch.cat([t.cos(), t.sin()], -1))
        for layer in self.double_layers:
            c, x = layer(c, x, global_cond, transformer_options=transformer_options)
        if len(self.single_layers) > 0:
            c_len = c.shape[1]
            cx = torch.cat([c, x], dim=1)
            for layer in self.single_layers:
                cx = layer(cx, global_cond, transformer_options=transformer_options)
            x = cx[:, c_len:]
        x = self.final_linear(modulate(x, *self.modF(global_cond).chunk(2, dim=1)))
        p, hp, wp = self.patch_size, (h + 1) // self.patch_size, (w + 1) // self.patch_size
        x = x.reshape(b, hp, wp, p, p, self.out_channels).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(b, self.out_channels, hp * p, wp * p)[:, :, :h, :w]
