"""``comfy.ldm.lumina.model.NextDiT`` (Lumina 2, Z-Image) as ComfyUI 0.8.0 and v0.30.0
behave (tiny width; written from their observed behaviour, not their code).

``forward(x, timesteps, context, num_tokens, attention_mask=None, transformer_options=,
**kwargs)`` runs the ``diffusion_model`` wrappers around ``_forward``: the latent ``[B, C, H,
W]`` is padded to the patch (``patch_size``, 2) and cut into ``ceil(H/p) x ceil(W/p)``
row-major tokens; with ``pad_tokens_multiple`` (Z-Image) the caption and the image tokens are
each padded up to that multiple with a learned pad token (Lumina 2: none). Then:

- the context refiner: self-attention over the (padded) caption alone, with the conditioning's
  ``attention_mask`` in 0.8.0 and none in v0.30.0;
- the noise refiner: self-attention over the (padded) image alone, no mask;
- the layers: joint self-attention over ``[caption (padded), image (padded)]``, no mask;
  ``transformer_options`` gets ``total_blocks``, ``block_type`` "double" and ``block_index``
  (the refiners set none).

Z-Image omni (v0.30.0, ``ref_latents``: the reference images, their captions
``ref_contexts``, their SigLIP features ``siglip_feats`` ``[B, h, w, C]``): the joint sequence
is ``[captions (each reference's, padded, or one multiple of pad tokens; the prompt's;
captions beyond the references), SigLIP features (each reference's, padded, or one multiple of
pad tokens; one multiple for the image), reference images (each padded), image (padded)]``;
the refiners run over the captions, the SigLIP features and the images (references, then the
image) apart.

``direct_context`` (ComfyUI after v0.30.0, read at ``dcbf1c1d``): tokens already in the model's
width (``[B, N, dim]``) appended to the prompt's embedded caption before its padding, so the
caption (and the joint sequence) is longer than ``context``.

Every attention is ``optimized_attention_masked(q, k, v, heads, mask, skip_reshape=True,
transformer_options=...)`` with ``[B, heads, S, D]`` queries and keys already rotated (RoPE
over caption position, row and column; padding at position 0). The model is called with the
sigma (``t = 1 - timesteps``) and returns the negated prediction."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention_masked


class JointAttention(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x, x_mask, freqs_cis, transformer_options={}):  # noqa: B006
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = apply_rope(F.normalize(q, dim=-1), F.normalize(k, dim=-1), freqs_cis)
        out = optimized_attention_masked(q, k, v, self.heads, x_mask, skip_reshape=True,
                                         transformer_options=transformer_options)
        return self.out(out)


class JointTransformerBlock(torch.nn.Module):
    def __init__(self, dim, heads, modulation=True):
        super().__init__()
        self.attention = JointAttention(dim, heads)
        self.feed_forward = torch.nn.Linear(dim, dim)
        self.adaLN_modulation = torch.nn.Linear(dim, dim) if modulation else None

    def forward(self, x, x_mask, freqs_cis, adaln_input=None, transformer_options={}):  # noqa: B006
        h = F.layer_norm(x, x.shape[-1:])
        if self.adaLN_modulation is not None:
            h = h * (1 + self.adaLN_modulation(adaln_input)[:, None])
        x = x + self.attention(h, x_mask, freqs_cis, transformer_options=transformer_options)
        return x + self.feed_forward(F.gelu(F.layer_norm(x, x.shape[-1:])))


class NextDiT(torch.nn.Module):
    def __init__(self, patch_size=2, in_channels=4, dim=32, n_heads=2, n_layers=2,
                 n_refiner_layers=1, cap_feat_dim=12, pad_tokens_multiple=None,
                 version="0.8.0", siglip_feat_dim=None):
        super().__init__()
        self.patch_size, self.in_channels, self.version = patch_size, in_channels, version
        self.pad_tokens_multiple = pad_tokens_multiple
        self.x_embedder = torch.nn.Linear(patch_size * patch_size * in_channels, dim)
        self.cap_embedder = torch.nn.Linear(cap_feat_dim, dim)
        self.t_embedder = torch.nn.Linear(16, dim)
        self.context_refiner = torch.nn.ModuleList(
            [JointTransformerBlock(dim, n_heads, modulation=False)
             for _ in range(n_refiner_layers)])
        self.noise_refiner = torch.nn.ModuleList(
            [JointTransformerBlock(dim, n_heads) for _ in range(n_refiner_layers)])
        self.layers = torch.nn.ModuleList(
            [JointTransformerBlock(dim, n_heads) for _ in range(n_layers)])
        self.final_layer = torch.nn.Linear(dim, patch_size * patch_size * in_channels)
        d = dim // n_heads
        self.rope_embedder = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])
        if pad_tokens_multiple is not None:
            self.x_pad_token = torch.nn.Parameter(torch.randn(1, dim))
            self.cap_pad_token = torch.nn.Parameter(torch.randn(1, dim))
        self.siglip_embedder = self.siglip_refiner = self.siglip_pad_token = None
        if siglip_feat_dim is not None:
            self.siglip_embedder = torch.nn.Linear(siglip_feat_dim, dim)
            self.siglip_refiner = torch.nn.ModuleList(
                [JointTransformerBlock(dim, n_heads, modulation=False)
                 for _ in range(n_refiner_layers)])
            self.siglip_pad_token = torch.nn.Parameter(torch.randn(1, dim))

    def _pad(self, feats, ids, token):
        if self.pad_tokens_multiple is None:
            return feats, ids
        extra = (-feats.shape[1]) % self.pad_tokens_multiple
        feats = torch.cat([feats, token.expand(feats.shape[0], extra, -1)], 1)
        return feats, F.pad(ids, (0, 0, 0, extra))

    def forward(self, x, timesteps, context, num_tokens=None, attention_mask=None,
                transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timesteps, context, num_tokens, attention_mask,
                  transformer_options=transformer_options, **kwargs)

    def _image(self, x, token):
        b, c = x.shape[:2]
        p = self.patch_size
        hh, ww = x.shape[-2] // p, x.shape[-1] // p
        img = self.x_embedder(x.view(b, c, hh, p, ww, p).permute(0, 2, 4, 3, 5, 1)
                              .flatten(3).flatten(1, 2))
        return self._pad(img, torch.zeros(b, hh * ww, 3), token)[0]

    def _omni(self, x, t, context, refs, contexts, sigs, transformer_options, direct=None):
        """Z-Image omni: [captions, SigLIP features, reference images, image], refined apart
        (positions all 0 here: the layout is what the stand-in keeps)."""
        b, m = x.shape[0], self.pad_tokens_multiple

        def pads(token):
            return token.expand(b, m, -1)

        def padded(f, token):
            return self._pad(f, torch.zeros(*f.shape[:2], 3), token)[0]

        caps = [padded(self.cap_embedder(contexts[i]), self.cap_pad_token)
                if i < len(contexts) else pads(self.cap_pad_token) for i in range(len(refs))]
        prompt = self.cap_embedder(context)
        if direct is not None:
            prompt = torch.cat([prompt, direct], 1)
        caps += [padded(prompt, self.cap_pad_token)]
        caps += [padded(self.cap_embedder(c), self.cap_pad_token) for c in contexts[len(refs):]]
        siglip = [padded(self.siglip_embedder(sigs[i].flatten(1, 2)), self.siglip_pad_token)
                  if i < len(sigs) else pads(self.siglip_pad_token) for i in range(len(refs))]
        siglip.append(pads(self.siglip_pad_token))
        images = [self._image(r, self.x_pad_token) for r in refs] + \
            [self._image(x, self.x_pad_token)]
        parts = [torch.cat(caps, 1), torch.cat(siglip, 1), torch.cat(images, 1)]
        zero = self.rope_embedder(torch.zeros(1, sum(q.shape[1] for q in parts), 3))
        for i, (layers, tt) in enumerate(((self.context_refiner, None),
                                          (self.siglip_refiner, None), (self.noise_refiner, t))):
            for layer in layers:
                parts[i] = layer(parts[i], None, zero[:, :, :parts[i].shape[1]], tt,
                                 transformer_options=transformer_options)
        joint = torch.cat(parts, 1)
        transformer_options["block_type"] = "double"
        for i, layer in enumerate(self.layers):
            transformer_options["block_index"] = i
            joint = layer(joint, None, zero, t, transformer_options=transformer_options)
        return joint[:, joint.shape[1] - images[-1].shape[1]:]

    def _forward(self, x, timesteps, context, num_tokens=None, attention_mask=None,
                 ref_latents=(), ref_contexts=(), siglip_feats=(), direct_context=None,
                 transformer_options={}, **kwargs):  # noqa: B006
        b, c, h, w = x.shape
        p = self.patch_size
        x = F.pad(x, (0, (-w) % p, 0, (-h) % p), mode="circular")
        hh, ww = x.shape[-2] // p, x.shape[-1] // p
        t = self.t_embedder(timestep_embedding(1.0 - timesteps, 16, time_factor=1000.0))
        if ref_latents:
            img = self._omni(x, t, context, list(ref_latents), list(ref_contexts or ()),
                             list(siglip_feats or ()), transformer_options, direct_context)
            out = self.final_layer(img[:, :hh * ww]).view(b, hh, ww, p, p, c)
            out = out.permute(0, 5, 1, 3, 2, 4).reshape(b, c, hh * p, ww * p)[:, :, :h, :w]
            return -out
        cap = self.cap_embedder(context)
        if direct_context is not None:
            cap = torch.cat([cap, direct_context], 1)
        cap_ids = torch.zeros(b, cap.shape[1], 3)
        cap_ids[..., 0] = torch.arange(cap.shape[1], dtype=torch.float32) + 1
        cap, cap_ids = self._pad(cap, cap_ids, getattr(self, "cap_pad_token", None))
        img = self.x_embedder(x.view(b, c, hh, p, ww, p).permute(0, 2, 4, 3, 5, 1)
                              .flatten(3).flatten(1, 2))
        img_ids = torch.zeros(b, hh * ww, 3)
        img_ids[..., 0] = cap.shape[1] + 1
        img_ids[..., 1] = torch.arange(hh, dtype=torch.float32).repeat_interleave(ww)
        img_ids[..., 2] = torch.arange(ww, dtype=torch.float32).repeat(hh)
        img, img_ids = self._pad(img, img_ids, getattr(self, "x_pad_token", None))
        freqs = self.rope_embedder(torch.cat([cap_ids, img_ids], 1))
        n = cap.shape[1]
        cap_mask = attention_mask if self.version == "0.8.0" else None
        for layer in self.context_refiner:
            cap = layer(cap, cap_mask, freqs[:, :, :n], transformer_options=transformer_options)
        for layer in self.noise_refiner:
            img = layer(img, None, freqs[:, :, n:], t, transformer_options=transformer_options)
        joint = torch.cat([cap, img], 1)
        transformer_options["total_blocks"] = len(self.layers)
        transformer_options["block_type"] = "double"
        for i, layer in enumerate(self.layers):
            transformer_options["block_index"] = i
            joint = layer(joint, None, freqs, t, transformer_options=transformer_options)
        out = self.final_layer(joint[:, n:n + hh * ww]).view(b, hh, ww, p, p, c)
        out = out.permute(0, 5, 1, 3, 2, 4).reshape(b, c, hh * p, ww * p)[:, :, :h, :w]
        return -out
