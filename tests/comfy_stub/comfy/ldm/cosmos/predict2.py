"""``comfy.ldm.cosmos.predict2.MiniTrainDIT`` (Cosmos predict2; Anima is a subclass) as
ComfyUI 0.8.0 and v0.30.0 behave (tiny width; written from their observed behaviour, not
their code).

``forward(x, timesteps, context, fps=None, padding_mask=None, **kwargs)`` (its
``transformer_options`` among the keywords) runs the ``diffusion_model`` wrappers around
``_forward``: the latent ``[B, C, T, H, W]`` is padded to ``(patch_temporal, patch_spatial,
patch_spatial)`` in v0.30.0 (0.8.0 requires whole patches: an assertion) and embedded (a zero
padding-mask channel added) into a ``[B, T, H, W, D]`` grid, flattened frame-major for
attention. Each block: self-attention over the video tokens alone, then cross-attention to
the text, both through ``torch_attention_op``: ``[B, S, heads, D]`` queries and keys
(rotated in self-attention) moved to ``[B, heads, S, D]`` and passed as
``optimized_attention(q, k, v, heads, skip_reshape=True, transformer_options=...)``; v0.30.0
sets ``transformer_options["block_index"]`` per block (no ``block_type``), 0.8.0 nothing."""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.flux.math import EmbedND, apply_rope1, timestep_embedding
from comfy.ldm.modules.attention import optimized_attention


def torch_attention_op(q, k, v, transformer_options={}):  # noqa: B006
    heads = q.shape[-2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return optimized_attention(q, k, v, heads, skip_reshape=True,
                               transformer_options=transformer_options)


class Attention(torch.nn.Module):
    def __init__(self, dim, heads, context_dim=None):
        super().__init__()
        self.heads, self.is_selfattn = heads, context_dim is None
        self.q_proj = torch.nn.Linear(dim, dim)
        self.k_proj = torch.nn.Linear(context_dim or dim, dim)
        self.v_proj = torch.nn.Linear(context_dim or dim, dim)
        self.output_proj = torch.nn.Linear(dim, dim)

    def forward(self, x, context=None, rope_emb=None, transformer_options={}):  # noqa: B006
        context = x if context is None else context
        q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in
                   (self.q_proj(x), self.k_proj(context), self.v_proj(context)))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        if self.is_selfattn and rope_emb is not None:
            q, k = (apply_rope1(t.transpose(1, 2), rope_emb).transpose(1, 2) for t in (q, k))
        return self.output_proj(torch_attention_op(q, k, v, transformer_options))


class Block(torch.nn.Module):
    def __init__(self, dim, heads, context_dim):
        super().__init__()
        self.self_attn = Attention(dim, heads)
        self.cross_attn = Attention(dim, heads, context_dim)
        self.mlp = torch.nn.Linear(dim, dim)
        self.adaln = torch.nn.Linear(dim, dim)

    def forward(self, x_B_T_H_W_D, emb_B_D, crossattn_emb, rope_emb_L_1_1_D=None,
                transformer_options={}, **kwargs):  # noqa: B006
        b, t, h, w, d = x_B_T_H_W_D.shape
        x = x_B_T_H_W_D.reshape(b, t * h * w, d)
        n = F.layer_norm(x, (d,)) * (1 + self.adaln(emb_B_D)[:, None])
        x = x + self.self_attn(n, None, rope_emb=rope_emb_L_1_1_D,
                               transformer_options=transformer_options)
        x = x + self.cross_attn(F.layer_norm(x, (d,)), crossattn_emb,
                                transformer_options=transformer_options)
        x = x + self.mlp(F.gelu(F.layer_norm(x, (d,))))
        return x.reshape(b, t, h, w, d)


class MiniTrainDIT(torch.nn.Module):
    def __init__(self, in_channels=4, model_channels=32, num_heads=2, num_blocks=2,
                 patch_spatial=2, patch_temporal=1, crossattn_emb_channels=12,
                 concat_padding_mask=True, version="0.8.0"):
        super().__init__()
        self.patch_spatial, self.patch_temporal = patch_spatial, patch_temporal
        self.concat_padding_mask, self.version = concat_padding_mask, version
        self.in_channels = in_channels
        c = (in_channels + int(concat_padding_mask)) * patch_spatial ** 2 * patch_temporal
        self.x_embedder = torch.nn.Linear(c, model_channels)
        self.t_embedder = torch.nn.Linear(16, model_channels)
        self.blocks = torch.nn.ModuleList([Block(model_channels, num_heads,
                                                 crossattn_emb_channels)
                                           for _ in range(num_blocks)])
        self.final_layer = torch.nn.Linear(
            model_channels, in_channels * patch_spatial ** 2 * patch_temporal)
        d = model_channels // num_heads
        self.pos_embedder = EmbedND([d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])

    def forward(self, x, timesteps, context, fps=None, padding_mask=None, **kwargs):
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL,
                kwargs.get("transformer_options", {}))
        ).execute(x, timesteps, context, fps, padding_mask, **kwargs)

    def _forward(self, x, timesteps, context, fps=None, padding_mask=None, **kwargs):
        orig = x.shape
        pt, ps = self.patch_temporal, self.patch_spatial
        if self.version == "0.8.0":
            assert x.shape[-1] % ps == 0 and x.shape[-2] % ps == 0, "whole patches only"
        x = F.pad(x, (0, (-x.shape[-1]) % ps, 0, (-x.shape[-2]) % ps, 0, (-x.shape[-3]) % pt),
                  mode="replicate")
        if self.concat_padding_mask:
            x = torch.cat([x, torch.zeros_like(x[:, :1])], 1)
        b, c, t, h, w = x.shape
        t, h, w = t // pt, h // ps, w // ps
        grid = x.view(b, c, t, pt, h, ps, w, ps).permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4)
        x_B_T_H_W_D = self.x_embedder(grid)
        ids = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                         indexing="ij"), -1).reshape(1, -1, 3).float()
        rope = self.pos_embedder(ids)
        emb = self.t_embedder(timestep_embedding(timesteps.flatten(), 16, time_factor=1.0))
        options = kwargs.get("transformer_options", {})
        for i, block in enumerate(self.blocks):
            if self.version != "0.8.0":
                options["block_index"] = i
            x_B_T_H_W_D = block(x_B_T_H_W_D, emb, context, rope_emb_L_1_1_D=rope,
                                transformer_options=options)
        out = self.final_layer(x_B_T_H_W_D).view(b, t, h, w, self.in_channels, pt, ps, ps)
        out = out.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(b, self.in_channels, t * pt, h * ps,
                                                          w * ps)
        return out[:, :, :orig[-3], :orig[-2], :orig[-1]]
