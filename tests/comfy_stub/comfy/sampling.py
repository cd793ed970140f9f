"""One UNet call as ComfyUI 0.8.0 makes it, and its blocks' attn1 contract.

- ``unet_call(patcher, x, timesteps, context, sigma, schedule)``: ``transformer_options`` built
  from the patcher's ``model_options`` (patches, replacements), plus ``sigmas`` (this step's
  k-diffusion sigma: 14.6 down to 0.03 on SD1.5), ``sample_sigmas`` (the sampler's whole
  schedule, ending with 0) and the patcher's wrappers;
- ``ksample(patcher, x, context, steps)``: the model calls of a KSampler (Euler, normal
  schedule from the model's ``model_sampling``), each on the same latent.
- The ``apply_model`` wrappers run around the model base's call (``executor.class_obj`` the
  model base, every argument positional: ``x, sigma, c_concat, c_crossattn, control,
  transformer_options``), which reads ``diffusion_model`` from the base at that moment
  (TorchCompileModel's wrapper swaps its compiled module in there). The UNet's own forward
  (``comfy_blocks`` makes the root ComfyUI's ``UNetModel``) runs the ``diffusion_model``
  wrappers around the part that sets ``original_shape`` from its input: inside a compiled
  UNet, both are traced. Every transformer block then gets ``block`` ``(side, number)`` and
  ``block_index``.
- ``comfy_blocks(unet)``: an ldm UNet's ``BasicTransformerBlock``s with ComfyUI's attn1
  contract: ``p(n, context_attn1, value_attn1, extra_options)`` for each attn1 patch (``k``
  and ``v`` are ``n`` itself for self-attention), then the attn1 replacement looked up by
  ``(side, number, index)`` then ``(side, number)`` (called with projected q, k, v), or attn1;
  then each attn1 output patch ``p(n, extra_options)``. ``extra_options`` is
  ``transformer_options`` without ``patches`` and ``patches_replace``.
- ``DiTModel``: a DiT whose joint blocks call attn1 patches in the DiT form
  ``p(q, k, v, pe=, attn_mask=, extra_options=)`` and read the returned dict
  (``out.get("q", q)``), with ``extra_options["img_slice"] = [txt_len, total]``.
"""

import re

import torch
import torch.nn.functional as F

DIFFUSION_MODEL, APPLY_MODEL = "diffusion_model", "apply_model"
_current = []


class _Executor:
    def __init__(self, original, wrappers, idx=0):
        self.original, self.wrappers, self.idx = original, list(wrappers), idx

    def __call__(self, *args, **kwargs):
        return _Executor(self.original, self.wrappers, self.idx + 1).execute(*args, **kwargs)

    def execute(self, *args, **kwargs):
        if self.idx == len(self.wrappers):
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)


def unet_call(patcher, x, timesteps, context, sigma=14.6146, schedule=None):
    from comfy.patcher_extension import WrapperExecutor
    options = dict(patcher.model_options.get("transformer_options", {}))
    if schedule is not None:
        options["sample_sigmas"] = schedule
    options["patches"] = {k: list(v) for k, v in options.get("patches", {}).items()}
    wrappers = {}
    for kind, keyed in patcher.wrappers.items():
        for key, fns in keyed.items():
            wrappers.setdefault(kind, {}).setdefault(key, []).extend(fns)
    options["wrappers"] = wrappers
    options["sigmas"] = torch.tensor([float(sigma)])
    base = patcher.model

    def apply_model(x, t, c_concat, c_crossattn, control, transformer_options):
        return base.diffusion_model(x, timesteps, context=c_crossattn, control=control,
                                    transformer_options=transformer_options)

    around = [w for fns in wrappers.get(APPLY_MODEL, {}).values() for w in fns]
    return WrapperExecutor.new_class_executor(apply_model, base, around).execute(
        x, options["sigmas"].expand(x.shape[0]), None, context, None, options)


def ksample(patcher, x, context, steps=4):
    """Euler sampling as a KSampler runs it (normal schedule from the model's
    ``model_sampling``; cond and uncond in one batch); the outputs of every model call."""
    from comfy.model_sampling import normal_sigmas
    sampling = patcher.get_model_object("model_sampling")
    schedule = normal_sigmas(sampling, steps)
    outs = []
    for sigma in schedule[:-1]:
        t = sampling.timestep(sigma.reshape(1)).float().expand(x.shape[0])
        outs.append(unet_call(patcher, x, t, context, float(sigma), schedule))
    return outs


def _where(name):
    """``input_blocks.1.1.transformer_blocks.0`` -> (("input", 1), 0)."""
    m = re.match(r"(input|output)_blocks\.(\d+)\..*transformer_blocks\.(\d+)$", name)
    if m:
        return (m.group(1), int(m.group(2))), int(m.group(3))
    m = re.match(r"middle_block\..*transformer_blocks\.(\d+)$", name)
    return ("middle", 0), int(m.group(1))


def _attention(attn, q_in, k_in, v_in):
    q, k, v = attn.to_q(q_in), attn.to_k(k_in), attn.to_v(v_in)
    return attn.to_out(_sdpa(q, k, v, attn.heads))


def _sdpa(q, k, v, heads):
    """As ComfyUI's attention: each of q, k, v viewed as (q's batch, -1, heads, dim)."""
    b = q.shape[0]
    split = [t.reshape(b, -1, t.shape[-1]).unflatten(-1, (heads, -1)).transpose(1, 2)
             for t in (q, k, v)]
    return F.scaled_dot_product_attention(*split).transpose(1, 2).flatten(2)


def comfy_blocks(unet):
    from ldm.modules.attention import BasicTransformerBlock

    class ComfyBlock(BasicTransformerBlock):
        def forward(self, x, context=None, transformer_options=None):
            to = dict(transformer_options if transformer_options is not None
                      else (_current[-1] if _current else {}))
            to["block"], to["block_index"] = self.comfy_where
            patches = to.get("patches", {})
            replace = to.get("patches_replace", {})
            extra = {k: v for k, v in to.items() if k not in ("patches", "patches_replace")}
            n = self.norm1(x)
            context_attn1 = value_attn1 = None
            if "attn1_patch" in patches:
                context_attn1 = value_attn1 = n
                for p in patches["attn1_patch"]:
                    n, context_attn1, value_attn1 = p(n, context_attn1, value_attn1, extra)
            block = to["block"]
            key = (block[0], block[1], to["block_index"])
            attn1_replace = replace.get("attn1", {})
            if key not in attn1_replace:
                key = block
            if context_attn1 is None:
                context_attn1 = value_attn1 = n
            if key in attn1_replace:
                a = self.attn1
                out = attn1_replace[key](a.to_q(n), a.to_k(context_attn1), a.to_v(value_attn1),
                                         extra)
                n = a.to_out(out)
            else:
                n = _attention(self.attn1, n, context_attn1, value_attn1)
            for p in patches.get("attn1_output_patch", []):
                n = p(n, extra)
            x = n + x
            x = self.attn2(self.norm2(x), context=context) + x
            return self.ff(self.norm3(x)) + x

    for name, m in unet.named_modules():
        if type(m) is BasicTransformerBlock:
            m.__class__ = ComfyBlock
            m.comfy_where = _where(name)
    unet.__class__ = _comfy_unet(type(unet))
    return unet


def _comfy_unet(ldm_class):
    """ComfyUI's ``UNetModel`` over an ldm UNet's layers: ``forward(x, timesteps, context,
    y, control, transformer_options)`` runs the ``diffusion_model`` wrappers (class_obj: the
    UNet) around ``_forward``, which sets ``original_shape`` and hands the options to the
    blocks."""
    from comfy.patcher_extension import WrapperExecutor, get_all_wrappers

    class UNetModel(ldm_class):
        def forward(self, x, timesteps=None, context=None, y=None, control=None,
                    transformer_options={}, **kwargs):  # noqa: B006 (as ComfyUI)
            return WrapperExecutor.new_class_executor(
                self._forward, self, get_all_wrappers(DIFFUSION_MODEL, transformer_options)
            ).execute(x, timesteps, context, y, control, transformer_options, **kwargs)

        def _forward(self, x, timesteps=None, context=None, y=None, control=None,
                     transformer_options={}, **kwargs):  # noqa: B006
            transformer_options["original_shape"] = list(x.shape)
            _current.append(transformer_options)
            try:
                return ldm_class.forward(self, x, timesteps=timesteps, context=context)
            finally:
                _current.pop()

    return UNetModel


class DiTBlock(torch.nn.Module):
    """A joint text+image block calling attn1 patches in the DiT form."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, txt, img, transformer_options):
        x = torch.cat([txt, img], dim=1)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        extra = {k2: v2 for k2, v2 in transformer_options.items()
                 if k2 not in ("patches", "patches_replace")}
        extra["img_slice"] = [txt.shape[1], x.shape[1]]
        pe = torch.zeros(x.shape[1])
        for p in transformer_options.get("patches", {}).get("attn1_patch", []):
            out = p(q, k, v, pe=pe, attn_mask=None, extra_options=extra)
            q, k, v = out.get("q", q), out.get("k", k), out.get("v", v)
        x = x + self.out(_sdpa(q, k, v, self.heads))
        return x[:, txt.shape[1]:]


class DiTModel(torch.nn.Module):
    """A DiT (Flux-like): no UNet transformer blocks."""

    def __init__(self):
        super().__init__()
        self.double_blocks = torch.nn.ModuleList([DiTBlock() for _ in range(2)])

    def forward(self, txt, img, transformer_options):
        for b in self.double_blocks:
            img = b(txt, img, transformer_options)
        return img


def _paste(x, out):
    """``out`` (a crop's prediction) over zeros of ``x``'s shape, at the top left."""
    full = torch.zeros_like(x)
    full[..., :out.shape[-2], :out.shape[-1]] = out
    return full


def dit_sample(patcher, noise, context, sigmas, cfg=1.0, uncond=None, batched=False, area=None,
               **conds):
    """A KSampler run (Euler, cfg 1: one model call per step) on a DiT behind ``patcher``, as
    ComfyUI 0.8.0 makes it (``CFGGuider``): the whole sampling (``outer_sample``) run inside
    the ``outer_sample`` wrappers, called as ``fn(executor, noise, latent_image, sampler,
    sigmas, denoise_mask, callback, disable_pbar, seed, latent_shapes=...)`` with
    ``executor.class_obj`` the guider (its ``model_patcher`` and ``model_options``: a copy
    of the patcher's with its wrappers merged into ``transformer_options["wrappers"]``; a
    wrapper may put another copy in its place, as EasyCache's does); inside, the patcher's
    ``pre_run``, then the sampling's options (a copy of the guider's as it is then, with
    ``sample_sigmas``), the steps, and ``cleanup`` (also on an error). Per step the
    guider's ``predict_noise(x, sigma, model_options, seed)`` inside the ``predict_noise``
    wrappers (LazyCache's), which runs ``calc_cond_batch(model, conds, x, sigma,
    model_options)`` inside the ``calc_cond_batch`` wrappers (EasyCache's): the patcher's
    ``prepare_state(sigma, model_options)`` (its ``on_prepare_state`` callbacks, called
    ``(patcher, sigma, model_options)`` as current ComfyUI does: BlockSparseAttention
    re-installs its override there), then per condition a fresh ``transformer_options``
    (the options' nested dicts copied, their other values shared) with ``cond_or_uncond``,
    ``uuids`` (one per condition) and ``sigmas`` (this step's sigma per image), and
    ``model.apply_model(x, sigma, c_crossattn=context, transformer_options=..., **conds)``.
    ``cfg`` above 1: two calls per step, cond then uncond (``cond_or_uncond`` [0] and [1];
    ``uncond`` the second context), mixed; ``batched``: one call for both, as ComfyUI makes
    it where its memory check lets it batch them: the chunks in its order, uncond first
    (``cond_or_uncond`` [1, 0], one entry per chunk, ``uuids`` alike), latents, contexts and
    tensor conditions concatenated, ``sigmas`` one chunk's. ``area`` (h, w in latent
    pixels): the cond is area conditioning (ComfyUI's ConditioningSetArea): its call gets
    the latent's top-left crop and its output is pasted back over zeros (what ComfyUI's
    averaging gives where one cond covers part of the image), so one step has two grids. The
    latent starts as ``sigmas[0] * noise`` (an empty latent). Returns the final latent."""
    import uuid as _uuid
    from types import SimpleNamespace

    from comfy.patcher_extension import (
        WrapperExecutor,
        WrappersMP,
        copy_nested_dicts,
        get_all_wrappers,
        merge_nested_dicts,
    )
    options = copy_nested_dicts(patcher.model_options)
    to = options.setdefault("transformer_options", {})
    merge_nested_dicts(to.setdefault("wrappers", {}), patcher.wrappers, copy_dict1=False)
    model = patcher.model
    uuids = [_uuid.UUID(int=i + 1) for i in range(2)]
    guider = SimpleNamespace(model_patcher=patcher, model_options=options)

    def calc_cond_batch(model, contexts, x, sigma, model_options):
        patcher.prepare_state(sigma, model_options)
        outs = []
        if batched and len(contexts) > 1:  # one call, the chunks uncond first
            call = merge_nested_dicts({}, model_options["transformer_options"],
                                      copy_dict1=False)
            call["cond_or_uncond"], call["uuids"] = [1, 0], [uuids[1], uuids[0]]
            call["sigmas"] = sigma
            extra = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v
                     for k, v in conds.items()}
            out = model.apply_model(torch.cat([x, x]), torch.cat([sigma, sigma]),
                                    c_crossattn=torch.cat(contexts[::-1]),
                                    transformer_options=call, **extra)
            return list(out.chunk(2))[::-1]
        for which, ctx in enumerate(contexts):
            call = merge_nested_dicts({}, model_options["transformer_options"],
                                      copy_dict1=False)
            call["cond_or_uncond"] = [which] * x.shape[0]
            call["uuids"] = [uuids[which]]
            call["sigmas"] = sigma
            crop = area is not None and which == 0
            xin = x[..., :area[0], :area[1]] if crop else x
            out = model.apply_model(xin, sigma, c_crossattn=ctx, transformer_options=call,
                                    **conds)
            if crop:
                out = _paste(x, out)
            outs.append(out)
        return outs

    def predict_noise(x, sigma, model_options, seed=None):
        contexts = [context] if cfg == 1.0 else [context, uncond]
        outs = WrapperExecutor.new_executor(
            calc_cond_batch, get_all_wrappers(WrappersMP.CALC_COND_BATCH, model_options,
                                              is_model_options=True)
        ).execute(model, contexts, x, sigma, model_options)
        return outs[0] if cfg == 1.0 else outs[1] + cfg * (outs[0] - outs[1])

    def outer_sample(noise, latent_image, sampler, sigmas, denoise_mask=None, callback=None,
                     disable_pbar=False, seed=None, latent_shapes=None):
        x = noise * sigmas[0] + latent_image
        patcher.pre_run()
        try:
            sampling = copy_nested_dicts(guider.model_options)
            sampling["transformer_options"]["sample_sigmas"] = sigmas
            for i in range(len(sigmas) - 1):
                sigma = sigmas[i].expand(x.shape[0])
                denoised = WrapperExecutor.new_class_executor(
                    predict_noise, guider, get_all_wrappers(
                        WrappersMP.PREDICT_NOISE, guider.model_options, is_model_options=True)
                ).execute(x, sigma, sampling, seed)
                x = x + (x - denoised) / sigmas[i] * (sigmas[i + 1] - sigmas[i])
        finally:
            patcher.cleanup()
        return x

    return WrapperExecutor.new_class_executor(
        outer_sample, guider, get_all_wrappers(WrappersMP.OUTER_SAMPLE, options,
                                               is_model_options=True)
    ).execute(noise, torch.zeros_like(noise), "euler", sigmas, None, None, False, None,
              latent_shapes=[noise.shape])
