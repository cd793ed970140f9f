"""``comfy.ldm.cosmos.model.GeneralDIT`` (Cosmos predict1) as ComfyUI 0.8.0 and v0.30.0
behave (tiny width; written from their observed behaviour, not their code).

``forward(x, timesteps, context, attention_mask=None, fps=None, ..., **kwargs)`` runs the
``diffusion_model`` wrappers around ``_forward``: the latent ``[B, C, T, H, W]`` (sides whole
patches: no padding) is embedded (a padding-mask channel added) into a ``T x H x W`` grid of
``(patch_temporal, patch_spatial, patch_spatial)`` patches. ``blocks`` is a ``ModuleDict``
(``block0``, ...); each runs full self-attention over the video tokens (frame-major), then
cross-attention to the text, each as ``optimized_attention(q, k, v, heads,
skip_reshape=True, mask=mask, skip_output_reshape=True, transformer_options=...)`` on ``[B,
heads, S, D]`` (keys rotated in self-attention; the text's ``attention_mask`` on the
cross-attention); no block index."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention


class Attention(torch.nn.Module):
    def __init__(self, dim, heads, context_dim=None):
        super().__init__()
        self.heads, self.is_selfattn = heads, context_dim is None
        self.to_q = torch.nn.Linear(dim, dim)
        self.to_k = torch.nn.Linear(context_dim or dim, dim)
        self.to_v = torch.nn.Linear(context_dim or dim, dim)
        self.to_out = torch.nn.Linear(dim, dim)

    def forward(self, x, context=None, mask=None, rope_emb=None, transformer_options={}):  # noqa: B006
        context = x if context is None else context
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in
                   (self.to_q(x), self.to_k(context), self.to_v(context)))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        if self.is_selfattn and rope_emb is not None:
            q, k = apply_rope1(q, rope_emb), apply_rope1(k, rope_emb)
        out = optimized_attention(q, k, v, self.heads, skip_reshape=True, mask=mask,
                                  skip_output_reshape=True,
                                  transformer_options=transformer_options)
        return self.to_out(out.transpose(1, 2).flatten(2))


class GeneralDITTransformerBlock(torch.nn.Module):
    def __init__(self, dim, heads, context_dim):
        super().__init__()
        self.attn = Attention(dim, heads)
        self.cross = Attention(dim, heads, context_dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.adaln = torch.nn.Linear(dim, dim)

    def forward(self, x, emb, crossattn_emb, crossattn_mask=None, rope_emb_L_1_1_D=None,
                transformer_options={}):  # noqa: B006
        n = F.layer_norm(x, x.shape[-1:]) * (1 + self.adaln(emb)[:, None])
        x = x + self.attn(n, rope_emb=rope_emb_L_1_1_D, transformer_options=transformer_options)
        x = x + self.cross(F.layer_norm(x, x.shape[-1:]), crossattn_emb, crossattn_mask,
                           transformer_options=transformer_options)
        return x + self.mlp(F.gelu(F.layer_norm(x, x.shape[-1:])))


class GeneralDIT(torch.nn.Module):
    def __init__(self, in_channels=4, model_channels=32, num_heads=2, num_blocks=2,
                 patch_spatial=2, patch_temporal=1, crossattn_emb_channels=12):
        super().__init__()
        self.patch_spatial, self.patch_temporal = patch_spatial, patch_temporal
        self.in_channels = in_channels
        c = (in_channels + 1) * patch_spatial ** 2 * patch_temporal
        self.x_embedder = torch.nn.Linear(c, model_channels)
        self.t_embedder = torch.nn.Linear(16, model_channels)
        self.blocks = torch.nn.ModuleDict({f"block{i}": GeneralDITTransformerBlock(
            model_channels, num_heads, crossattn_emb_channels) for i in range(num_blocks)})
        self.final_layer = torch.nn.Linear(
            model_channels, in_channels * patch_spatial ** 2 * patch_temporal)
        d = model_channels // num_heads
        self.pos_embedder = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])

    def forward(self, x, timesteps, context, attention_mask=None, fps=None, **kwargs):
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                kwargs.get("transformer_options", {}))
        ).execute(x, timesteps, context, attention_mask, fps, **kwargs)

    def _forward(self, x, timesteps, context, attention_mask=None, fps=None, **kwargs):
        pt, ps = self.patch_temporal, self.patch_spatial
        x = torch.cat([x, torch.zeros_like(x[:, :1])], 1)
        b, c, t, h, w = x.shape
        t, h, w = t // pt, h // ps, w // ps
        tokens = self.x_embedder(x.view(b, c, t, pt, h, ps, w, ps)
                                 .permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4).flatten(1, 3))
        ids = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                         indexing="ij"), -1).reshape(1, -1, 3).float()
        rope = self.pos_embedder(ids)
        emb = self.t_embedder(timestep_embedding(timesteps.flatten(), 16, time_factor=1.0))
        mask = None if attention_mask is None else attention_mask[:, None, None]
        options = kwargs.get("transformer_options", {})
        for block in self.blocks.values():
            tokens = block(tokens, emb, context, mask, rope, transformer_options=options)
        out = self.final_layer(tokens).view(b, t, h, w, self.in_channels, pt, ps, ps)
        return out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, self.in_channels, t * pt,
                                                           h * ps, w * ps)
