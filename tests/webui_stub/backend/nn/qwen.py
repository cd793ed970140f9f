"""``backend.nn.qwen``: Forge Neo's Qwen-Image at tiny width.

Faithful to Neo 2.26 where the ToMe swap meets it: ``attention_function`` is bound by name at
import and called as ``attention_function(q, k, v, heads, attention_mask)`` (the mask
positional, None in practice) with ``[B, S, heads * D]`` queries and keys **already rotated**;
the joint sequence is ``[text, image, references]``; no ``transformer_options`` and no
``block_index`` reach it; the latent is ``[B, C, 1, H, W]`` (patch 2, padded). Our own layers.
"""

import torch
from torch import nn

from backend.args import dynamic_args
from backend.attention import attention_function
from backend.nn.flux import EmbedND, apply_rope1, timestep_embedding
from backend.utils import pad_to_patch_size


class QwenImageTransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.img_qkv, self.txt_qkv = nn.Linear(dim, 3 * dim), nn.Linear(dim, 3 * dim)
        self.img_out, self.txt_out = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mod = nn.Linear(dim, 2 * dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                attention_mask=None):
        shift, scale = self.mod(temb)[:, None].chunk(2, -1)
        img = nn.functional.layer_norm(hidden_states, hidden_states.shape[-1:]) * (1 + scale)
        q, k, v = (torch.cat([t, i], 1) for t, i in zip(
            self.txt_qkv(encoder_hidden_states).unflatten(-1, (3, self.heads, -1)).unbind(2),
            self.img_qkv(img + shift).unflatten(-1, (3, self.heads, -1)).unbind(2)))
        q, k = apply_rope1(q, image_rotary_emb), apply_rope1(k, image_rotary_emb)
        out = attention_function(q.flatten(2), k.flatten(2), v.flatten(2), self.heads,
                                 attention_mask)
        txt = encoder_hidden_states.shape[1]
        return (encoder_hidden_states + self.txt_out(out[:, :txt]),
                hidden_states + self.img_out(out[:, txt:]))


class QwenImageTransformer2DModel(nn.Module):
    def __init__(self, in_channels=16, dim=32, num_heads=2, num_layers=2,
                 joint_attention_dim=32, patch_size=2, axes_dims_rope=(4, 6, 6)):
        super().__init__()
        self.patch_size, self.out_channels = patch_size, in_channels
        self.pe_embedder = EmbedND(10000, axes_dims_rope)
        self.img_in = nn.Linear(in_channels * 4, dim)
        self.txt_in = nn.Linear(joint_attention_dim, dim)
        self.time_in = nn.Linear(256, dim)
        self.transformer_blocks = nn.ModuleList([QwenImageTransformerBlock(dim, num_heads)
                                                 for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, in_channels * 4)

    def process_img(self, x, index=0):
        x = pad_to_patch_size(x, (1, 2, 2))[:, :, 0]
        b, c, h, w = x.shape
        img = x.unflatten(3, (w // 2, 2)).unflatten(2, (h // 2, 2)).permute(0, 2, 4, 1, 3, 5)
        ids = torch.zeros(h // 2, w // 2, 3)
        ids[..., 0] = index
        ids[..., 1] = torch.arange(h // 2, dtype=torch.float32)[:, None] - h // 4
        ids[..., 2] = torch.arange(w // 2, dtype=torch.float32)[None, :] - w // 4
        return img.flatten(3).flatten(1, 2), ids.flatten(0, 1).expand(b, -1, -1)

    def forward(self, x, timesteps, context, attention_mask=None, ref_latents=None,
                transformer_options={}, **kwargs):  # noqa: B006 (as Neo)
        b, _, _, h, w = x.shape
        img, img_ids = self.process_img(x)
        tokens = img.shape[1]
        for i, ref in enumerate(ref_latents or dynamic_args.ref_latents):
            more, more_ids = self.process_img(ref.to(x).expand(b, -1, -1, -1, -1), index=i + 1)
            img, img_ids = torch.cat([img, more], 1), torch.cat([img_ids, more_ids], 1)
        start = max(-(-h // 2), -(-w // 2)) // 2
        txt_ids = (torch.arange(context.shape[1], dtype=torch.float32) + start)[None, :, None]
        pe = self.pe_embedder(torch.cat([txt_ids.expand(b, -1, 3), img_ids], 1))
        pe = pe.squeeze(1).unsqueeze(2)  # [B, S, 1, D/2, 2, 2]
        img, txt = self.img_in(img), self.txt_in(context)
        temb = self.time_in(timestep_embedding(timesteps, 256))
        for block in self.transformer_blocks:
            txt, img = block(img, txt, temb, pe)
        out = self.proj_out(img[:, :tokens])
        hp, wp = -(-h // 2), -(-w // 2)
        out = out.unflatten(2, (-1, 2, 2)).unflatten(1, (hp, wp)).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, -1, 1, hp * 2, wp * 2)[..., :h, :w]
