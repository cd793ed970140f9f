"""``comfy.ldm.modules.diffusionmodules.mmdit`` (SD3, SD3.5) as ComfyUI 0.8.0 behaves (tiny width;
written from its public source's structure and call shapes, not its code). It is Stability's
reference MMDiT, the code A1111 runs too, with ComfyUI's attention call:

- ``OpenAISignatureMMDITWrapper(MMDiT)`` (what ``model_base.SD3`` builds):
  ``forward(x, timesteps, context=None, y=None, control=None, transformer_options={},
  **kwargs)``; no ``diffusion_model`` wrappers are run (SD3 does not enter them).
- ``x_embedder`` (``PatchEmbed``, ``patch_size`` a pair) turns ``[B, C, H, W]`` into image
  tokens plus a centred crop of ``pos_embed``; ``joint_blocks`` (``JointBlock``: a
  ``context_block`` and an ``x_block``, each a ``DismantledBlock`` whose ``attn``
  (``SelfAttention``) has ``pre_attention`` / ``post_attention``) run as ``block(context, x,
  c=c_mod, use_checkpoint=..., transformer_options=...)``; the last context block is
  pre-only.
- Joint attention (``block_mixing``): each side's q, k ``[B, S, heads * D]`` and v ``[B, S,
  heads, D]`` (the reference code's ``split_qkv``; ComfyUI's backends view it back) concatenated
  ``[context, x]`` and ``optimized_attention(q, k, v, heads=..., transformer_options=...)``;
  no ``block_type`` / ``block_index`` in ``transformer_options``; the blocks never call attn1
  patches. ``register_length`` learned tokens go before the context (SD3 has none).
- SD3.5 Medium: the image blocks of ``x_block_self_attn_layers`` also run ``attn2``, a
  self-attention over the image tokens alone through the same call, its output added
  (gated) beside the joint attention's. The same in v0.30.0.
"""

import math

import torch
import torch.nn.functional as F

from comfy.ldm.modules.attention import optimized_attention


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class PatchEmbed(torch.nn.Module):
    def __init__(self, patch_size=2, in_chans=4, embed_dim=32):
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.proj = torch.nn.Conv2d(in_chans, embed_dim, patch_size, patch_size)

    def forward(self, x):
        p = self.patch_size[0]
        x = F.pad(x, (0, (p - x.shape[-1] % p) % p, 0, (p - x.shape[-2] % p) % p),
                  mode="circular")
        return self.proj(x).flatten(2).transpose(1, 2)


class SelfAttention(torch.nn.Module):
    def __init__(self, dim, num_heads=8, pre_only=False):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = torch.nn.Linear(dim, dim * 3)
        if not pre_only:
            self.proj = torch.nn.Linear(dim, dim)
        self.pre_only = pre_only

    def pre_attention(self, x):  # q and k [B, S, heads * D], v [B, S, heads, D] (as upstream)
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).movedim(2, 0)
        return q.flatten(2), k.flatten(2), v

    def post_attention(self, x):
        return self.proj(x)


class DismantledBlock(torch.nn.Module):
    def __init__(self, hidden_size, num_heads, pre_only=False, x_block_self_attn=False):
        super().__init__()
        self.attn = SelfAttention(hidden_size, num_heads, pre_only)
        self.pre_only, self.x_block_self_attn = pre_only, x_block_self_attn
        if x_block_self_attn:
            self.attn2 = SelfAttention(hidden_size, num_heads)
        self.adaLN_modulation = torch.nn.Sequential(
            torch.nn.SiLU(), torch.nn.Linear(hidden_size, (2 if pre_only else 3) * hidden_size))
        if not pre_only:
            self.mlp = torch.nn.Linear(hidden_size, hidden_size)

    def pre_attention(self, x, c):
        if self.pre_only:
            shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
            return self.attn.pre_attention(modulate(F.layer_norm(x, x.shape[-1:]), shift,
                                                    scale)), None
        shift, scale, gate = self.adaLN_modulation(c).chunk(3, dim=1)
        qkv = self.attn.pre_attention(modulate(F.layer_norm(x, x.shape[-1:]), shift, scale))
        return qkv, (x, gate)

    def post_attention(self, attn, x, gate, attn2=None):
        x = x + gate.unsqueeze(1) * self.attn.post_attention(attn)
        if attn2 is not None:
            x = x + gate.unsqueeze(1) * self.attn2.post_attention(attn2)
        return x + self.mlp(F.gelu(F.layer_norm(x, x.shape[-1:])))


def _block_mixing(context, x, context_block, x_block, c, transformer_options={}):  # noqa: B006
    context_qkv, context_intermediates = context_block.pre_attention(context, c)
    x_qkv, x_intermediates = x_block.pre_attention(x, c)
    qkv = tuple(torch.cat((context_qkv[t], x_qkv[t]), dim=1) for t in range(3))
    attn = optimized_attention(qkv[0], qkv[1], qkv[2], heads=x_block.attn.num_heads,
                               transformer_options=transformer_options)
    n = context_qkv[0].shape[1]
    context = None if context_block.pre_only else \
        context_block.post_attention(attn[:, :n], *context_intermediates)
    attn2 = None
    if x_block.x_block_self_attn:  # SD3.5 Medium: the image's own self-attention
        q2, k2, v2 = x_block.attn2.pre_attention(
            F.layer_norm(x_intermediates[0], x_intermediates[0].shape[-1:]))
        attn2 = optimized_attention(q2, k2, v2, heads=x_block.attn2.num_heads,
                                    transformer_options=transformer_options)
    return context, x_block.post_attention(attn[:, n:], *x_intermediates, attn2=attn2)


def block_mixing(*args, use_checkpoint=True, **kwargs):
    return _block_mixing(*args, **kwargs)  # (checkpointing changes nothing at inference)


class JointBlock(torch.nn.Module):
    def __init__(self, hidden_size, num_heads, pre_only, x_block_self_attn=False):
        super().__init__()
        self.context_block = DismantledBlock(hidden_size, num_heads, pre_only)
        self.x_block = DismantledBlock(hidden_size, num_heads, False, x_block_self_attn)

    def forward(self, *args, **kwargs):
        return block_mixing(*args, context_block=self.context_block, x_block=self.x_block,
                            **kwargs)


class MMDiT(torch.nn.Module):
    def __init__(self, in_channels=4, patch_size=2, depth=2, hidden_size=32, num_heads=2,
                 context_dim=12, adm_in_channels=None, pos_embed_max_size=16,
                 register_length=0, x_block_self_attn_layers=()):
        super().__init__()
        self.out_channels, self.hidden_size, self.num_heads = in_channels, hidden_size, num_heads
        self.pos_embed_max_size = pos_embed_max_size
        self.x_embedder = PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = torch.nn.Linear(16, hidden_size)
        self.y_embedder = None if adm_in_channels is None else \
            torch.nn.Linear(adm_in_channels, hidden_size)
        self.context_embedder = torch.nn.Linear(context_dim, hidden_size)
        self.register_buffer("pos_embed",
                             torch.randn(1, pos_embed_max_size ** 2, hidden_size) * 0.1)
        self.register_length = register_length
        if register_length:
            self.register = torch.nn.Parameter(torch.randn(1, register_length, hidden_size) * 0.1)
        self.joint_blocks = torch.nn.ModuleList(
            [JointBlock(hidden_size, num_heads, pre_only=i == depth - 1,
                        x_block_self_attn=i in x_block_self_attn_layers) for i in range(depth)])
        self.final_layer = torch.nn.Linear(hidden_size, patch_size * patch_size * in_channels)

    def cropped_pos_embed(self, hw):
        p = self.x_embedder.patch_size[0]
        h, w = (hw[0] + 1) // p, (hw[1] + 1) // p
        m = self.pos_embed_max_size
        top, left = (m - h) // 2, (m - w) // 2
        return self.pos_embed.reshape(1, m, m, -1)[:, top:top + h, left:left + w].flatten(1, 2)

    def forward_core_with_concat(self, x, c_mod, context=None, control=None,
                                 transformer_options={}):  # noqa: B006
        if self.register_length > 0:
            context = torch.cat((self.register.repeat(x.shape[0], 1, 1), context), 1)
        for block in self.joint_blocks:
            context, x = block(context, x, c=c_mod, use_checkpoint=False,
                               transformer_options=transformer_options)
        return self.final_layer(x)

    def forward(self, x, t, y=None, context=None, control=None,
                transformer_options={}):  # noqa: B006
        hw = x.shape[-2:]
        x = self.x_embedder(x) + self.cropped_pos_embed(hw)
        half = torch.exp(-math.log(10000) * torch.arange(8) / 8)
        tt = t.float()[:, None] * half[None]
        c = self.t_embedder(torch.cat([tt.cos(), tt.sin()], -1))
        if y is not None and self.y_embedder is not None:
            c = c + self.y_embedder(y)
        context = self.context_embedder(context)
        x = self.forward_core_with_concat(x, c, context, control, transformer_options)
        p = self.x_embedder.patch_size[0]
        h, w = (hw[0] + 1) // p, (hw[1] + 1) // p
        x = x.reshape(x.shape[0], h, w, p, p, self.out_channels).permute(0, 5, 1, 3, 2, 4)
        return x.reshape(x.shape[0], self.out_channels, h * p, w * p)[:, :, :hw[-2], :hw[-1]]


class OpenAISignatureMMDITWrapper(MMDiT):
    def forward(self, x, timesteps, context=None, y=None, control=None,
                transformer_options={}, **kwargs):  # noqa: B006
        return super().forward(x, timesteps, context=context, y=y, control=control,
                               transformer_options=transformer_options)
