"""``comfy.ldm.omnigen.omnigen2.OmniGen2Transformer2DModel`` as ComfyUI 0.8.0 and v0.30.0
behave (the same calls in both; tiny width, written from its public source's structure and
call shapes, not its code).

- ``forward(x, timesteps, context, num_tokens, ref_latents=None, attention_mask=None,
  transformer_options={}, **kwargs)``; no ``diffusion_model`` wrappers. The latent and
  each reference latent are padded to the patch and packed ``p x p`` (``ceil(H/p) x
  ceil(W/p)`` tokens, row-major).
- Refiners first, each its own self-attention: ``context_refiner`` over the text (its mask),
  ``noise_refiner`` over the image alone, ``ref_image_refiner`` over the references alone;
  then ``layers`` (one stream) over **[text, references, image]** with no mask.
- Attention: ``optimized_attention_masked(q, k, v, heads, mask, skip_reshape=True,
  transformer_options=...)`` with ``[B, heads, S, D]`` (fewer key heads in the real model,
  ``enable_gqa``; the same here), queries and keys rotated first (left out here); no
  ``block_type`` / ``block_index``. The timestep is the sigma (the model takes ``1 - t``).
"""

import math

import torch
import torch.nn.functional as F

from comfy.ldm.modules.attention import optimized_attention_masked


class OmniGen2TransformerBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, attention_mask, image_rotary_emb, temb=None,
                transformer_options={}):  # noqa: B006 (as ComfyUI)
        x = F.layer_norm(hidden_states, hidden_states.shape[-1:])
        if temb is not None:
            x = x + temb[:, None]
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, -1))
        o = optimized_attention_masked(q, k, v, self.heads, attention_mask, skip_reshape=True,
                                       transformer_options=transformer_options)
        return hidden_states + self.out(o)


class OmniGen2Transformer2DModel(torch.nn.Module):
    def __init__(self, in_channels=4, dim=32, heads=2, num_layers=2, num_refiner_layers=1,
                 patch_size=2, text_feat_dim=12):
        super().__init__()
        self.patch_size, self.out_channels = patch_size, in_channels
        self.x_embedder = torch.nn.Linear(patch_size * patch_size * in_channels, dim)
        self.ref_image_patch_embedder = torch.nn.Linear(patch_size * patch_size * in_channels,
                                                        dim)
        self.caption = torch.nn.Linear(text_feat_dim, dim)
        self.t_embedder = torch.nn.Linear(16, dim)

        def blocks(n):
            return torch.nn.ModuleList([OmniGen2TransformerBlock(dim, heads) for _ in range(n)])
        self.noise_refiner, self.ref_image_refiner = blocks(num_refiner_layers), \
            blocks(num_refiner_layers)
        self.context_refiner, self.layers = blocks(num_refiner_layers), blocks(num_layers)
        self.norm_out = torch.nn.Linear(dim, patch_size * patch_size * in_channels)

    def _pack(self, x):
        p = self.patch_size
        x = F.pad(x, (0, (p - x.shape[-1] % p) % p, 0, (p - x.shape[-2] % p) % p))
        b, c, h, w = x.shape
        return x.view(b, c, h // p, p, w // p, p).permute(0, 2, 4, 3, 5, 1) \
            .reshape(b, (h // p) * (w // p), -1), (h, w)

    def forward(self, x, timesteps, context, num_tokens=None, ref_latents=None,
                attention_mask=None, transformer_options={}, **kwargs):  # noqa: B006
        b, c, h, w = x.shape
        half = torch.exp(-math.log(10000) * torch.arange(8) / 8)
        tt = (1.0 - timesteps.float())[:, None] * 1000 * half[None]
        temb = self.t_embedder(torch.cat([tt.cos(), tt.sin()], -1))
        text = self.caption(context)
        img, (hp, wp) = self._pack(x)
        img = self.x_embedder(img)
        for layer in self.context_refiner:
            text = layer(text, attention_mask, None, transformer_options=transformer_options)
        for layer in self.noise_refiner:
            img = layer(img, None, None, temb, transformer_options=transformer_options)
        tokens = img.shape[1]
        if ref_latents is not None:
            refs = torch.cat([self.ref_image_patch_embedder(self._pack(r)[0])
                              for r in ref_latents], 1)
            for layer in self.ref_image_refiner:
                refs = layer(refs, None, None, temb, transformer_options=transformer_options)
            img = torch.cat([refs, img], 1)
        hidden = torch.cat([text, img], 1)
        for layer in self.layers:
            hidden = layer(hidden, None, None, temb, transformer_options=transformer_options)
        p = self.patch_size
        out = self.norm_out(hidden[:, -tokens:]).view(b, hp // p, wp // p, p, p, c)
        out = out.permute(0, 5, 1, 3, 2, 4).reshape(b, c, hp, wp)
        return -out[:, :, :h, :w]
