"""``comfy.ldm.lightricks.model.LTXVModel`` (LTX-Video) as ComfyUI 0.8.0 and v0.30.0 behave
(tiny width; written from their observed behaviour, not their code).

``forward(x, timestep, context, attention_mask, frame_rate=25, transformer_options=,
keyframe_idxs=None, denoise_mask=None, **kwargs)`` runs the ``diffusion_model`` wrappers
around ``_forward``: the latent ``[B, C, F, H, W]`` is cut into one token per latent pixel
(patch 1), frame-major; guide frames (``LTXVAddGuide``) are latent frames appended at the end,
their token positions in ``keyframe_idxs`` (``[B, 3, guide tokens, 2]``). Each block:
self-attention over the video tokens alone, queries and keys rotated, ``[B, S, heads * D]``,
``optimized_attention(q, k, v, heads, transformer_options=...)`` (no mask, no block index);
then cross-attention to the text (the conditioning's ``attention_mask``, where one is given,
as ``optimized_attention_masked(q, k, v, heads, mask, ...)`` in 0.8.0 and
``optimized_attention(q, k, v, heads, mask=mask, ...)`` in v0.30.0). v0.30.0's guide
attention (``guide_attention_entries`` with a strength other than 1, guide frames given):
the self-attention's queries split in two calls against all keys, the video's queries with
``log(strength)`` on the guide keys (``[1, 1, 1, keys]``), the guides' with it on the video
keys (``[1, 1, guide tokens, keys]``)."""

import math

import torch
import torch.nn.functional as F

import comfy.ldm.modules.attention
import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding


class GuideAttentionMask:
    def __init__(self, total, guide_start, strength):
        tracked = total - guide_start
        self.guide_start, self.tracked_count = guide_start, tracked
        self.noisy_mask = torch.zeros(1, 1, 1, total)
        self.noisy_mask[..., guide_start:] = math.log(strength)
        self.tracked_mask = torch.zeros(1, 1, tracked, total)
        self.tracked_mask[..., :guide_start] = math.log(strength)


def _attention_with_guide_mask(q, k, v, heads, mask, transformer_options):
    attention, g = comfy.ldm.modules.attention, mask.guide_start
    return torch.cat([
        attention.optimized_attention(q[:, :g], k, v, heads, mask=mask.noisy_mask,
                                      transformer_options=transformer_options),
        attention.optimized_attention(q[:, g:], k, v, heads, mask=mask.tracked_mask,
                                      transformer_options=transformer_options)], 1)


class CrossAttention(torch.nn.Module):
    def __init__(self, dim, heads, context_dim=None, version="0.8.0"):
        super().__init__()
        self.heads, self.version = heads, version
        self.to_q = torch.nn.Linear(dim, dim)
        self.to_k = torch.nn.Linear(context_dim or dim, dim)
        self.to_v = torch.nn.Linear(context_dim or dim, dim)
        self.to_out = torch.nn.Linear(dim, dim)

    def forward(self, x, context=None, mask=None, pe=None, transformer_options={}):  # noqa: B006
        context = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(context), self.to_v(context)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        if pe is not None:
            b, s, _ = q.shape
            q, k = (apply_rope1(t.view(b, s, self.heads, -1).transpose(1, 2), pe)
                    .transpose(1, 2).flatten(2) for t in (q, k))
        attention = comfy.ldm.modules.attention
        if mask is None:
            out = attention.optimized_attention(q, k, v, self.heads,
                                                transformer_options=transformer_options)
        elif isinstance(mask, GuideAttentionMask):
            out = _attention_with_guide_mask(q, k, v, self.heads, mask, transformer_options)
        elif self.version == "0.8.0":
            out = attention.optimized_attention_masked(q, k, v, self.heads, mask,
                                                       transformer_options=transformer_options)
        else:
            out = attention.optimized_attention(q, k, v, self.heads, mask=mask,
                                                transformer_options=transformer_options)
        return self.to_out(out)


class BasicTransformerBlock(torch.nn.Module):
    def __init__(self, dim, heads, context_dim, version):
        super().__init__()
        self.attn1 = CrossAttention(dim, heads, version=version)
        self.attn2 = CrossAttention(dim, heads, context_dim, version)
        self.ff = torch.nn.Linear(dim, dim)
        self.scale = torch.nn.Linear(dim, dim)

    def forward(self, x, context=None, attention_mask=None, timestep=None, pe=None,
                transformer_options={}, self_attention_mask=None):  # noqa: B006
        h = F.layer_norm(x, x.shape[-1:]) * (1 + self.scale(timestep)[:, None])
        x = x + self.attn1(h, mask=self_attention_mask, pe=pe,
                           transformer_options=transformer_options)
        x = x + self.attn2(x, context=context, mask=attention_mask,
                           transformer_options=transformer_options)
        return x + self.ff(F.gelu(F.layer_norm(x, x.shape[-1:])))


class LTXVModel(torch.nn.Module):
    def __init__(self, in_channels=8, dim=32, heads=2, num_layers=2, caption_channels=12,
                 version="0.8.0"):
        super().__init__()
        self.patchify_proj = torch.nn.Linear(in_channels, dim)
        self.caption_projection = torch.nn.Linear(caption_channels, dim)
        self.time_proj = torch.nn.Linear(16, dim)
        self.transformer_blocks = torch.nn.ModuleList(
            [BasicTransformerBlock(dim, heads, dim, version) for _ in range(num_layers)])
        self.proj_out = torch.nn.Linear(dim, in_channels)
        self.version = version
        d = dim // heads
        self.rope = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])

    def forward(self, x, timestep, context, attention_mask=None, frame_rate=25,
                transformer_options={}, keyframe_idxs=None, denoise_mask=None, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, attention_mask, frame_rate, transformer_options,
                  keyframe_idxs, denoise_mask=denoise_mask, **kwargs)

    def _forward(self, x, timestep, context, attention_mask=None, frame_rate=25,
                 transformer_options={}, keyframe_idxs=None, denoise_mask=None, **kwargs):  # noqa: B006
        b, c, f, h, w = x.shape
        tokens = self.patchify_proj(x.flatten(2).transpose(1, 2))
        ids = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w),
                                         indexing="ij"), -1).reshape(1, -1, 3).float()
        if keyframe_idxs is not None:  # guide tokens at their own positions
            ids[:, -keyframe_idxs.shape[2]:] = keyframe_idxs[:, :, :, 0].transpose(1, 2).float()
        pe = self.rope(ids)
        t = self.time_proj(timestep_embedding(timestep.flatten(), 16, time_factor=1.0))
        context = self.caption_projection(context)
        guides, guide_mask = kwargs.get("guide_attention_entries"), None
        if self.version != "0.8.0" and guides and keyframe_idxs is not None \
                and guides[0]["strength"] != 1.0:
            guide_mask = GuideAttentionMask(tokens.shape[1],
                                            tokens.shape[1] - keyframe_idxs.shape[2],
                                            guides[0]["strength"])
        for block in self.transformer_blocks:
            tokens = block(tokens, context=context, attention_mask=attention_mask,
                           timestep=t, pe=pe, transformer_options=transformer_options,
                           self_attention_mask=guide_mask)
        return self.proj_out(tokens).transpose(1, 2).reshape(b, c, f, h, w)
