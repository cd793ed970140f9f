"""``comfy.ldm.qwen_image.model.QwenImageTransformer2DModel`` as ComfyUI 0.8.0 behaves (tiny
width; written from its observed behaviour): ``forward(x, timestep, context, attention_mask,
ref_latents, additional_t_cond, transformer_options, **kwargs)`` runs the ``diffusion_model``
wrappers around ``_forward``; the latent is 5-D ``[B, C, T, H, W]`` (T = 1 for images),
packed 2x2 into ``T x ceil(H/2) x ceil(W/2)`` tokens; each reference latent's tokens are
appended after them (the "index" method); text positions start after the image's.

Each block is joint attention over ``[text, image, refs]``: q, k, v ``[B, heads, S, D]``,
queries and keys rotated, then ``optimized_attention_masked(q, k, v, heads, mask,
transformer_options=..., skip_reshape=True)`` with the mask (None here) as the fifth
positional argument; ``transformer_options`` gets ``total_blocks``, ``block_type`` "double"
and ``block_index``."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention_masked


class Attention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_qkv, self.add_qkv = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, 3 * dim)
        self.to_out, self.to_add_out = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None,
                image_rotary_emb=None, transformer_options={}):  # noqa: B006
        b = hidden_states.shape[0]

        def split(x, proj):
            return proj(x).view(b, x.shape[1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)

        iq, ik, iv = split(hidden_states, self.to_qkv)
        tq, tk, tv = split(encoder_hidden_states, self.add_qkv)
        q = apply_rope1(torch.cat([tq, iq], 2), image_rotary_emb)
        k = apply_rope1(torch.cat([tk, ik], 2), image_rotary_emb)
        v = torch.cat([tv, iv], 2)
        out = optimized_attention_masked(q, k, v, self.heads, attention_mask,
                                         transformer_options=transformer_options,
                                         skip_reshape=True)
        n = encoder_hidden_states.shape[1]
        return self.to_out(out[:, n:]), self.to_add_out(out[:, :n])


class QwenImageTransformerBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attn = Attention(dim, heads)
        self.img_mlp, self.txt_mlp = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                transformer_options={}):  # noqa: B006
        img, txt = hidden_states, encoder_hidden_states
        a, t = self.attn(F.layer_norm(img, img.shape[-1:]) + temb,
                         F.layer_norm(txt, txt.shape[-1:]) + temb,
                         image_rotary_emb=image_rotary_emb, transformer_options=transformer_options)
        img, txt = img + a, txt + t
        img = img + self.img_mlp(F.gelu(F.layer_norm(img, img.shape[-1:])))
        txt = txt + self.txt_mlp(F.gelu(F.layer_norm(txt, txt.shape[-1:])))
        return txt, img


class QwenImageTransformer2DModel(torch.nn.Module):
    def __init__(self, patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                 attention_head_dim=16, num_attention_heads=2, joint_attention_dim=12,
                 axes_dims_rope=(4, 6, 6)):
        super().__init__()
        self.patch_size, self.out_channels = patch_size, out_channels
        dim = attention_head_dim * num_attention_heads
        self.pe_embedder = EmbedND(axes_dims_rope)
        self.img_in = torch.nn.Linear(in_channels, dim)
        self.txt_in = torch.nn.Linear(joint_attention_dim, dim)
        self.time_in = torch.nn.Linear(16, dim)
        self.transformer_blocks = torch.nn.ModuleList(
            [QwenImageTransformerBlock(dim, num_attention_heads) for _ in range(num_layers)])
        self.proj_out = torch.nn.Linear(dim, patch_size * patch_size * out_channels)

    def process_img(self, x, index=0):
        bs, c, t, h, w = x.shape
        p = self.patch_size
        x = F.pad(x, (0, (p - w % p) % p, 0, (p - h % p) % p, 0, 0), mode="circular")
        hh, ww = x.shape[-2] // p, x.shape[-1] // p
        tokens = x.view(bs, c, t, hh, p, ww, p).permute(0, 2, 3, 5, 1, 4, 6)
        tokens = tokens.reshape(bs, t * hh * ww, c * p * p)
        ids = torch.zeros(t, hh, ww, 3)
        ids[..., 0] = torch.arange(t, dtype=torch.float32).view(-1, 1, 1) if t > 1 else index
        ids[..., 1] = torch.arange(hh, dtype=torch.float32).view(1, -1, 1) - hh // 2
        ids[..., 2] = torch.arange(ww, dtype=torch.float32).view(1, 1, -1) - ww // 2
        return tokens, ids.reshape(1, -1, 3).expand(bs, -1, -1), x.shape

    def forward(self, x, timestep, context, attention_mask=None, ref_latents=None,
                additional_t_cond=None, transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, attention_mask, ref_latents, additional_t_cond,
                  transformer_options, **kwargs)

    def _forward(self, x, timesteps, context, attention_mask=None, ref_latents=None,
                 additional_t_cond=None, transformer_options={}, control=None, **kwargs):  # noqa: B006
        img, img_ids, shape = self.process_img(x)
        n = img.shape[1]
        for i, ref in enumerate(ref_latents or ()):
            kontext, kontext_ids, _ = self.process_img(ref, index=i + 1)
            img, img_ids = torch.cat([img, kontext], 1), torch.cat([img_ids, kontext_ids], 1)
        p = self.patch_size
        start = max(((x.shape[-1] + p // 2) // p) // 2, ((x.shape[-2] + p // 2) // p) // 2)
        txt_ids = torch.arange(start, start + context.shape[1], dtype=torch.float32)
        txt_ids = txt_ids.reshape(1, -1, 1).repeat(x.shape[0], 1, 3)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), 1)).to(x.dtype)
        img, txt = self.img_in(img), self.txt_in(context)
        temb = self.time_in(timestep_embedding(timesteps, 16))[:, None]
        transformer_options["total_blocks"] = len(self.transformer_blocks)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.transformer_blocks):
            transformer_options["block_index"] = i
            txt, img = block(img, txt, temb, image_rotary_emb=pe,
                             transformer_options=transformer_options)
        out = self.proj_out(img[:, :n])
        b, c, t, hh, ww = shape
        out = out.view(b, t, hh // p, ww // p, self.out_channels, p, p).permute(0, 4, 1, 2, 5, 3, 6)
        return out.reshape(b, self.out_channels, t, hh, ww)[:, :, :, :x.shape[-2], :x.shape[-1]]
