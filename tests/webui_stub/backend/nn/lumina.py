"""``backend.nn.lumina``: Forge Neo's Lumina 2 / Z-Image (``NextDiT``) at tiny width.

Faithful to Neo 2.26 where the ToMe swap meets it: ``attention_function`` is bound by name at
import and called as ``attention_function(q, k, v, heads, mask, skip_reshape=True,
transformer_options=)`` with ``[B, heads, S, D]`` queries and keys **already rotated** (keys
and values repeated to every head); the caption is padded to ``pad_tokens_multiple`` and so
is the image; the context refiner calls it on the caption alone, the noise refiner on the
image alone, the main layers on ``[caption, image, image padding]``; the model is called with
``1 - sigma`` and answers the negated output. Our own layers.
"""

import torch
from torch import nn

from backend.attention import attention_function
from backend.nn.flux import EmbedND, apply_rope, timestep_embedding
from backend.utils import pad_to_patch_size


class JointTransformerBlock(nn.Module):
    def __init__(self, dim, heads, modulation=True):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mod = nn.Linear(dim, dim) if modulation else None

    def forward(self, x, x_mask, freqs_cis, adaln_input=None, transformer_options={}):  # noqa
        h = nn.functional.layer_norm(x, x.shape[-1:])
        if self.mod is not None and adaln_input is not None:
            h = h * (1 + self.mod(adaln_input)[:, None])
        q, k, v = self.qkv(h).unflatten(-1, (3, self.heads, -1)).unbind(2)  # [B, S, H, D]
        q, k = apply_rope(q, k, freqs_cis)
        out = attention_function(q.movedim(1, 2), k.movedim(1, 2), v.movedim(1, 2), self.heads,
                                 x_mask, skip_reshape=True,
                                 transformer_options=transformer_options)
        return x + self.out(out)


class NextDiT(nn.Module):
    def __init__(self, in_channels=16, dim=32, n_heads=2, n_layers=2, n_refiner_layers=1,
                 cap_feat_dim=32, patch_size=2, axes_dims=(4, 6, 6), pad_tokens_multiple=8):
        super().__init__()
        self.patch_size, self.out_channels = patch_size, in_channels
        self.pad_tokens_multiple = pad_tokens_multiple
        self.x_embedder = nn.Linear(in_channels * patch_size ** 2, dim)
        self.cap_embedder = nn.Linear(cap_feat_dim, dim)
        self.t_embedder = nn.Linear(256, dim)
        self.x_pad_token, self.cap_pad_token = nn.Parameter(torch.zeros(1, dim)), \
            nn.Parameter(torch.zeros(1, dim))
        self.noise_refiner = nn.ModuleList([JointTransformerBlock(dim, n_heads)
                                            for _ in range(n_refiner_layers)])
        self.context_refiner = nn.ModuleList([JointTransformerBlock(dim, n_heads, False)
                                              for _ in range(n_refiner_layers)])
        self.layers = nn.ModuleList([JointTransformerBlock(dim, n_heads) for _ in range(n_layers)])
        self.final_layer = nn.Linear(dim, in_channels * patch_size ** 2)
        self.rope_embedder = EmbedND(10000, axes_dims)

    def _padded(self, x, token):
        extra = (-x.shape[1]) % self.pad_tokens_multiple
        return torch.cat([x, token.to(x)[None].expand(x.shape[0], extra, -1)], 1)

    def forward(self, x, timesteps, context, attention_mask=None,
                transformer_options={}, **kwargs):  # noqa: B006 (as Neo)
        b, _, h, w = x.shape
        p = self.patch_size
        x = pad_to_patch_size(x, (p, p))
        hp, wp = x.shape[-2] // p, x.shape[-1] // p
        t = self.t_embedder(timestep_embedding(1.0 - timesteps, 256))
        cap = self._padded(self.cap_embedder(context), self.cap_pad_token)
        img = x.unflatten(3, (wp, p)).unflatten(2, (hp, p)).permute(0, 2, 4, 3, 5, 1)
        img = self.x_embedder(img.flatten(3).flatten(1, 2))
        tokens = img.shape[1]
        img = self._padded(img, self.x_pad_token)
        ids = torch.zeros(b, cap.shape[1] + img.shape[1], 3)
        ids[:, :cap.shape[1], 0] = torch.arange(cap.shape[1], dtype=torch.float32) + 1
        ids[:, cap.shape[1]:cap.shape[1] + tokens, 0] = cap.shape[1] + 1
        image = slice(cap.shape[1], cap.shape[1] + tokens)
        ids[:, image, 1] = torch.arange(hp, dtype=torch.float32).repeat_interleave(wp)
        ids[:, image, 2] = torch.arange(wp, dtype=torch.float32).repeat(hp)
        freqs = self.rope_embedder(ids).movedim(1, 2)  # [B, S, 1, D/2, 2, 2]
        for layer in self.context_refiner:
            cap = layer(cap, attention_mask, freqs[:, :cap.shape[1]],
                        transformer_options=transformer_options)
        for layer in self.noise_refiner:
            img = layer(img, None, freqs[:, cap.shape[1]:], t,
                        transformer_options=transformer_options)
        full = torch.cat([cap, img], 1)
        for layer in self.layers:
            full = layer(full, None, freqs, t, transformer_options=transformer_options)
        out = self.final_layer(full[:, cap.shape[1]:cap.shape[1] + tokens])
        out = out.unflatten(2, (p, p, -1)).unflatten(1, (hp, wp)).permute(0, 5, 1, 3, 2, 4)
        return -out.reshape(b, -1, hp * p, wp * p)[:, :, :h, :w]
