"""``comfy.ldm.kandinsky5.model.Kandinsky5`` (Kandinsky 5 video and image) as ComfyUI 0.8.0
and v0.30.0 behave (the same in both; tiny width; written from their observed behaviour,
not their code).

``forward(x, timestep, context, y, time_dim_replace=None, transformer_options=, **kwargs)``
runs the ``diffusion_model`` wrappers around ``_forward``: a 4-D latent (the image model)
gets a frame axis; the latent ``[B, C, T, H, W]`` is padded to ``patch_size`` ``(1, 2, 2)``
and cut into frame-major tokens. First the text blocks (``text_transformer_blocks``): a
self-attention over the text alone; then the visual blocks (``visual_transformer_blocks``,
``transformer_options`` with ``block_type`` "double" and ``block_index``): a self-attention
over the visual tokens alone, a cross-attention to the text. Each attention is
``optimized_attention(q, k, v, heads=heads, skip_reshape=True, transformer_options=...)``
with ``[B, heads, S, D]`` (queries and keys rotated in the self-attentions), no mask."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention


def attention(q, k, v, heads, transformer_options={}):  # noqa: B006
    return optimized_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               heads=heads, skip_reshape=True,
                               transformer_options=transformer_options)


class SelfAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads = heads
        self.to_query, self.to_key = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.to_value, self.out_layer = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x, freqs, transformer_options={}):  # noqa: B006
        q, k = (apply_rope1(F.normalize(p(x).unflatten(-1, (self.num_heads, -1)), dim=-1)
                            .transpose(1, 2), freqs).transpose(1, 2)
                for p in (self.to_query, self.to_key))
        v = self.to_value(x).unflatten(-1, (self.num_heads, -1))
        return self.out_layer(attention(q, k, v, self.num_heads, transformer_options))


class CrossAttention(SelfAttention):
    def forward(self, x, context, transformer_options={}):  # noqa: B006
        q = F.normalize(self.to_query(x).unflatten(-1, (self.num_heads, -1)), dim=-1)
        k = F.normalize(self.to_key(context).unflatten(-1, (self.num_heads, -1)), dim=-1)
        v = self.to_value(context).unflatten(-1, (self.num_heads, -1))
        return self.out_layer(attention(q, k, v, self.num_heads, transformer_options))


class TransformerEncoderBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attention = SelfAttention(dim, heads)
        self.feed_forward = torch.nn.Linear(dim, dim)

    def forward(self, x, time_embed, freqs, transformer_options={}):  # noqa: B006
        x = x + self.self_attention(F.layer_norm(x, x.shape[-1:]), freqs, transformer_options)
        return x + self.feed_forward(F.gelu(F.layer_norm(x, x.shape[-1:])))


class TransformerDecoderBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attention = SelfAttention(dim, heads)
        self.cross_attention = CrossAttention(dim, heads)
        self.feed_forward = torch.nn.Linear(dim, dim)
        self.visual_modulation = torch.nn.Linear(dim, dim)

    def forward(self, visual_embed, text_embed, time_embed, freqs, transformer_options={}):  # noqa: B006
        x = visual_embed
        h = F.layer_norm(x, x.shape[-1:]) * (1 + self.visual_modulation(time_embed)[:, None])
        x = x + self.self_attention(h, freqs, transformer_options)
        x = x + self.cross_attention(F.layer_norm(x, x.shape[-1:]), text_embed,
                                     transformer_options)
        return x + self.feed_forward(F.gelu(F.layer_norm(x, x.shape[-1:])))


class Kandinsky5(torch.nn.Module):
    def __init__(self, in_visual_dim=4, in_text_dim=12, model_dim=32, heads=2,
                 patch_size=(1, 2, 2), num_text_blocks=1, num_visual_blocks=2):
        super().__init__()
        self.patch_size, self.in_visual_dim = patch_size, in_visual_dim
        self.visual_embeddings = torch.nn.Linear(in_visual_dim * 4, model_dim)
        self.text_embeddings = torch.nn.Linear(in_text_dim, model_dim)
        self.time_embeddings = torch.nn.Linear(16, model_dim)
        self.text_transformer_blocks = torch.nn.ModuleList(
            [TransformerEncoderBlock(model_dim, heads) for _ in range(num_text_blocks)])
        self.visual_transformer_blocks = torch.nn.ModuleList(
            [TransformerDecoderBlock(model_dim, heads) for _ in range(num_visual_blocks)])
        self.out_layer = torch.nn.Linear(model_dim, in_visual_dim * 4)
        d = model_dim // heads
        self.rope_embedder_3d = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])
        self.rope_embedder_1d = EmbedND([d])

    def forward(self, x, timestep, context, y=None, time_dim_replace=None,
                transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, y, time_dim_replace=time_dim_replace,
                  transformer_options=transformer_options, **kwargs)

    def _forward(self, x, timestep, context, y=None, time_dim_replace=None,
                 transformer_options={}, **kwargs):  # noqa: B006
        image = x.dim() == 4
        if image:
            x = x.unsqueeze(2)
        b, c, t, h, w = x.shape
        x = F.pad(x, (0, w % 2, 0, h % 2, 0, 0), mode="replicate")
        hh, ww = x.shape[-2] // 2, x.shape[-1] // 2
        visual = self.visual_embeddings(x.view(b, c, t, hh, 2, ww, 2)
                                        .permute(0, 2, 3, 5, 1, 4, 6).flatten(4).flatten(1, 3))
        ids = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(hh), torch.arange(ww),
                                         indexing="ij"), -1).reshape(1, -1, 3).float()
        freqs = self.rope_embedder_3d(ids)
        freqs_text = self.rope_embedder_1d(torch.arange(context.shape[1]).float()[None, :, None])
        time_embed = self.time_embeddings(timestep_embedding(timestep.flatten(), 16,
                                                             time_factor=1.0))
        text = self.text_embeddings(context)
        for block in self.text_transformer_blocks:
            text = block(text, time_embed, freqs_text, transformer_options=transformer_options)
        transformer_options["total_blocks"] = len(self.visual_transformer_blocks)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.visual_transformer_blocks):
            transformer_options["block_index"] = i
            visual = block(visual, text, time_embed, freqs,
                           transformer_options=transformer_options)
        out = self.out_layer(visual).view(b, t, hh, ww, c, 2, 2)
        out = out.permute(0, 4, 1, 2, 5, 3, 6).reshape(b, c, t, hh * 2, ww * 2)[..., :h, :w]
        return out.squeeze(2) if image else out
