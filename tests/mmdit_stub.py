"""A stand-in of the SD3 model A1111 1.10 runs (``modules.models.sd3.mmdit.MMDiT``, Stability's
reference MMDiT), written from its observed structure and call contract, not its code:

- ``MMDiT(x, t, y=None, context=None)``: ``x_embedder`` (a patch embedding with a
  ``patch_size`` pair) turns the latent ``[B, C, H, W]`` into image tokens, ``joint_blocks``
  run as ``block(context, x, c=c_mod)`` and return ``(context, x)``, then the tokens are
  unpatchified;
- a joint block has a ``context_block`` and an ``x_block``; each block's
  ``attn.pre_attention(tokens)`` returns q and k as ``[B, S, heads * D]`` and v as ``[B, S,
  heads, D]`` (A1111's ``split_qkv`` reshapes all three; only q and k, normed, are flattened
  again); the joint sequence is ``[context, x]``, attended by a module-level ``attention(q, k,
  v, heads)`` that views each of q, k, v with its own length and q's head width;
  ``attn.post_attention`` projects the output.
"""

import torch
import torch.nn.functional as F


def attention(q, k, v, heads):
    b, d = q.shape[0], q.shape[-1] // heads
    q, k, v = (t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class SelfAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads = heads
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def pre_attention(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return q, k, v.unflatten(-1, (self.num_heads, -1))

    def post_attention(self, x):
        return self.proj(x)


class DismantledBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = SelfAttention(dim, heads)
        self.norm = torch.nn.LayerNorm(dim)
        self.mod = torch.nn.Linear(dim, dim)

    def pre_attention(self, x, c):
        return self.attn.pre_attention(self.norm(x) * (1 + self.mod(c)[:, None])), x

    def post_attention(self, attn, x):
        return x + self.attn.post_attention(attn)


class JointBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.context_block, self.x_block = DismantledBlock(dim, heads), DismantledBlock(dim, heads)

    def forward(self, context, x, c):
        cq, c_res = self.context_block.pre_attention(context, c)
        xq, x_res = self.x_block.pre_attention(x, c)
        q, k, v = (torch.cat((a, b), dim=1) for a, b in zip(cq, xq))
        out = attention(q, k, v, self.x_block.attn.num_heads)
        n = context.shape[1]
        return (self.context_block.post_attention(out[:, :n], c_res),
                self.x_block.post_attention(out[:, n:], x_res))


class PatchEmbed(torch.nn.Module):
    def __init__(self, channels, dim, patch):
        super().__init__()
        self.patch_size = (patch, patch)
        self.proj = torch.nn.Conv2d(channels, dim, patch, stride=patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class MMDiT(torch.nn.Module):
    def __init__(self, channels=4, dim=16, heads=2, depth=2, context_dim=12, patch=2):
        super().__init__()
        self.patch, self.channels = patch, channels
        self.x_embedder = PatchEmbed(channels, dim, patch)
        self.t_embedder = torch.nn.Linear(1, dim)
        self.context_embedder = torch.nn.Linear(context_dim, dim)
        self.joint_blocks = torch.nn.ModuleList([JointBlock(dim, heads) for _ in range(depth)])
        self.final_layer = torch.nn.Linear(dim, patch * patch * channels)

    def forward(self, x, t, y=None, context=None):
        b, _, hh, ww = x.shape
        h, w = hh // self.patch, ww // self.patch
        tokens = self.x_embedder(x)
        c = self.t_embedder(t.float()[:, None] / 1000)
        context = self.context_embedder(context)
        for block in self.joint_blocks:
            context, tokens = block(context, tokens, c=c)
        out = self.final_layer(tokens).view(b, h, w, self.channels, self.patch, self.patch)
        return out.permute(0, 3, 1, 4, 2, 5).reshape(b, self.channels, hh, ww)
