"""``comfy.ldm.qwen_image21.model.QwenImage21Transformer2DModel`` (Qwen-Image 2.1, ComfyUI
after v0.30.0, read at Comfy-Org/ComfyUI@b8067976; tiny width, written from its behaviour,
not its code).

``forward(x, timestep, context, ref_latents=None, image_slots=None, transformer_options,
**kwargs)`` runs the ``diffusion_model`` wrappers around ``_forward``. The latent ``[B, C, H,
W]`` is one token per latent pixel (its VAE's 64 channels, no 2x2 packing), row-major. The
sequence is the text with each reference image spliced in at its slot (``image_slots``:
text positions; missing ones at the text's end), the target image last:
``[text, ref, text, ref, ..., text, target]``; its segments are each text run (a causal
mask: each text token sees everything before its run and its run up to itself), each
reference and the target.

Every block (``transformer_blocks``, all single-stream: ``block_type`` "single",
``block_index`` i) projects q, k, v ``[B, N, heads, D]``, rotates q and k, then calls
``optimized_attention(q[:, start:end].flatten(2), k[:, :end].flatten(2), v[:, :end].flatten(2),
heads, mask=..., transformer_options=..., preferred_attention=...)`` once per segment: the
queries of that segment, the keys of everything up to its end (``[B, S, heads * D]``). The
target's call is queries ``H * W``, keys the whole sequence, no mask. The model is called
with the sigma (its timestep * 1000 is the embedding's)."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.to_out = torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.mod = torch.nn.Linear(dim, dim)
        self.preferred = None  # a layer's per-checkpoint attention (ComfyAttention)

    def forward(self, x, temb, pe, segments, transformer_options):
        b, n, _ = x.shape
        h = F.layer_norm(x, x.shape[-1:]) * (1 + self.mod(temb)[:, None])
        q, k, v = (f(h).view(b, n, self.heads, -1) for f in (self.to_q, self.to_k, self.to_v))
        q, k = (apply_rope1(t.transpose(1, 2), pe).transpose(1, 2) for t in (q, k))
        outs = [optimized_attention(q[:, s:e].flatten(2), k[:, :e].flatten(2),
                                    v[:, :e].flatten(2), self.heads, mask=mask,
                                    transformer_options=transformer_options,
                                    preferred_attention=self.preferred)
                for s, e, mask in segments]
        x = x + self.to_out(torch.cat(outs, 1))
        return x + self.mlp(F.gelu(F.layer_norm(x, x.shape[-1:])))


class QwenImage21Transformer2DModel(torch.nn.Module):
    def __init__(self, in_channels=4, dim=32, heads=2, num_layers=2, context_in_dim=12):
        super().__init__()
        self.txt_in = torch.nn.Linear(context_in_dim, dim)
        self.img_in = torch.nn.Linear(in_channels, dim)
        self.time_in = torch.nn.Linear(16, dim)
        self.transformer_blocks = torch.nn.ModuleList(
            [Block(dim, heads) for _ in range(num_layers)])
        self.proj_out = torch.nn.Linear(dim, in_channels)
        d = dim // heads
        self.pe_embedder = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])

    def forward(self, x, timestep, context, ref_latents=None, image_slots=None,
                transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, ref_latents, image_slots, transformer_options,
                  **kwargs)

    def build_sequence(self, x, context, refs, slots):
        txt = self.txt_in(context)
        slots = (list(slots) + [txt.shape[1]] * len(refs))[:len(refs)]
        bounds = [0, *slots, txt.shape[1]]
        parts, ids, segments, pos, length = [], [], [], 0, 0
        for (start, end), img in zip(zip(bounds[:-1], bounds[1:]), [*refs, x]):
            n = end - start
            if n > 0:
                parts.append(txt[:, start:end])
                ids.append(torch.arange(pos, pos + n, dtype=torch.float32)[:, None].expand(n, 3))
                segments.append((length, length + n,
                                 torch.ones(n, length + n, dtype=torch.bool).tril(length)))
                pos, length = pos + n, length + n
            h, w = img.shape[-2:]
            parts.append(self.img_in(img.flatten(2).transpose(1, 2)))
            hh = torch.arange(h, dtype=torch.float32) - h // 2
            ww = torch.arange(w, dtype=torch.float32) - w // 2
            ids.append(torch.stack([torch.full((h, w), float(pos)), hh[:, None].expand(h, w),
                                    ww[None, :].expand(h, w)], -1).flatten(0, 1))
            segments.append((length, length + h * w, None))
            pos, length = pos + max(h, w), length + h * w
        pe = self.pe_embedder(torch.cat(ids, 0)[None])
        return torch.cat(parts, 1), pe, segments

    def _forward(self, x, timesteps, context, ref_latents=None, image_slots=None,
                 transformer_options={}, **kwargs):  # noqa: B006
        b, c, h, w = x.shape
        hidden, pe, segments = self.build_sequence(x, context, list(ref_latents or []),
                                                   list(image_slots or []))
        prefix = hidden.shape[1] - h * w
        temb = self.time_in(timestep_embedding(timesteps, 16))
        transformer_options["total_blocks"] = len(self.transformer_blocks)
        transformer_options["block_type"] = "single"
        for i, block in enumerate(self.transformer_blocks):
            transformer_options["block_index"] = i
            hidden = block(hidden, temb, pe, segments, transformer_options)
        return self.proj_out(hidden[:, prefix:]).transpose(1, 2).reshape(b, c, h, w)
