"""``comfy.ldm.cogvideo.model.CogVideoXTransformer3DModel`` (CogVideoX 1.0 and 1.5, new in
ComfyUI v0.30.0; 0.8.0 has none) as it behaves (tiny width; written from its observed
behaviour, not its code).

``forward(x, timestep, context, ofs=None, transformer_options=None, **kwargs)`` runs the
``diffusion_model`` wrappers around ``_forward``: the latent ``[B, C, T, H, W]`` is padded to
``(patch_size_t or 1, patch_size, patch_size)`` and cut into frame-major tokens (CogVideoX
1.0: ``patch_size_t`` None, one token grid per latent frame; 1.5: ``patch_size_t`` 2); the
text (its whole length) goes first: each block is one joint self-attention over ``[text,
video]``, the video's queries and keys rotated, ``optimized_attention(q, k, v,
heads=heads, transformer_options=...)`` with ``[B, S, heads * D]`` and no block index."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention


class CogVideoXBlock(torch.nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.v, self.attn_out = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.ff = torch.nn.Linear(dim, dim)
        self.norm1 = torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                transformer_options=None):
        n = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], 1)
        h = F.layer_norm(x, x.shape[-1:]) * (1 + self.norm1(temb)[:, None])
        b, s, _ = h.shape
        q, k = (F.normalize(p(h).view(b, s, self.num_heads, -1), dim=-1) for p in (self.q, self.k))
        if image_rotary_emb is not None:
            q, k = (torch.cat([t[:, :n], apply_rope1(t[:, n:].transpose(1, 2), image_rotary_emb)
                               .transpose(1, 2)], 1) for t in (q, k))
        out = optimized_attention(q.reshape(b, s, -1), k.reshape(b, s, -1), self.v(h),
                                  heads=self.num_heads, transformer_options=transformer_options)
        x = x + self.attn_out(out)
        x = x + self.ff(F.gelu(F.layer_norm(x, x.shape[-1:])))
        return x[:, n:], x[:, :n]


class CogVideoXTransformer3DModel(torch.nn.Module):
    def __init__(self, in_channels=4, dim=32, num_heads=2, num_layers=2, patch_size=2,
                 patch_size_t=None, text_embed_dim=12):
        super().__init__()
        self.patch_size, self.patch_size_t, self.in_channels = patch_size, patch_size_t, in_channels
        pt = patch_size_t or 1
        self.proj = torch.nn.Linear(in_channels * patch_size * patch_size * pt, dim)
        self.text_proj = torch.nn.Linear(text_embed_dim, dim)
        self.time_embedding = torch.nn.Linear(16, dim)
        self.blocks = torch.nn.ModuleList([CogVideoXBlock(dim, num_heads)
                                           for _ in range(num_layers)])
        self.proj_out = torch.nn.Linear(dim, in_channels * patch_size * patch_size * pt)
        d = dim // num_heads
        self.rope = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])

    def forward(self, x, timestep, context, ofs=None, transformer_options=None, **kwargs):
        transformer_options = {} if transformer_options is None else transformer_options
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, ofs, transformer_options, **kwargs)

    def _forward(self, x, timestep, context, ofs=None, transformer_options=None, **kwargs):
        b, c, t, h, w = x.shape
        p, pt = self.patch_size, self.patch_size_t or 1
        x = F.pad(x, (0, (-w) % p, 0, (-h) % p, 0, (-t) % pt), mode="replicate")
        tt, hh, ww = x.shape[2] // pt, x.shape[3] // p, x.shape[4] // p
        video = self.proj(x.view(b, c, tt, pt, hh, p, ww, p).permute(0, 2, 4, 6, 1, 3, 5, 7)
                          .flatten(4).flatten(1, 3))
        text = self.text_proj(context)
        ids = torch.stack(torch.meshgrid(torch.arange(tt), torch.arange(hh), torch.arange(ww),
                                         indexing="ij"), -1).reshape(1, -1, 3).float()
        rope = self.rope(ids)
        emb = self.time_embedding(timestep_embedding(timestep.flatten(), 16, time_factor=1.0))
        for block in self.blocks:
            video, text = block(video, text, emb, rope, transformer_options=transformer_options)
        out = self.proj_out(video).view(b, tt, hh, ww, c, pt, p, p)
        out = out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, tt * pt, hh * p, ww * p)
        return out[:, :, :t, :h, :w]
