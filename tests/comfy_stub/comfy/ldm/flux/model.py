"""``comfy.ldm.flux.model.Flux`` as ComfyUI 0.8.0 behaves (tiny width; written from its
observed behaviour): ``forward(x, timestep, context, y, guidance, ref_latents, control,
transformer_options, **kwargs)`` runs the ``diffusion_model`` wrappers (with these positional
arguments) around ``_forward``, which packs the latent ``[B, C, H, W]`` 2x2 into image tokens
(padded to even sides; ``ceil(H/2) x ceil(W/2)`` tokens, row-major), appends each reference
latent's tokens after them (Kontext: ids with first axis 1), and runs ``[text, image, refs]``
through the double blocks, then the single blocks. Per block ``transformer_options`` gets
``total_blocks``, ``block_type`` ("double"/"single") and ``block_index`` (written in place);
the blocks never call attn1 patches (0.8.0) and reach attention only through
``comfy.ldm.flux.math.attention`` (queries and keys rotated first).

``attn1_patches=True`` is upstream ComfyUI's later Flux (PR #12861, as public custom nodes
quote it): before attention each block calls every ``attn1_patch`` as ``p(q, k, v, pe=pe,
attn_mask=mask, extra_options=options)`` with ``options["img_slice"] = [text, total]`` and
reads back ``q``, ``k``, ``v``, ``pe``, ``attn_mask`` from the returned dict.

``global_modulation=True`` is Flux 2 (dev, Klein): one modulation for all blocks
(``double_stream_modulation_img``/``_txt``, ``single_stream_modulation``), built with
``patch_size=1`` over its 128-channel latent at 1/16 of the image (one token per latent
pixel); its reference latents follow the image as Kontext's do."""

import math

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, attention, timestep_embedding


def _heads(t, heads):
    b, s, _ = t.shape
    return t.view(b, s, 3, heads, -1).permute(2, 0, 3, 1, 4)


def _attention(q, k, v, pe, mask, options, calls_patches):
    """Upstream's attn1 patch loop (only where the model calls patches), then attention."""
    patches = options.get("patches", {}).get("attn1_patch", []) if calls_patches else []
    if patches:
        extra = options
        for p in patches:
            out = p(q, k, v, pe=pe, attn_mask=mask, extra_options=extra)
            q, k, v = out.get("q", q), out.get("k", k), out.get("v", v)
            pe, mask = out.get("pe", pe), out.get("attn_mask", mask)
    return attention(q, k, v, pe=pe, mask=mask, transformer_options=options)


class DoubleStreamBlock(torch.nn.Module):
    def __init__(self, dim, heads, calls_patches=False, flipped_img_txt=False):
        super().__init__()
        self.num_heads, self.calls_patches = heads, calls_patches
        self.flipped_img_txt = flipped_img_txt  # HunyuanVideo's [image, text] (0.8.0)
        self.img_qkv, self.txt_qkv = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, 3 * dim)
        self.img_proj, self.txt_proj = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.img_mlp, self.txt_mlp = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, img, txt, vec, pe, attn_mask=None, transformer_options={}):  # noqa: B006
        iq, ik, iv = _heads(self.img_qkv(F.layer_norm(img, img.shape[-1:]) + vec), self.num_heads)
        tq, tk, tv = _heads(self.txt_qkv(F.layer_norm(txt, txt.shape[-1:]) + vec), self.num_heads)
        if self.flipped_img_txt:
            q, k, v = torch.cat((iq, tq), 2), torch.cat((ik, tk), 2), torch.cat((iv, tv), 2)
            attn = _attention(q, k, v, pe, attn_mask, transformer_options, False)
            img_attn, txt_attn = attn[:, :img.shape[1]], attn[:, img.shape[1]:]
        else:
            q, k, v = torch.cat((tq, iq), 2), torch.cat((tk, ik), 2), torch.cat((tv, iv), 2)
            if self.calls_patches:
                transformer_options["img_slice"] = [txt.shape[1], q.shape[2]]
            attn = _attention(q, k, v, pe, attn_mask, transformer_options, self.calls_patches)
            txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]
        img = img + self.img_proj(img_attn)
        img = img + self.img_mlp(F.gelu(F.layer_norm(img, img.shape[-1:])))
        txt = txt + self.txt_proj(txt_attn)
        txt = txt + self.txt_mlp(F.gelu(F.layer_norm(txt, txt.shape[-1:])))
        return img, txt


class SingleStreamBlock(torch.nn.Module):
    def __init__(self, dim, heads, calls_patches=False):
        super().__init__()
        self.num_heads, self.dim, self.calls_patches = heads, dim, calls_patches
        self.linear1 = torch.nn.Linear(dim, 4 * dim)
        self.linear2 = torch.nn.Linear(2 * dim, dim)

    def forward(self, x, vec, pe, attn_mask=None, transformer_options={}):  # noqa: B006
        qkv, mlp = torch.split(self.linear1(F.layer_norm(x, x.shape[-1:]) + vec),
                               [3 * self.dim, self.dim], dim=-1)
        q, k, v = _heads(qkv, self.num_heads)
        attn = _attention(q, k, v, pe, attn_mask, transformer_options, self.calls_patches)
        return x + self.linear2(torch.cat((attn, F.gelu(mlp)), 2))


class Flux(torch.nn.Module):
    def __init__(self, in_channels=4, context_in_dim=12, hidden_size=32, num_heads=2, depth=2,
                 depth_single_blocks=2, axes_dim=(4, 6, 6), patch_size=2, attn1_patches=False,
                 global_modulation=False):
        super().__init__()
        self.patch_size, self.out_ch = patch_size, in_channels
        self.attn1_patches = attn1_patches
        self.pe_embedder = EmbedND(axes_dim)
        self.img_in = torch.nn.Linear(in_channels * patch_size ** 2, hidden_size)
        self.txt_in = torch.nn.Linear(context_in_dim, hidden_size)
        self.time_in = torch.nn.Linear(16, hidden_size)
        self.double_blocks = torch.nn.ModuleList(
            [DoubleStreamBlock(hidden_size, num_heads, attn1_patches) for _ in range(depth)])
        self.single_blocks = torch.nn.ModuleList(
            [SingleStreamBlock(hidden_size, num_heads, attn1_patches)
             for _ in range(depth_single_blocks)])
        self.final_layer = torch.nn.Linear(hidden_size, in_channels * patch_size ** 2)
        if global_modulation:  # Flux 2: one modulation, added to every block's vector
            self.double_stream_modulation_img = torch.nn.Linear(hidden_size, hidden_size)
            self.double_stream_modulation_txt = torch.nn.Linear(hidden_size, hidden_size)
            self.single_stream_modulation = torch.nn.Linear(hidden_size, hidden_size)

    def forward_orig(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None,
                     control=None, transformer_options={}, attn_mask=None):  # noqa: B006
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 16).to(img.dtype))[:, None]
        if hasattr(self, "double_stream_modulation_img"):
            vec = vec + self.double_stream_modulation_img(vec)
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
        transformer_options["total_blocks"] = len(self.double_blocks)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.double_blocks):
            transformer_options["block_index"] = i
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask,
                             transformer_options=transformer_options)
        img = torch.cat((txt, img), 1)
        if self.attn1_patches:
            transformer_options["img_slice"] = [txt.shape[1], img.shape[1]]
        transformer_options["total_blocks"] = len(self.single_blocks)
        transformer_options["block_type"] = "single"
        for i, block in enumerate(self.single_blocks):
            transformer_options["block_index"] = i
            img = block(img, vec=vec, pe=pe, attn_mask=attn_mask,
                        transformer_options=transformer_options)
        return self.final_layer(img[:, txt.shape[1]:])

    def process_img(self, x, index=0, h_offset=0, w_offset=0):
        b, c, h, w = x.shape
        p = self.patch_size
        x = F.pad(x, (0, (p - w % p) % p, 0, (p - h % p) % p), mode="circular")
        hh, ww = x.shape[-2] // p, x.shape[-1] // p
        img = x.view(b, c, hh, p, ww, p).permute(0, 2, 4, 1, 3, 5).reshape(b, hh * ww, c * p * p)
        h_offset, w_offset = (h_offset + p // 2) // p, (w_offset + p // 2) // p
        ids = torch.zeros(hh, ww, 3)
        ids[..., 0] = index
        ids[..., 1] = torch.arange(hh, dtype=torch.float32)[:, None] + h_offset
        ids[..., 2] = torch.arange(ww, dtype=torch.float32)[None] + w_offset
        return img, ids.reshape(1, hh * ww, 3).expand(b, -1, -1)

    def forward(self, x, timestep, context, y=None, guidance=None, ref_latents=None,
                control=None, transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, y, guidance, ref_latents, control, transformer_options,
                  **kwargs)

    def _forward(self, x, timestep, context, y=None, guidance=None, ref_latents=None,
                 control=None, transformer_options={}, **kwargs):  # noqa: B006
        b, c, h_orig, w_orig = x.shape
        p = self.patch_size
        h_len, w_len = (h_orig + p // 2) // p, (w_orig + p // 2) // p
        img, img_ids = self.process_img(x)
        tokens = img.shape[1]
        if ref_latents is not None:
            h = w = 0
            for ref in ref_latents:  # the "offset" method: index 1, placed beside each other
                h_offset = w_offset = 0
                if ref.shape[-2] + h > ref.shape[-1] + w:
                    w_offset = w
                else:
                    h_offset = h
                h, w = max(h, ref.shape[-2] + h_offset), max(w, ref.shape[-1] + w_offset)
                kontext, kontext_ids = self.process_img(ref, 1, h_offset, w_offset)
                img = torch.cat([img, kontext], dim=1)
                img_ids = torch.cat([img_ids, kontext_ids], dim=1)
        txt_ids = torch.zeros(b, context.shape[1], 3)
        out = self.forward_orig(img, img_ids, context, txt_ids, timestep, y, guidance, control,
                                transformer_options, attn_mask=kwargs.get("attention_mask"))
        out = out[:, :tokens].view(b, h_len, w_len, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(b, c, h_len * p, w_len * p)[:, :, :h_orig, :w_orig]


def tokens(h, w, patch=2):
    """Image tokens of a latent of ``h x w``."""
    return math.ceil(h / patch) * math.ceil(w / patch)
