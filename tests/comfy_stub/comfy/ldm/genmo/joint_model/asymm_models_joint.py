"""``comfy.ldm.genmo.joint_model.asymm_models_joint.AsymmDiTJoint`` (Mochi preview) as ComfyUI
0.8.0 and v0.30.0 behave (the same in both; tiny width, written from its public source's
structure and call shapes, not its code).

- ``forward(x, timestep, context, attention_mask, num_tokens=256, packed_indices=None,
  rope_cos=None, rope_sin=None, control=None, transformer_options={}, **kwargs)``; no
  ``diffusion_model`` wrappers. The model base hands ``num_tokens``: the text mask's count
  of real tokens.
- The latent ``[B, C, T, H, W]``: each frame packed ``p x p`` (``H // p x W // p`` tokens,
  frame-major, row-major; sizes divide).
- ``blocks`` (``AsymmetricJointBlock``): joint attention over **[video, text[:num_tokens]]**
  (the text cropped to its real tokens, the rest of its tokens left out of the call),
  video queries and keys rotated first (left out here); ``optimized_attention(q, k, v,
  heads, skip_reshape=True, transformer_options=...)`` with ``[B, heads, S, D]``; no
  ``block_type`` / ``block_index`` in ``transformer_options``. The timestep is the sigma.
"""

import torch
import torch.nn.functional as F

from comfy.ldm.modules.attention import optimized_attention


class AsymmetricJointBlock(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.num_heads = heads
        self.qkv_x, self.qkv_y = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, 3 * dim)
        self.proj_x, self.proj_y = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x, c, y, crop_y, transformer_options={}, **rope):  # noqa: B006
        def split(t):
            return t.view(t.shape[0], t.shape[1], 3, self.num_heads, -1).unbind(2)

        qx, kx, vx = split(self.qkv_x(F.layer_norm(x, x.shape[-1:]) + c[:, None]))
        qy, ky, vy = split(self.qkv_y(F.layer_norm(y, y.shape[-1:]) + c[:, None]))
        q, k, v = (torch.cat([a, b[:, :crop_y]], 1).transpose(1, 2)
                   for a, b in ((qx, qy), (kx, ky), (vx, vy)))
        xy = optimized_attention(q, k, v, self.num_heads, skip_reshape=True,
                                 transformer_options=transformer_options)
        ox, oy = torch.tensor_split(xy, (qx.shape[1],), dim=1)
        o = torch.zeros(y.shape[0], y.shape[1], oy.shape[-1], dtype=oy.dtype)
        o[:, :oy.shape[1]] = oy
        return x + self.proj_x(ox), y + self.proj_y(o)


class AsymmDiTJoint(torch.nn.Module):
    def __init__(self, in_channels=4, dim=32, heads=2, depth=2, patch_size=2, t5_dim=12):
        super().__init__()
        self.patch_size, self.out_channels = patch_size, in_channels
        self.x_embedder = torch.nn.Linear(in_channels * patch_size ** 2, dim)
        self.t_embedder = torch.nn.Linear(16, dim)
        self.t5_yproj = torch.nn.Linear(t5_dim, dim)
        self.blocks = torch.nn.ModuleList([AsymmetricJointBlock(dim, heads)
                                           for _ in range(depth)])
        self.final_layer = torch.nn.Linear(dim, in_channels * patch_size ** 2)

    def forward(self, x, timestep, context, attention_mask=None, num_tokens=256,
                packed_indices=None, rope_cos=None, rope_sin=None, control=None,
                transformer_options={}, **kwargs):  # noqa: B006
        b, c, t, h, w = x.shape
        p = self.patch_size
        hp, wp = h // p, w // p
        tokens = x[..., :hp * p, :wp * p].reshape(b, c, t, hp, p, wp, p)
        x = self.x_embedder(tokens.permute(0, 2, 3, 5, 4, 6, 1).reshape(b, t * hp * wp, -1))
        half = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(8) / 8)
        tt = (1 - timestep.float())[:, None] * 1000 * half[None]
        vec = self.t_embedder(torch.cat([tt.cos(), tt.sin()], -1))
        y = self.t5_yproj(context)
        for block in self.blocks:
            x, y = block(x, vec, y, crop_y=num_tokens, transformer_options=transformer_options)
        out = self.final_layer(x).view(b, t, hp, wp, p, p, c)
        return out.permute(0, 6, 1, 2, 4, 3, 5).reshape(b, c, t, hp * p, wp * p)
