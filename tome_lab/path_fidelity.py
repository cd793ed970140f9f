"""The presets' fidelity through ComfyUI's path against the diffusers path, on the tiny DiT.

    python -m tome_lab.path_fidelity            # ~5 min on one thread; prints the table

The diffusers path is the library's patch (``tome.apply_patch``: the attention processors
of the tiny DiT's ``FluxTransformer2DModel``, timesteps). The ComfyUI path runs the same
weights and the same Euler sampling the way ComfyUI 0.8.0 runs a Flux model, written here from
its public behaviour (no ComfyUI code): a ``ModelPatcher`` whose clone the library patches
(``tome.adapters.patch_model_patcher``: an ``apply_model`` wrapper that installs the attention
override per model call, run callbacks that reset residual reuse), ``apply_model(x, sigma,
...)`` with the sampling's ``transformer_options`` (``sigmas``, ``cond_or_uncond``), and a
Flux-form model whose blocks write ``block_type``/``block_index`` into the options and call
``optimized_attention(q, k, v, heads, skip_reshape=True, transformer_options=...)`` with
queries and keys rotated first (so ``rope="pooled"`` is applied as ``"before"`` there).

Both paths sample the same (class, seed) images from the same noise; PSNR is each path's
image against that path's unpatched image (the two unpatched images agree within float
error: checked first).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
from typing import Any

import torch
from torch import nn

import tome
from tome import adapters

from . import quality

#: The presets with a DiT point (``balanced`` leaves a DiT as it is).
PRESETS = ("quality", "fast")


# ----------------------------------------------------------------------------- ComfyUI's form

def optimized_attention(q, k, v, heads, mask=None, skip_reshape=False,
                        skip_output_reshape=False, transformer_options=None, **kwargs):
    """ComfyUI's selected attention backend as the models call it: where the call's
    ``transformer_options`` hold ``optimized_attention_override``, the call becomes
    ``override(backend, q, k, v, heads, mask=..., **kwargs)``."""
    kw = dict(mask=mask, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
              transformer_options=transformer_options, **kwargs)
    override = (transformer_options or {}).get("optimized_attention_override")
    if override is not None:
        return override(attention_pytorch, q, k, v, heads, **kw)
    return attention_pytorch(q, k, v, heads, **kw)


def attention_pytorch(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False,
                      **kwargs):
    """ComfyUI's SDPA backend (its name is what the library reads: it adds masks):
    ``[B, heads, S, D]`` with ``skip_reshape``, else ``[B, S, heads * D]``; answers
    ``[B, S, heads * D]`` unless ``skip_output_reshape``; a mask broadcast to 4-D."""
    if not skip_reshape:
        b = q.shape[0]
        q, k, v = (t.view(b, -1, heads, t.shape[-1] // heads).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        while mask.dim() < 4:
            mask = mask[None]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out if skip_output_reshape else out.transpose(1, 2).flatten(2)


class FluxAttention:
    """A diffusers Flux attention module's processor calling attention as ComfyUI's Flux does
    (``comfy.ldm.flux.math.attention``): projections and norms, ``[text, image]``, RoPE on
    queries and keys, then ``optimized_attention`` on ``[B, heads, S, D]`` with the block's
    ``transformer_options``."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, transformer_options=None):
        from diffusers.models.embeddings import apply_rotary_emb

        def heads(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
            return norm(x.unflatten(-1, (-1, attn.head_dim)))

        q = heads(attn.to_q(hidden_states), attn.norm_q)
        k = heads(attn.to_k(hidden_states), attn.norm_k)
        v = attn.to_v(hidden_states).unflatten(-1, (-1, attn.head_dim))
        if encoder_hidden_states is not None:
            e = encoder_hidden_states
            q = torch.cat([heads(attn.add_q_proj(e), attn.norm_added_q), q], 1)
            k = torch.cat([heads(attn.add_k_proj(e), attn.norm_added_k), k], 1)
            v = torch.cat([attn.add_v_proj(e).unflatten(-1, (-1, attn.head_dim)), v], 1)
        q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
        k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = optimized_attention(q, k, v, q.shape[1], skip_reshape=True,
                                  transformer_options=transformer_options).to(q.dtype)
        if encoder_hidden_states is None:
            return out
        text = encoder_hidden_states.shape[1]
        img = attn.to_out[1](attn.to_out[0](out[:, text:].contiguous()))
        return img, attn.to_add_out(out[:, :text].contiguous())


class Flux(nn.Module):
    """The tiny DiT's transformer as a ComfyUI Flux: its modules under ComfyUI's names
    (``img_in``, ``txt_in``, ``time_in``, ``pe_embedder``, ``double_blocks``,
    ``single_blocks``), ``forward(x, timestep, context, y, transformer_options)`` on a
    ``[B, C, H, W]`` latent packed 2x2, ``[text, image]``, the options' ``block_type`` and
    ``block_index`` written in place per block, attention through ``FluxAttention``.
    ``__module__`` is ComfyUI's, as the library recognises its Flux (``dits/comfy_flux.py``)."""

    __module__ = "comfy.ldm.flux.model"
    patch_size = 2

    def __init__(self, transformer: nn.Module):
        super().__init__()
        t = transformer
        self.img_in, self.txt_in, self.time_in = t.x_embedder, t.context_embedder, \
            t.time_text_embed
        self.pe_embedder = t.pos_embed
        self.double_blocks, self.single_blocks = t.transformer_blocks, t.single_transformer_blocks
        self.norm_out, self.proj_out = t.norm_out, t.proj_out
        for block in [*self.double_blocks, *self.single_blocks]:
            block.attn.set_processor(FluxAttention())

    def forward(self, x, timestep, context, y=None, control=None, transformer_options=None,
                **kwargs):
        from .tinydit.model import pack, unpack
        options = {} if transformer_options is None else transformer_options
        h, w = x.shape[-2:]
        tokens, img_ids = pack(x)
        img = self.img_in(tokens)
        temb = self.time_in(timestep.to(img.dtype) * 1000, y)  # Flux's time factor
        txt = self.txt_in(context)
        ids = torch.cat([torch.zeros(txt.shape[1], 3), img_ids]).to(x.device)
        pe = self.pe_embedder(ids)
        kw = {"joint_attention_kwargs": {"transformer_options": options}}
        for kind, blocks in (("double", self.double_blocks), ("single", self.single_blocks)):
            options["total_blocks"], options["block_type"] = len(blocks), kind
            for i, block in enumerate(blocks):
                options["block_index"] = i
                txt, img = block(hidden_states=img, encoder_hidden_states=txt, temb=temb,
                                 image_rotary_emb=pe, **kw)
        return unpack(self.proj_out(self.norm_out(img, temb)), h, w)


class FlowSampling:
    """ComfyUI's flow model sampling (``CONST``; SD3's shift formula at the tiny DiT's shift
    1, multiplier 1: the timestep is the sigma): the denoised latent ``x - v * sigma``."""

    def __init__(self, shift: float = 1.0):
        self.shift = shift

    def sigma(self, t: float) -> float:
        return self.shift * t / (1 + (self.shift - 1) * t)

    def percent_to_sigma(self, percent: float) -> float:
        return 1.0 if percent <= 0 else 0.0 if percent >= 1 else self.sigma(1.0 - percent)


class _Executor:
    """A wrapper's ``executor``: ``executor(*args, **kwargs)`` goes on; ``class_obj``."""

    def __init__(self, go, class_obj):
        self.go, self.class_obj = go, class_obj

    def __call__(self, *args, **kwargs):
        return self.go(*args, **kwargs)


class BaseModel(nn.Module):
    """``comfy.model_base.BaseModel``: ``apply_model(x, t, c_concat, c_crossattn, control,
    transformer_options, **conds)`` runs the options' ``apply_model`` wrappers (the first
    added outermost, every argument positional) around the diffusion model, the sigma handed
    as its timestep; answers the denoised latent."""

    def __init__(self, diffusion_model: nn.Module, model_sampling: FlowSampling):
        super().__init__()
        self.diffusion_model, self.model_sampling = diffusion_model, model_sampling

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None,
                    transformer_options=None, **conds):
        wrappers = [fn for fns in (transformer_options or {}).get("wrappers", {}).get(
            "apply_model", {}).values() for fn in fns]

        def run(i: int, *args, **kwargs):
            if i == len(wrappers):
                return self._apply_model(*args, **kwargs)
            return wrappers[i](_Executor(lambda *a, **k: run(i + 1, *a, **k), self),
                               *args, **kwargs)
        return run(0, x, t, c_concat, c_crossattn, control, transformer_options, **conds)

    def _apply_model(self, x, t, c_concat, c_crossattn, control, transformer_options, **conds):
        v = self.diffusion_model(x, t, context=c_crossattn, control=control,
                                 transformer_options=transformer_options, **conds)
        return x - v.float() * t.view(-1, 1, 1, 1)


class OlderPatcher:
    """ComfyUI's ``ModelPatcher`` as far as the library patches it, without the run
    callbacks' API (ComfyUI before it; the library then applies a preset's point without
    reuse): a clone shares the model and copies wrappers (and callbacks) per key."""

    def __init__(self, model: BaseModel):
        self.model = model
        self.model_options: dict = {"transformer_options": {}}
        self.wrappers: dict = {}
        self.callbacks: dict = {}

    def clone(self) -> OlderPatcher:
        n = type(self)(self.model)
        n.wrappers = {t: {k: fns[:] for k, fns in w.items()} for t, w in self.wrappers.items()}
        n.callbacks = {t: {k: fns[:] for k, fns in c.items()} for t, c in self.callbacks.items()}
        return n

    def get_model_object(self, name: str) -> Any:
        return getattr(self.model, name)

    def add_wrapper_with_key(self, kind: str, key: str, fn) -> None:
        self.wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

    def run_callbacks(self, kind: str) -> None:
        """What the sampler calls around a sampling (``on_pre_run``; ``on_cleanup``)."""
        for fns in self.callbacks.get(kind, {}).values():
            for fn in fns:
                fn(self)


class ModelPatcher(OlderPatcher):
    """With the run callbacks (``add_callback_with_key``): what residual reuse needs."""

    def add_callback_with_key(self, kind: str, key: str, fn) -> None:
        self.callbacks.setdefault(kind, {}).setdefault(key, []).append(fn)

    def remove_callbacks_with_key(self, kind: str, key: str) -> None:
        self.callbacks.get(kind, {}).pop(key, None)


def comfy_model(weights: str | None = None) -> tuple[ModelPatcher, nn.Module]:
    """A ComfyUI ``ModelPatcher`` around the tiny DiT's weights in Flux form, and the class
    table (the "text encoder") of the same weights."""
    from . import tinydit
    from .tinydit.model import SHIFT
    model = tinydit.load_model(weights)
    return ModelPatcher(BaseModel(Flux(model.transformer), FlowSampling(SHIFT))), model


@torch.no_grad()
def comfy_sample(patcher: OlderPatcher, table: nn.Module, classes, seed: int = 0,
                 steps: int = 20, size: int = 64, guidance: float = 1.0) -> torch.Tensor:
    """``tinydit.sample`` as ComfyUI's KSampler runs it (Euler; cfg 1: one model call per
    step, else cond and uncond batched in one call, ``cond_or_uncond`` [0, 1], mixed on the
    denoised latents): the run callbacks around the steps (cleanup in ``finally``), per step
    fresh ``transformer_options`` with the patcher's wrappers, the sampling's
    ``sample_sigmas``, this step's ``sigmas`` and ``cond_or_uncond``, then ``apply_model(x,
    sigma, None, context, None, options, y=pooled)``; the same noise, sigmas
    (``tinydit.model.schedule``) and output range as ``tinydit.sample`` (whose ``guidance``
    batches the null class alike)."""
    from .tinydit.model import NULL, TEXT_TOKENS, schedule
    g = torch.Generator().manual_seed(seed)
    cls = torch.as_tensor(classes, dtype=torch.long)
    b = len(cls)
    x = torch.randn((b, 3, size, size), generator=g)
    both = cls if guidance == 1.0 else torch.cat([cls, torch.full_like(cls, NULL)])
    context = table.text(both).view(len(both), TEXT_TOKENS, -1)
    pooled = table.pooled(both)
    who = [0] * b + ([] if guidance == 1.0 else [1] * b)
    sigmas = schedule(steps)
    x = x * sigmas[0]
    base = patcher.model
    patcher.run_callbacks("on_pre_run")
    try:
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            sigma = s.expand(len(both))
            options = {**patcher.model_options["transformer_options"],
                       "wrappers": patcher.wrappers, "sample_sigmas": sigmas, "sigmas": sigma,
                       "cond_or_uncond": who}
            xs = x if guidance == 1.0 else torch.cat([x, x])
            denoised = base.apply_model(xs, sigma, None, context, None, options, y=pooled)
            if guidance != 1.0:
                cond, uncond = denoised.chunk(2)
                denoised = uncond + guidance * (cond - uncond)
            x = x + (x - denoised) / s * (s_next - s)
    finally:
        patcher.run_callbacks("on_cleanup")
    return ((x.clamp(-1, 1) + 1) / 2).float()


# ----------------------------------------------------------------------------- the comparison

@contextlib.contextmanager
def _diffusers(model: nn.Module, config: Any):
    """The tiny DiT patched through the library (diffusers path) for the duration."""
    if config is not None:
        tome.apply_patch(model, config=config)
    try:
        yield
    finally:
        tome.remove_patch(model)


def compare(images: list[tuple[int, int]], steps: int = 20, size: int = 64,
            presets: tuple[str, ...] = PRESETS, progress=None,
            weights: str | None = None, guidance: float = 1.0) -> dict[str, Any]:
    """Each preset (``policy="fixed"``) through both paths on ``images`` ((class, seed)
    pairs). ``{"unpatched": the largest pixel difference of the two paths' unpatched images,
    "rows": [...]}``, a row per preset: PSNR (dB, each path against its own unpatched images)
    of the diffusers path (``diffusers``), of the diffusers path with ``rope="before"``
    (``before``: what the ComfyUI path applies, its keys arriving rotated), of the ComfyUI
    path (``comfyui``) and of the ComfyUI path on a patcher without run callbacks
    (``no_reuse``: the preset's point without reuse); ``pixels``: the largest pixel
    difference between the ComfyUI path's and the ``before`` images; ``limits``: what the
    ComfyUI path leaves out of the settings, in its words; ``config``."""
    from . import tinydit
    model = tinydit.load_model(weights)
    patcher, table = comfy_model(weights)
    older = OlderPatcher(patcher.model)
    configs = {p: tome.preset(p, policy="fixed") for p in presets}

    def diffusers(config: Any) -> list[torch.Tensor]:
        out = []
        with _diffusers(model, config):
            for cls, seed in images:  # a hand-written loop: its bracket tells the step count
                with tome.generation(model, steps=steps):
                    out.append(tinydit.sample(model, [cls], seed=seed, steps=steps, size=size,
                                              guidance=guidance)[0])
        return out

    def comfyui(config: Any, on: OlderPatcher = patcher) -> tuple[list[torch.Tensor], list]:
        clone, limits = on, []
        if config is not None:
            clone, _ = adapters.patch_model_patcher(on, config)
            found = adapters.handle(clone)
            limits = found.limits if found is not None else []
        return [comfy_sample(clone, table, [cls], seed, steps, size, guidance)[0]
                for cls, seed in images], limits

    def psnr(imgs: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
        return statistics.mean(float(quality.psnr(a[None], r[None])) for a, r in zip(imgs, ref))

    def largest(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    if progress:
        progress("unpatched")
    ref_d, (ref_c, _) = diffusers(None), comfyui(None)
    rows = []
    for name, config in configs.items():
        if progress:
            progress(f"preset {name}")
        (c, limits), d = comfyui(config), diffusers(config)
        before = diffusers(config.replace(rope="before")) if config.rope != "before" else d
        rows.append({"preset": name, "config": config, "limits": limits,
                     "diffusers": psnr(d, ref_d), "before": psnr(before, ref_d),
                     "comfyui": psnr(c, ref_c), "no_reuse": psnr(comfyui(config, older)[0], ref_c),
                     "pixels": largest(c, before)})
    return {"unpatched": largest(ref_d, ref_c), "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| preset (its DiT point) | diffusers path | diffusers path, rope before | ComfyUI "
             "path | ComfyUI - diffusers | ComfyUI - diffusers (rope before) | ComfyUI path "
             "without run callbacks (no reuse) |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        c = r["config"]
        lines.append(
            f"| {r['preset']} (`{c.schedule}`, reuse {c.reuse}, rope {c.rope}) | "
            f"{r['diffusers']:.2f} dB | {r['before']:.2f} dB | {r['comfyui']:.2f} dB | "
            f"{r['comfyui'] - r['diffusers']:+.2f} dB | {r['comfyui'] - r['before']:+.2f} dB "
            f"(pixels within {r['pixels']:.0e}) | {r['no_reuse']:.2f} dB |")
    return (f"Unpatched, the two paths' images differ by at most {result['unpatched']:.0e} "
            "(pixels in [0, 1]).\n\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tome_lab.path_fidelity",
                                description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", default="0,4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--guidance", type=float, default=1.0,
                   help="classifier-free guidance (above 1: cond and uncond in one call)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    images = [(c, int(s) + k) for s in a.seeds.split(",") for k, c in enumerate((0, 1, 2, 3))]

    def progress(msg: str) -> None:
        print(f"\r{msg:<40}", end="", file=sys.stderr, flush=True)

    result = compare(images, a.steps, progress=progress, guidance=a.guidance)
    print(file=sys.stderr)
    print(f"Tiny DiT, {len(images)} images, {a.steps} Euler steps, guidance {a.guidance:g}, "
          "64 px, fp32; PSNR of each path against its own unpatched images.\n")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
