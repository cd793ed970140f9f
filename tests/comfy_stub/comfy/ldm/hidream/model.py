"""``comfy.ldm.hidream.model.HiDreamImageTransformer2DModel`` (HiDream I1, E1) as ComfyUI 0.8.0
and v0.30.0 behave (the same in both; tiny width, written from its public source's structure
and call shapes, not its code).

- ``forward(x, t, y=None, context=None, encoder_hidden_states_llama3=None, image_cond=None,
  control=None, transformer_options={})`` runs the ``diffusion_model`` wrappers around
  ``_forward``. ``image_cond`` (E1's edit) is joined to the latent along its width; the
  latent is padded to the patch and packed ``p x p`` into ``ceil(H/p) x ceil(W/p)`` tokens,
  row-major.
- The text: the T5 conditioning (``context``) and the Llama layers
  (``encoder_hidden_states_llama3``, ``[B, layers, L, D]``), each projected; every block
  sees the T5 tokens, the last Llama layer's and its own Llama layer's: ``T5 + 2 L`` tokens.
- ``double_stream_blocks`` run joint attention over **[image, text]**, then
  ``single_stream_blocks`` over ``cat(image, text)`` (the block's Llama layer appended, cut
  again after it); queries and keys rotated first (left out here); the call is
  ``optimized_attention(q, k, v, heads, transformer_options=...)`` with ``[B, S, heads *
  D]`` tensors; no ``block_type`` / ``block_index`` in ``transformer_options``.
"""

import torch
import torch.nn.functional as F

import comfy.patcher_extension
from comfy.ldm.modules.attention import optimized_attention


def attention(q, k, v, heads, transformer_options):
    return optimized_attention(q, k, v, heads, transformer_options=transformer_options)


class Block(torch.nn.Module):
    """One double-stream (image and text projections) or single-stream block."""

    def __init__(self, dim, heads, single):
        super().__init__()
        self.heads, self.single = heads, single
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.qkv_t = None if single else torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, image_tokens, text_tokens=None, adaln_input=None,
                transformer_options={}):  # noqa: B006 (as ComfyUI)
        x = F.layer_norm(image_tokens, image_tokens.shape[-1:]) + adaln_input
        q, k, v = self.qkv(x).chunk(3, -1)
        if not self.single:
            t = F.layer_norm(text_tokens, text_tokens.shape[-1:]) + adaln_input
            qt, kt, vt = self.qkv_t(t).chunk(3, -1)
            q, k, v = (torch.cat(p, 1) for p in ((q, qt), (k, kt), (v, vt)))
        o = self.out(attention(q, k, v, self.heads, transformer_options))
        if self.single:
            return image_tokens + o
        n = image_tokens.shape[1]
        return image_tokens + o[:, :n], text_tokens + o[:, n:]


class HiDreamImageTransformer2DModel(torch.nn.Module):
    def __init__(self, in_channels=4, dim=32, heads=2, num_layers=2, num_single_layers=1,
                 patch_size=2, t5_dim=12, llama_dim=10):
        super().__init__()
        self.patch_size, self.out_channels = patch_size, in_channels
        self.llama_layers = list(range(num_layers + num_single_layers))
        self.x_embedder = torch.nn.Linear(in_channels * patch_size ** 2, dim)
        self.t_embedder = torch.nn.Linear(16, dim)
        self.caption_projection = torch.nn.ModuleList(
            [torch.nn.Linear(llama_dim, dim) for _ in self.llama_layers]
            + [torch.nn.Linear(t5_dim, dim)])
        self.double_stream_blocks = torch.nn.ModuleList(
            [Block(dim, heads, False) for _ in range(num_layers)])
        self.single_stream_blocks = torch.nn.ModuleList(
            [Block(dim, heads, True) for _ in range(num_single_layers)])
        self.final_layer = torch.nn.Linear(dim, in_channels * patch_size ** 2)

    def forward(self, x, t, y=None, context=None, encoder_hidden_states_llama3=None,
                image_cond=None, control=None, transformer_options={}):  # noqa: B006
        return comfy.patcher_extension.WrapperExecutor.new_class_executor(
            self._forward, self, comfy.patcher_extension.get_all_wrappers(
                comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, transformer_options)
        ).execute(x, t, y, context, encoder_hidden_states_llama3, image_cond, control,
                  transformer_options)

    def _forward(self, x, t, y=None, context=None, encoder_hidden_states_llama3=None,
                 image_cond=None, control=None, transformer_options={}):  # noqa: B006
        b, c, h, w = x.shape
        if image_cond is not None:
            x = torch.cat([x, image_cond], dim=-1)
        p = self.patch_size
        x = F.pad(x, (0, (p - x.shape[-1] % p) % p, 0, (p - x.shape[-2] % p) % p))
        ph, pw = x.shape[-2] // p, x.shape[-1] // p
        img = self.x_embedder(x.view(b, c, ph, p, pw, p).permute(0, 2, 4, 3, 5, 1)
                              .reshape(b, ph * pw, -1))
        half = torch.exp(-torch.log(torch.tensor(10000.0)) * torch.arange(8) / 8)
        tt = t.float()[:, None] * half[None]
        vec = self.t_embedder(torch.cat([tt.cos(), tt.sin()], -1))[:, None]
        llama = encoder_hidden_states_llama3.movedim(1, 0)
        llama = [self.caption_projection[i](llama[k]) for i, k in enumerate(self.llama_layers)]
        t5 = self.caption_projection[-1](context)
        initial = torch.cat([t5, llama[-1]], 1)
        n0, block_id = initial.shape[1], 0
        for block in self.double_stream_blocks:
            img, initial = block(img, torch.cat([initial, llama[block_id]], 1), vec,
                                 transformer_options=transformer_options)
            initial, block_id = initial[:, :n0], block_id + 1
        tokens = img.shape[1]
        hidden = torch.cat([img, initial], 1)
        n = hidden.shape[1]
        for block in self.single_stream_blocks:
            hidden = block(torch.cat([hidden, llama[block_id]], 1), None, vec,
                           transformer_options=transformer_options)[:, :n]
            block_id += 1
        out = self.final_layer(hidden[:, :tokens]).view(b, ph, pw, p, p, c)
        out = out.permute(0, 5, 1, 3, 2, 4).reshape(b, c, ph * p, pw * p)
        return -out[:, :, :h, :w]
