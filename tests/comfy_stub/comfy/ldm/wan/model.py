"""``comfy.ldm.wan.model.WanModel`` (Wan 2.1) as ComfyUI 0.8.0 behaves (tiny width; written
from its observed behaviour): ``forward(x, timestep, context, clip_fea, time_dim_concat,
transformer_options, **kwargs)`` runs the ``diffusion_model`` wrappers around ``_forward``;
the latent ``[B, C, T, H, W]`` is padded to the ``(1, 2, 2)`` patch and embedded by a 3-D
convolution into frame-major tokens (``T x ceil(H/2) x ceil(W/2)``); ``time_dim_concat``
frames are appended to the latent first; a model with ``ref_conv`` prepends the tokens of
``reference_latent`` (``[B, C, H, W]``) and counts one more frame for RoPE; v0.30.0's
in-context references (``context_latents``: latents ``[B, C, T, H, W]``, each padded and
embedded like the video, its own RoPE grid) are appended after the video's tokens.

Each block: self-attention over the video tokens only, queries and keys rotated (RoPE over
frame, row, column) and flattened to ``[B, S, heads * D]``, called as
``optimized_attention(q, k, v, heads=heads, transformer_options=...)`` (``heads`` as a
keyword, no mask); then cross-attention to the text with the same call (``k`` as long as the
text); ``transformer_options`` gets ``total_blocks``, ``block_type`` "double" and
``block_index``."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention


class WanSelfAttention(torch.nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q, self.k = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.v, self.o = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x, freqs, transformer_options={}):  # noqa: B006
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = apply_rope1(F.normalize(self.q(x), dim=-1).view(b, s, n, d), freqs)
        k = apply_rope1(F.normalize(self.k(x), dim=-1).view(b, s, n, d), freqs)
        x = optimized_attention(q.view(b, s, n * d), k.view(b, s, n * d),
                                self.v(x).view(b, s, n * d), heads=self.num_heads,
                                transformer_options=transformer_options)
        return self.o(x)


class WanT2VCrossAttention(WanSelfAttention):
    def forward(self, x, context, transformer_options={}, **kwargs):  # noqa: B006
        q, k, v = self.q(x), self.k(context), self.v(context)
        return self.o(optimized_attention(q, k, v, heads=self.num_heads,
                                          transformer_options=transformer_options))


class WanAttentionBlock(torch.nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.self_attn = WanSelfAttention(dim, num_heads)
        self.cross_attn = WanT2VCrossAttention(dim, num_heads)
        self.ffn = torch.nn.Linear(dim, dim)

    def forward(self, x, e, freqs, context, context_img_len=None, transformer_options={}):  # noqa: B006
        x = x + self.self_attn(F.layer_norm(x, x.shape[-1:]) + e, freqs,
                               transformer_options=transformer_options)
        x = x + self.cross_attn(F.layer_norm(x, x.shape[-1:]), context,
                                transformer_options=transformer_options)
        return x + self.ffn(F.gelu(F.layer_norm(x, x.shape[-1:])))


class WanModel(torch.nn.Module):
    def __init__(self, in_dim=4, dim=32, num_heads=2, num_layers=2, text_dim=12,
                 patch_size=(1, 2, 2), ref_conv=False):
        super().__init__()
        self.patch_size, self.out_dim, self.num_heads = patch_size, in_dim, num_heads
        self.patch_embedding = torch.nn.Conv3d(in_dim, dim, patch_size, patch_size)
        self.text_embedding = torch.nn.Linear(text_dim, dim)
        self.time_embedding = torch.nn.Linear(16, dim)
        self.blocks = torch.nn.ModuleList([WanAttentionBlock(dim, num_heads)
                                           for _ in range(num_layers)])
        self.head = torch.nn.Linear(dim, in_dim * patch_size[0] * patch_size[1] * patch_size[2])
        d = dim // num_heads
        self.rope_embedder = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])
        self.ref_conv = torch.nn.Conv2d(in_dim, dim, patch_size[1:], patch_size[1:]) \
            if ref_conv else None

    def forward_orig(self, x, t, context, clip_fea=None, freqs=None, transformer_options={},  # noqa: B006
                     **kwargs):
        x = self.patch_embedding(x.float()).to(x.dtype)
        grid_sizes = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        e = self.time_embedding(timestep_embedding(t.flatten(), 16, time_factor=1.0))[:, None]
        full_ref = None
        if self.ref_conv is not None:
            full_ref = kwargs.get("reference_latent", None)
            if full_ref is not None:
                full_ref = self.ref_conv(full_ref).flatten(2).transpose(1, 2)
                x = torch.concat((full_ref, x), dim=1)
        for lat in kwargs.get("context_latents") or ():
            x = torch.cat([x, self.patch_embedding(lat.float()).to(x.dtype).flatten(2)
                           .transpose(1, 2)], dim=1)
        context = self.text_embedding(context)
        transformer_options["total_blocks"] = len(self.blocks)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            x = block(x, e=e, freqs=freqs, context=context, transformer_options=transformer_options)
        x = self.head(x)
        if full_ref is not None:
            x = x[:, full_ref.shape[1]:]
        return self.unpatchify(x, grid_sizes)

    def rope_encode(self, t, h, w):
        pt, ph, pw = self.patch_size
        t_len, h_len, w_len = (t + pt // 2) // pt, (h + ph // 2) // ph, (w + pw // 2) // pw
        ids = torch.zeros(t_len, h_len, w_len, 3)
        ids[..., 0] = torch.arange(t_len, dtype=torch.float32).view(-1, 1, 1)
        ids[..., 1] = torch.arange(h_len, dtype=torch.float32).view(1, -1, 1)
        ids[..., 2] = torch.arange(w_len, dtype=torch.float32).view(1, 1, -1)
        return self.rope_embedder(ids.reshape(1, -1, 3)).movedim(1, 2)

    def forward(self, x, timestep, context, clip_fea=None, time_dim_concat=None,
                transformer_options={}, **kwargs):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, timestep, context, clip_fea, time_dim_concat, transformer_options, **kwargs)

    def _forward(self, x, timestep, context, clip_fea=None, time_dim_concat=None,
                 transformer_options={}, **kwargs):  # noqa: B006
        bs, c, t, h, w = x.shape
        x = pad_to_patch_size(x, self.patch_size)
        t_len = t
        if time_dim_concat is not None:
            x = torch.cat([x, pad_to_patch_size(time_dim_concat, self.patch_size)], dim=2)
            t_len = x.shape[2]
        if self.ref_conv is not None and "reference_latent" in kwargs:
            t_len += 1
        freqs = self.rope_encode(t_len, h, w)
        latents = [pad_to_patch_size(lat, self.patch_size)
                   for lat in kwargs.pop("context_latents", None) or ()]
        for lat in latents:
            freqs = torch.cat([freqs, self.rope_encode(*lat.shape[-3:])], dim=1)
        if latents:
            kwargs["context_latents"] = latents
        return self.forward_orig(x, timestep, context, clip_fea=clip_fea, freqs=freqs,
                                 transformer_options=transformer_options,
                                 **kwargs)[:, :, :t, :h, :w]

    def unpatchify(self, x, grid_sizes):
        b, c = x.shape[0], self.out_dim
        f, h, w = grid_sizes
        u = x[:, :f * h * w].view(b, f, h, w, *self.patch_size, c)
        u = torch.einsum("bfhwpqrc->bcfphqwr", u)
        return u.reshape(b, c, *[i * j for i, j in zip(grid_sizes, self.patch_size)])


def pad_to_patch_size(img, patch_size=(2, 2)):
    pad = ()
    for i in range(img.ndim - 2):
        pad = (0, (patch_size[i] - img.shape[i + 2] % patch_size[i]) % patch_size[i]) + pad
    return F.pad(img, pad, mode="circular")
