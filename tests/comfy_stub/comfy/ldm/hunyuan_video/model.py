"""``comfy.ldm.hunyuan_video.model.HunyuanVideo`` (HunyuanVideo 1.0 and 1.5) as ComfyUI 0.8.0
behaves (tiny width; written from its public source's structure and call shapes, not its
code).

- ``forward(x, timestep, context, y=None, txt_byt5=None, clip_fea=None, guidance=None,
  attention_mask=None, guiding_frame_index=None, ref_latent=None, disable_time_r=False,
  control=None, transformer_options={}, **kwargs)`` runs the ``diffusion_model`` wrappers
  around ``_forward``. The latent is ``[B, C, T, H, W]``; ``patch_size`` is a list per axis
  (``[1, 2, 2]``; 1.5: ``[1, 1, 1]``), ``img_in`` a 3-D patch embedding; image positions
  ``(t, h, w)``, text positions 0.
- The text first runs through ``txt_in`` (a token refiner: its own self-attention over the
  text tokens, ``optimized_attention(q, k, v, heads, mask=..., skip_reshape=True,
  transformer_options=...)``), then Flux's blocks from ``comfy.ldm.flux``: ``double_blocks``
  with ``flipped_img_txt=True`` (joint attention over **[image, text]**) and
  ``single_blocks`` over ``cat(image, text)``; queries and keys rotated (RoPE over the
  positions ``cat(image, text)``), ``[B, heads, S, D]`` with ``skip_reshape``; with an
  ``attention_mask`` for the text, a mask ``[1, 1, S]`` over the joint keys;
  ``block_type`` / ``block_index`` written into ``transformer_options``.
- It has Flux's ``pe_embedder``, ``double_blocks`` and ``single_blocks``.
- ``version="0.30"``: ComfyUI v0.30.0's (since its PR #12432), the same but text first:
  double blocks without the flip (``[text, image]``), single blocks over ``cat(text,
  image)``, positions ``cat(text, image)``, the mask's text part first.
- ``ref_latent`` (1.5's image to video): patched as the latent is and put just before the
  image tokens (in either version); ``byt5=True``: a ``byt5_in`` projection, whose
  ``txt_byt5`` tokens join the text (after it in 0.8.0's 1.0, before it in 1.5).
"""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, timestep_embedding
from comfy.ldm.flux.model import DoubleStreamBlock, SingleStreamBlock
from comfy.ldm.modules.attention import optimized_attention


class TokenRefiner(torch.nn.Module):
    def __init__(self, in_channels, hidden_size, heads):
        super().__init__()
        self.heads = heads
        self.input_embedder = torch.nn.Linear(in_channels, hidden_size)
        self.qkv, self.proj = torch.nn.Linear(hidden_size, 3 * hidden_size), \
            torch.nn.Linear(hidden_size, hidden_size)

    def forward(self, x, timesteps, mask, transformer_options={}):  # noqa: B006 (as ComfyUI)
        x = self.input_embedder(x)
        q, k, v = self.qkv(F.layer_norm(x, x.shape[-1:])).unflatten(-1, (3, self.heads, -1)) \
            .permute(2, 0, 3, 1, 4)
        m = None
        if mask is not None:
            m = mask.view(mask.shape[0], 1, 1, mask.shape[1]).repeat(1, 1, mask.shape[1], 1)
        attn = optimized_attention(q, k, v, self.heads, mask=m, skip_reshape=True,
                                   transformer_options=transformer_options)
        return x + self.proj(attn)


class HunyuanVideo(torch.nn.Module):
    def __init__(self, in_channels=4, hidden_size=32, num_heads=2, depth=2,
                 depth_single_blocks=1, context_in_dim=12, axes_dim=(4, 6, 6),
                 patch_size=(1, 2, 2), version="0.8.0", byt5=False):
        super().__init__()
        self.flipped = version == "0.8.0"
        self.patch_size = list(patch_size)
        self.in_channels = self.out_channels = in_channels
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.pe_embedder = EmbedND(axes_dim)
        self.img_in = torch.nn.Conv3d(in_channels, hidden_size, self.patch_size, self.patch_size)
        self.time_in = torch.nn.Linear(16, hidden_size)
        self.txt_in = TokenRefiner(context_in_dim, hidden_size, num_heads)
        self.double_blocks = torch.nn.ModuleList(
            [DoubleStreamBlock(hidden_size, num_heads, flipped_img_txt=self.flipped)
             for _ in range(depth)])
        self.byt5_in = torch.nn.Linear(context_in_dim, hidden_size) if byt5 else None
        self.single_blocks = torch.nn.ModuleList(
            [SingleStreamBlock(hidden_size, num_heads) for _ in range(depth_single_blocks)])
        self.final_layer = torch.nn.Linear(hidden_size, in_channels * self.patch_size[-1] ** 2
                                           * self.patch_size[0])

    def img_ids(self, x):
        pt, ph, pw = self.patch_size
        t, h, w = x.shape[-3] // pt, x.shape[-2] // ph, x.shape[-1] // pw
        ids = torch.zeros(t, h, w, 3)
        ids[..., 0] = torch.arange(t, dtype=torch.float32)[:, None, None]
        ids[..., 1] = torch.arange(h, dtype=torch.float32)[None, :, None]
        ids[..., 2] = torch.arange(w, dtype=torch.float32)[None, None, :]
        return ids.reshape(1, t * h * w, 3).expand(x.shape[0], -1, -1)

    def forward_orig(self, img, img_ids, txt, txt_ids, txt_mask, timesteps,
                     transformer_options={}, txt_byt5=None, ref_latent=None):  # noqa: B006
        initial_shape = list(img.shape)
        img = self.img_in(img).flatten(2).transpose(1, 2)
        refs = 0
        if ref_latent is not None:
            ref_ids = self.img_ids(ref_latent)
            ref_ids[..., 0] = -1
            ref = self.img_in(ref_latent).flatten(2).transpose(1, 2)
            img, refs = torch.cat([ref, img], 1), ref.shape[1]
            img_ids = torch.cat([ref_ids, img_ids], 1)
        vec = self.time_in(timestep_embedding(timesteps, 16, time_factor=1.0).to(img.dtype))
        vec = vec[:, None]
        if txt_mask is not None and not torch.is_floating_point(txt_mask):
            txt_mask = (txt_mask - 1).to(img.dtype) * torch.finfo(img.dtype).max
        txt = self.txt_in(txt, timesteps, txt_mask, transformer_options=transformer_options)
        if self.byt5_in is not None and txt_byt5 is not None:
            txt = torch.cat((txt, self.byt5_in(txt_byt5)), 1)
            txt_ids = torch.zeros((txt.shape[0], txt.shape[1], 3))
            if txt_mask is not None:
                txt_mask = torch.cat((txt_mask, txt_mask.new_zeros(txt_mask.shape[0],
                                                                   txt_byt5.shape[1])), 1)
        ids = (img_ids, txt_ids) if self.flipped else (txt_ids, img_ids)
        pe = self.pe_embedder(torch.cat(ids, dim=1))
        img_len, n = img.shape[1], txt.shape[1]
        attn_mask = None
        if txt_mask is not None:
            attn_mask = torch.zeros((1, 1, img_len + n), dtype=img.dtype)
            if self.flipped:
                attn_mask[:, 0, img_len:] = txt_mask
            else:
                attn_mask[:, 0, :n] = txt_mask
        transformer_options["total_blocks"] = len(self.double_blocks)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.double_blocks):
            transformer_options["block_index"] = i
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask,
                             transformer_options=transformer_options)
        img = torch.cat((img, txt) if self.flipped else (txt, img), 1)
        transformer_options["total_blocks"] = len(self.single_blocks)
        transformer_options["block_type"] = "single"
        for i, block in enumerate(self.single_blocks):
            transformer_options["block_index"] = i
            img = block(img, vec=vec, pe=pe, attn_mask=attn_mask,
                        transformer_options=transformer_options)
        img = img[:, :img_len] if self.flipped else img[:, n:]
        img = self.final_layer(img[:, refs:])
        b, c, t, h, w = initial_shape
        pt, ph, pw = self.patch_size
        img = img.reshape(b, t // pt, h // ph, w // pw, c, pt, ph, pw)
        return img.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, c, t, h, w)

    def forward(self, x, timestep, context, y=None, txt_byt5=None, clip_fea=None, guidance=None,
                attention_mask=None, guiding_frame_index=None, ref_latent=None,
                disable_time_r=False, control=None,
                transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, y, txt_byt5, clip_fea, guidance, attention_mask,
                  guiding_frame_index, ref_latent, disable_time_r, control, transformer_options,
                  **kwargs)

    def _forward(self, x, timestep, context, y=None, txt_byt5=None, clip_fea=None,
                 guidance=None, attention_mask=None, guiding_frame_index=None, ref_latent=None,
                 disable_time_r=False, control=None,
                 transformer_options={}, **kwargs):  # noqa: B006
        txt_ids = torch.zeros((x.shape[0], context.shape[1], 3))
        return self.forward_orig(x, self.img_ids(x), context, txt_ids, attention_mask,
                                 timestep, transformer_options=transformer_options,
                                 txt_byt5=txt_byt5, ref_latent=ref_latent)
