"""``backend.nn.wan``: Forge Neo's Wan 2.x video transformer at tiny width.

Faithful to Neo 2.26 where the ToMe swap meets it: the self-attention calls the module-level
``attention(q, k, v, heads=, transformer_options=)`` (a thin wrapper of
``attention_function``, there "for Radial Attention") with ``[B, S, heads * D]`` queries and
keys **already rotated** and only the video's tokens (no text: ``S`` = frames x h x w, patch
``(1, 2, 2)``, the latent padded to whole patches); the cross-attention calls
``attention_function`` directly with the text as keys; the latent is ``[B, C, T, H, W]``;
``transformer_options`` carries ``block_index``. The layers are our own.
"""

import torch
from torch import nn

from backend.attention import attention_function
from backend.nn.flux import EmbedND, apply_rope1, timestep_embedding
from backend.utils import pad_to_patch_size


def attention(*args, **kwargs):  # for Radial Attention (Neo's own comment: it swaps this)
    return attention_function(*args, **kwargs)


class WanAttentionBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.cross_q, self.cross_k, self.cross_v = (nn.Linear(dim, dim) for _ in range(3))
        self.mod = nn.Linear(dim, 2 * dim)
        self.ffn = nn.Linear(dim, dim)

    def forward(self, x, e, freqs, context, transformer_options={}):  # noqa: B006 (as Neo)
        b, s, n = x.shape[0], x.shape[1], self.heads
        shift, scale = self.mod(e)[:, None].chunk(2, -1)
        h = nn.functional.layer_norm(x, x.shape[-1:]) * (1 + scale) + shift
        q = apply_rope1(self.q(h).unflatten(-1, (n, -1)), freqs)
        k = apply_rope1(self.k(h).unflatten(-1, (n, -1)), freqs)
        x = x + self.o(attention(q.view(b, s, -1), k.view(b, s, -1), self.v(h), heads=n,
                                 transformer_options=transformer_options))
        x = x + attention_function(self.cross_q(x), self.cross_k(context), self.cross_v(context),
                                   heads=n)
        return x + self.ffn(nn.functional.gelu(x))


class WanModel(nn.Module):
    def __init__(self, in_dim=16, dim=32, num_heads=2, num_layers=2, text_dim=32,
                 patch_size=(1, 2, 2)):
        super().__init__()
        self.patch_size, self.out_dim, self.dim = tuple(patch_size), in_dim, dim
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
        self.text_embedding = nn.Linear(text_dim, dim)
        self.time_embedding = nn.Linear(256, dim)
        self.blocks = nn.ModuleList([WanAttentionBlock(dim, num_heads) for _ in range(num_layers)])
        self.head = nn.Linear(dim, in_dim * int(torch.tensor(patch_size).prod()))
        d = dim // num_heads
        self.rope_embedder = EmbedND(10000.0, [d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])

    def forward(self, x, timestep, context, transformer_options={}, **kwargs):  # noqa: B006
        b, _, t, h, w = x.shape
        x = pad_to_patch_size(x, self.patch_size)
        x = self.patch_embedding(x)
        grid = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        ids = torch.stack(torch.meshgrid(*(torch.arange(g, dtype=torch.float32) for g in grid),
                                         indexing="ij"), -1).reshape(1, -1, 3).expand(b, -1, -1)
        freqs = self.rope_embedder(ids).movedim(1, 2)  # [B, S, 1, D/2, 2, 2]
        e = self.time_embedding(timestep_embedding(timestep, 256, time_factor=1.0))
        context = self.text_embedding(context)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            x = block(x, e=e, freqs=freqs, context=context,
                      transformer_options=transformer_options)
        pt, ph, pw = self.patch_size
        out = self.head(x).reshape(b, *grid, pt, ph, pw, self.out_dim)
        out = torch.einsum("bfhwpqrc->bcfphqwr", out).reshape(
            b, self.out_dim, grid[0] * pt, grid[1] * ph, grid[2] * pw)
        return out[:, :, :t, :h, :w]
