"""Stand-ins and fake clocks shared by the tests (one home: no test imports another).

- ``Patcher``, ``self_attention_block``, ``forge_unet``: the ModelPatcher contract as the Forge
  family and ComfyUI keep it (docs/webui.md, "What happens during a generation"), written
  from observed behaviour; the model carries Forge's ``predictor`` (its noise schedule:
  ``percent_to_sigma``), and blocks get the k-diffusion sigma a real sampler hands
  (``SD15_SIGMAS``: 4 Euler steps, normal schedule, as real ComfyUI 0.8.0 and Forge Neo hand
  them);
- ``FluxLike``: a DiT whose blocks never call the attn1 patches;
- ``FakeClock``, ``fake_clock``: measuring clocks that answer per phase
  (``measure.PHASES``);
- ``compiles_like_eager``: a function compiled in one graph gives its eager answer;
- ``tiny_flux_pipeline``: the real diffusers ``FluxPipeline`` around the tiny DiT.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from models import TINY_SD15, ldm_unet

from tome.measure import PHASES

# The sigmas of 4 Euler steps with the normal schedule on SD1.5, as the real ComfyUI 0.8.0 and
# Forge Neo hand them to the model (the last, 0, is never a model call).
SD15_SIGMAS = (14.6146, 2.9183, 0.9324, 0.0292, 0.0)


class Predictor:
    """Forge's SD1.5 ``predictor`` (``backend/modules/k_prediction.py``) as it behaves: the
    scaled-linear schedule's sigma per training timestep, ``percent_to_sigma(p)`` the sigma at
    ``t = (1 - p) * 999`` (a huge number at 0, 0 at 1). Written from its behaviour."""

    def __init__(self):
        betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
        cumprod = torch.cumprod(1 - betas, 0)
        self.log_sigmas = (((1 - cumprod) / cumprod) ** 0.5).log().float()

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 999999999.9
        if percent >= 1.0:
            return 0.0
        t = torch.tensor((1.0 - percent) * 999.0)
        lo, hi = int(t.floor()), int(t.ceil())
        w = float(t - lo)
        return float(((1 - w) * self.log_sigmas[lo] + w * self.log_sigmas[hi]).exp())

    # what the KModel's apply_model asks (eps prediction): the scaled input, the training
    # timestep nearest the sigma, the denoised latent
    def calculate_input(self, sigma, x):
        return x / (sigma.view(-1, *[1] * (x.ndim - 1)) ** 2 + 1) ** 0.5

    def timestep(self, sigma):
        return (self.log_sigmas.view(1, -1) - sigma.log().view(-1, 1)).abs().argmin(1)

    def calculate_denoised(self, sigma, out, x):
        return x - out * sigma.view(-1, *[1] * (x.ndim - 1))

    def simple_sigmas(self, steps):
        """Evenly spaced training timesteps from the last, then 0 (4 steps: ``SD15_SIGMAS``'s
        first 14.61)."""
        return torch.tensor([float(self.log_sigmas[round(999 * (1 - i / steps))].exp())
                             for i in range(steps)] + [0.0])


class Patcher:
    """Forge's UnetPatcher as the contract describes it: clones share the model; attn1
    replacements live in ``model_options["transformer_options"]["patches_replace"]``."""

    def __init__(self, diffusion_model):
        self.model = torch.nn.Module()
        self.model.diffusion_model = diffusion_model
        self.model.predictor = Predictor()
        self.patches = {"attn1_patch": [], "attn1_output_patch": []}
        self.model_options = {"transformer_options": {}}

    def clone(self):
        c = copy.copy(self)
        c.patches = {k: list(v) for k, v in self.patches.items()}
        c.model_options = copy.deepcopy(self.model_options)
        return c

    def set_model_attn1_replace(self, fn, block_name, number, index):
        to = self.model_options["transformer_options"]
        to.setdefault("patches_replace", {}).setdefault("attn1", {})[
            (block_name, number, index)] = fn

    def set_model_attn1_patch(self, fn):
        self.patches["attn1_patch"].append(fn)

    def set_model_attn1_output_patch(self, fn):
        self.patches["attn1_output_patch"].append(fn)


def self_attention_block(patcher, x, shape, sigma=SD15_SIGMAS[0], cross=None, block=("input", 1),
                         index=0):
    """What Forge's BasicTransformerBlock does around attn1 (norm, patches, attention or its
    replacement). As in Forge, ``patches_replace`` is not among the patches' ``extra``."""
    n = F.layer_norm(x, x.shape[-1:])
    k = v = n if cross is None else cross
    extra = {"original_shape": list(shape), "sigmas": torch.tensor([sigma]), "block": block,
             "block_index": index}
    for p in patcher.patches["attn1_patch"]:
        n, k, v = p(n, k, v, extra)
    replace = patcher.model_options["transformer_options"].get("patches_replace", {})
    attention = replace.get("attn1", {}).get((*block, index))
    out = attention(n, k, v, extra) if attention else F.scaled_dot_product_attention(n, k, v)
    for p in patcher.patches["attn1_output_patch"]:
        out = p(out, extra)
    return x + out


_FORGE_OPTIONS: list[dict] = []  # the transformer_options of the UNet call now running


def forge_unet(config=TINY_SD15):
    """The tiny UNet with Forge's block contract: ``forward(x, context, transformer_options)``
    calling ``patches["attn1_patch"]`` with (n, k, v) right before attn1 and
    ``patches["attn1_output_patch"]`` right after (docs/webui.md; Forge Classic's
    ``ldm_patched`` block behaves the same). Called whole as Forge's UNet is,
    ``forward(x, timesteps, context, control, transformer_options)``, it sets
    ``original_shape`` in the module and hands its blocks the options (``block`` and
    ``block_index`` each), as Forge's ``UNetModel`` does."""
    from ldm.modules.attention import BasicTransformerBlock

    class ForgeBlock(BasicTransformerBlock):
        def forward(self, x, context=None, transformer_options=None):
            if transformer_options is None:  # inside a whole UNet call (its options)
                transformer_options = dict(_FORGE_OPTIONS[-1]) if _FORGE_OPTIONS else {}
                if hasattr(self, "forge_where"):
                    transformer_options["block"], transformer_options["block_index"] = \
                        self.forge_where
            patches = transformer_options.get("patches", {})
            extra = {k: v for k, v in transformer_options.items()
                     if k not in ("patches", "patches_replace")}
            n = self.norm1(x)
            k = v = n
            for p in patches.get("attn1_patch", []):
                n, k, v = p(n, k, v, extra)
            q = self.attn1.to_q(n)
            k, v = self.attn1.to_k(k), self.attn1.to_v(v)
            h = self.attn1.heads
            split = [t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*split).transpose(1, 2).flatten(2)
            out = self.attn1.to_out(out)
            for p in patches.get("attn1_output_patch", []):
                out = p(out, extra)
            x = x + out
            x = self.attn2(self.norm2(x), context=context) + x
            return self.ff(self.norm3(x)) + x

    unet = ldm_unet(config)
    for name, m in unet.named_modules():
        if type(m) is BasicTransformerBlock:
            m.__class__ = ForgeBlock
            side, number = name.split(".")[:2] if not name.startswith("middle") else \
                ("middle", 0)
            m.forge_where = ((side.replace("_blocks", ""), int(number)),
                             int(name.rsplit(".", 1)[-1]))
    ldm_class = type(unet)

    class UNetModel(ldm_class):
        def forward(self, x, timesteps=None, context=None, control=None,
                    transformer_options={}, **kwargs):  # noqa: B006 (as Forge)
            transformer_options["original_shape"] = list(x.shape)
            _FORGE_OPTIONS.append(transformer_options)
            try:
                return ldm_class.forward(self, x, timesteps=timesteps, context=context)
            finally:
                _FORGE_OPTIONS.pop()

    unet.__class__ = UNetModel
    return unet


class FluxLike(torch.nn.Module):
    """A stand-in of the DiTs Forge Neo also runs (Flux, Chroma, Qwen-Image, Lumina, Wan,
    Z-Image): transformer blocks that are not ``BasicTransformerBlock`` and never call the
    attn1 patches."""

    def __init__(self):
        super().__init__()
        self.double_blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(2)])
        self.single_blocks = torch.nn.ModuleList([torch.nn.Linear(8, 8)])


class FakeClock:
    """Returns the given seconds in turn, given per round as (unmerged, plan build, merged)
    whatever order the rounds run them in, and runs ``fn`` as a real clock would."""

    def __init__(self, seconds):
        seconds = list(seconds)
        self.queues = {name: seconds[i::3] for i, name in enumerate(PHASES)}
        self.calls = 0

    def __call__(self, phase, fn):
        fn()
        self.calls += 1
        return self.queues[phase].pop(0)


def fake_clock(speedup: float, calls: list | None = None, run_blocks: bool = True):
    """A clock under which a merged block runs ``speedup`` times faster (plan builds free).
    ``run_blocks=False`` skips running the blocks (only plans are built): fast at any size."""
    def clock(phase, fn):
        if run_blocks or phase == "build":
            fn()
        if calls is not None:
            calls.append(phase)
        return {"unmerged": 1.0, "build": 0.0, "merged": 1.0 / speedup}[phase]
    return clock


def compiles_like_eager(fn, *args) -> None:
    """``fn`` compiles with ``fullgraph=True`` (no graph break) and the compiled call gives
    what the eager call gives (its first output)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    with torch.no_grad():
        out, ref = compiled(*args), fn(*args)
    torch.testing.assert_close(out[0], ref[0])


def tiny_flux_pipeline(m: Any) -> tuple[Any, dict]:
    """The real diffusers ``FluxPipeline`` around the tiny DiT ``m``'s transformer (no VAE,
    no text encoders; progress bar off) and class 3's prompt embeddings to call it with."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from tome_lab.tinydit.model import TEXT_TOKENS
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=None,
                        text_encoder=None, tokenizer=None, text_encoder_2=None,
                        tokenizer_2=None, transformer=m.transformer)
    pipe.set_progress_bar_config(disable=True)
    cls = torch.tensor([3])
    with torch.no_grad():
        embeds = {"prompt_embeds": m.text(cls).view(1, TEXT_TOKENS, -1),
                  "pooled_prompt_embeds": m.pooled(cls)}
    return pipe, embeds
