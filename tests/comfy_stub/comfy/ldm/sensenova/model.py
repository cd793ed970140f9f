"""``comfy.ldm.sensenova.model.SenseNovaU15`` (SenseNova-U1.5, ComfyUI after v0.30.0, read at
Comfy-Org/ComfyUI@ec0c6b63; tiny width, written from its behaviour, not its code).

A language model that generates an image: ``forward(x, timesteps, context, transformer_options,
text_input_ids=None, prefix_keys=None, prefix_values=None, ...)`` runs the ``diffusion_model``
wrappers around ``_forward``. ``x`` is the image in pixels ``[B, 3, H, W]``, padded (to 16 a
side, replicated, then to a multiple of 32) and cut into 32 x 32 pixel tokens, row-major.
The prefix (the prompt's ``text_input_ids``, ``P`` tokens) runs through each layer with a
causal mask; the image queries then attend to ``[prefix keys, image keys]``. A precomputed
prefix (``prefix_keys``/``prefix_values``, per layer ``[B, kv heads, P, D]``) skips the
prefix's own calls.

Every layer (``language_model.model.layers``, ``block_index`` i, no ``block_type``) calls
``optimized_attention(q, k, v, heads, mask=..., skip_reshape=True, transformer_options=...,
enable_gqa=True)``: ``[B, heads, S, D]`` queries, keys and values with fewer heads (grouped
queries), rotated first: the prefix's call (``P`` queries and keys, causal mask), then the
image's (``h * w`` queries, ``P + h * w`` keys, no mask)."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention

PATCH = 32


class Attention(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.heads, self.kv_heads, d = heads, kv_heads, dim // heads
        self.q, self.q_gen = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.kv, self.kv_gen = (torch.nn.Linear(dim, 2 * kv_heads * d) for _ in range(2))
        self.o, self.o_gen = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def project(self, x, pe, gen):
        b, n, _ = x.shape
        q = (self.q_gen if gen else self.q)(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = ((self.kv_gen if gen else self.kv)(x).view(b, n, 2, self.kv_heads, -1)
                .permute(2, 0, 3, 1, 4))
        return apply_rope1(q, pe), apply_rope1(k, pe), v

    def prefix(self, x, pe, mask, options):
        q, k, v = self.project(x, pe, False)
        out = optimized_attention(q, k, v, self.heads, mask=mask, skip_reshape=True,
                                  transformer_options=options, enable_gqa=True)
        return self.o(out), k, v

    def generation(self, x, pe, pk, pv, options):
        q, k, v = self.project(x, pe, True)
        out = optimized_attention(q, torch.cat([pk, k], 2), torch.cat([pv, v], 2), self.heads,
                                  mask=None, skip_reshape=True, transformer_options=options,
                                  enable_gqa=True)
        return self.o_gen(out)


class DecoderLayer(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.self_attn = Attention(dim, heads, kv_heads)
        self.mlp, self.mlp_gen = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward_prefix(self, x, pe, mask, options):
        out, k, v = self.self_attn.prefix(F.layer_norm(x, x.shape[-1:]), pe, mask, options)
        x = x + out
        return x + self.mlp(F.gelu(F.layer_norm(x, x.shape[-1:]))), k, v

    def forward_generation(self, x, pe, pk, pv, options):
        x = x + self.self_attn.generation(F.layer_norm(x, x.shape[-1:]), pe, pk, pv, options)
        return x + self.mlp_gen(F.gelu(F.layer_norm(x, x.shape[-1:])))


class Backbone(torch.nn.Module):
    def __init__(self, dim, heads, kv_heads, layers, vocab):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            [DecoderLayer(dim, heads, kv_heads) for _ in range(layers)])


class LanguageModel(torch.nn.Module):
    def __init__(self, *args):
        super().__init__()
        self.model = Backbone(*args)


class SenseNovaU15(torch.nn.Module):
    def __init__(self, dim=32, heads=4, kv_heads=2, layers=2, vocab=50):
        super().__init__()
        self.language_model = LanguageModel(dim, heads, kv_heads, layers, vocab)
        self.patch_embed = torch.nn.Conv2d(3, dim, PATCH, stride=PATCH)
        self.time_in = torch.nn.Linear(16, dim)
        self.head = torch.nn.Linear(dim, 3 * PATCH * PATCH)
        d = dim // heads
        self.rope = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])

    def forward(self, x, timesteps, context=None, transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timesteps, context, transformer_options, **kwargs)

    def _forward(self, x, timesteps, context=None, transformer_options={},  # noqa: B006
                 text_input_ids=None, prefix_keys=None, prefix_values=None, **kwargs):
        h0, w0 = x.shape[-2:]
        if h0 < 16 or w0 < 16:
            x = F.pad(x, (0, max(16 - w0, 0), 0, max(16 - h0, 0)), mode="replicate")
        x = F.pad(x, (0, (-x.shape[-1]) % PATCH, 0, (-x.shape[-2]) % PATCH))
        b, _, hh, ww = x.shape
        th, tw = hh // PATCH, ww // PATCH
        image = self.patch_embed(x).flatten(2).transpose(1, 2)
        image = image + self.time_in(timestep_embedding(timesteps, 16))[:, None]
        layers = self.language_model.model.layers
        if prefix_keys is None:
            prefix = self.language_model.model.embed_tokens(text_input_ids)
            p = prefix.shape[1]
            mask = torch.full((p, p), float("-inf")).triu(1)
            ppe = self.rope(torch.stack([torch.arange(p, dtype=torch.float32),
                                         torch.zeros(p), torch.zeros(p)], -1)[None])
        else:
            p = prefix_keys[0].shape[2]
        rows = torch.arange(th * tw) // tw
        ipe = self.rope(torch.stack([torch.full((th * tw,), float(p)), rows.float(),
                                     (torch.arange(th * tw) % tw).float()], -1)[None])
        for i, layer in enumerate(layers):
            transformer_options["block_index"] = i
            if prefix_keys is None:
                prefix, pk, pv = layer.forward_prefix(prefix, ppe, mask, transformer_options)
            else:
                pk, pv = prefix_keys[i], prefix_values[i]
            image = layer.forward_generation(image, ipe, pk, pv, transformer_options)
        out = self.head(image).view(b, th, tw, 3, PATCH, PATCH)
        out = out.permute(0, 3, 1, 4, 2, 5).reshape(b, 3, hh, ww)
        return out[..., :h0, :w0]
