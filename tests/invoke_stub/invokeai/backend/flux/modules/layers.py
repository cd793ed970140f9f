"""``invokeai.backend.flux.modules.layers``: the blocks, calling the module-level ``attention``
(bound here by name at import, looked up at every call)."""

import torch
from torch import nn

from invokeai.backend.flux.math import attention, rope


class EmbedND(nn.Module):
    def __init__(self, theta, axes_dim):
        super().__init__()
        self.theta, self.axes_dim = theta, list(axes_dim)

    def forward(self, ids):
        return torch.cat([rope(ids[..., i], d, self.theta) for i, d in enumerate(self.axes_dim)],
                         -3).unsqueeze(1)


class DoubleStreamBlock(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.img_qkv, self.txt_qkv = nn.Linear(width, 3 * width), nn.Linear(width, 3 * width)
        self.img_proj, self.txt_proj = nn.Linear(width, width), nn.Linear(width, width)
        self.img_mod, self.txt_mod = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, img, txt, vec, pe):
        def qkv(x, layer, mod):
            x = x * (1 + mod(vec)[:, None])
            return layer(x).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        iq, ik, iv = qkv(img, self.img_qkv, self.img_mod)
        tq, tk, tv = qkv(txt, self.txt_qkv, self.txt_mod)
        out = attention(torch.cat((tq, iq), 2), torch.cat((tk, ik), 2), torch.cat((tv, iv), 2),
                        pe=pe)
        n = txt.shape[1]
        return img + self.img_proj(out[:, n:]), txt + self.txt_proj(out[:, :n])


class SingleStreamBlock(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj, self.mod = (nn.Linear(width, 3 * width), nn.Linear(width, width),
                                         nn.Linear(width, width))

    def forward(self, x, vec, pe):
        q, k, v = self.qkv(x * (1 + self.mod(vec)[:, None])).unflatten(
            -1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return x + self.proj(attention(q, k, v, pe=pe))
