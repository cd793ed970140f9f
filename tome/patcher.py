"""ModelPatcher adapter: the same merge, applied through a UNet patcher instead of hooks.

The contract it speaks is the one the Forge family (Forge, Forge Neo, reForge, Forge Classic)
and ComfyUI share: a ``ModelPatcher`` (Forge: ``UnetPatcher``) whose ``clone()`` shares the
modules, so hooks would leak into other passes; the supported way is a clone with an
``attn1`` patch, called as ``(n, k, v, extra_options) -> (n, k, v)`` right before
self-attention, and an ``attn1`` output patch ``(n, extra_options) -> n`` right after it, with
``transformer_options`` (``original_shape``, ``block``, ``sigmas``) in ``extra_options``. The
host rebuilds the patched UNet before every sampling pass from its patcher.

The step is known only by its k-diffusion sigma (14.6 down to 0.03 on SD1.5; 1 down to 0 on a
flow-matching DiT), so the ``start``/``end`` window is converted once, at patch time, with the
model's own ``percent_to_sigma`` (ComfyUI's ``model_sampling``, the Forge family's
``predictor``): ``window_of``.

The DiT call form of ComfyUI's Flux and Qwen-Image blocks is answered by ``DitAttn1Patch``.

Differences from the hook-based patch, both forced by what the patcher exposes:
- the similarity metric is the normalised block input ``norm1(x)`` (what ComfyUI's ToMe uses),
  not ``x`` itself, so results are close to, not equal to, the ldm patch;
- only self-attention can be merged (there is no patch point around the feed-forward layer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import dit, policy
from . import layout as _layout
from .config import ToMeConfig
from .plan import Call, Planner, Window, discrete_percent_to_sigma, flow_percent_to_sigma
from .report import ATTN1_PATCH, PatchReport

# The latent's (height, width), or a video latent's (frames, height, width) (``[B, C, T, H, W]``:
# ``x.shape[2:]``), put into ``transformer_options`` by a host layer that sees the diffusion
# model's input (the ComfyUI node's wrapper): a DiT's token grid, which the DiT call form does
# not carry.
LATENT_KEY = "tome_latent"

MARK = "_tome_sd_forge"  # set on a patcher clone that carries our patches (name kept: older
# clones in a running host still carry it)


class Attn1Patch:
    """The two patch functions for one sampling pass, sharing the plan of the current block.

    The contract has no hook at the start of a UNet call, so a call starts when the first
    block seen in this pass comes round again. The step's sigma stands in for the timestep (it
    stays on the device: the partition is hashed from it there).
    """

    def __init__(self, config: ToMeConfig, max_downsample: int, levels: list[int],
                 replacements: Callable[[], Mapping], measurer: Callable | None = None,
                 window: Window | None = None):
        self.config, self.max_downsample = config, max_downsample
        # The attn1 replacements of the patcher that samples (Forge keeps ``patches_replace``
        # out of ``extra_options``, and Self-Attention Guidance adds its own after us).
        self.replacements = replacements
        self.planner = Planner(config, max_downsample, measurer, levels, window=window)
        self.method = self.planner.method
        self.skipped: list[tuple[Any, str]] = []  # (block, reason), once per block, live
        self.plan: Any = None  # the plan of the block between attn1 and its output
        self.first: Any = None
        self.call: Call | None = None
        self.calls = 0  # attn1 calls received (a host whose blocks never call us: 0)

    def _begin(self, block: Any, n: torch.Tensor, extra: dict) -> None:
        if self.first is None:
            self.first = block
        if block == self.first or self.call is None:
            size = tuple(extra["original_shape"][-2:])
            self.call = self.planner.begin(size, n.device, extra.get("sigmas"), n.shape[0])

    def _replaced(self, block: Any, extra: dict) -> bool:
        """Another patch replaces this block's attn1 (Self-Attention Guidance records the middle
        block's attention map this way): it must see every token, so leave the block alone.
        Forge looks a replacement up by ``(name, number, index)``, then by ``(name, number)``."""
        replace = (extra.get("patches_replace") or {}).get("attn1") or self.replacements()
        if block not in replace and block[:2] not in replace:
            return False
        if not any(b == block for b, _ in self.skipped):
            self.skipped.append((block, "attn1 replaced by another patch (e.g. Self-Attention "
                                        "Guidance)"))
        return True

    SILENT = ("ToMe: this model's blocks never called the attn1 patch (another node replaced "
              "them), so nothing is merged")

    def __deepcopy__(self, memo: dict) -> Attn1Patch:
        """Shared, never copied: ComfyUI deep-copies ``model_options`` (and with it this
        instance's bound methods) on every clone; a patch is one function, like a closure."""
        return self

    def _retiled(self, block: Any, n: torch.Tensor, extra: dict) -> bool:
        """An attn1 patch before ours split the tokens into tiles (ComfyUI's HyperTile: the
        batch grows, each tile looks like a deeper level's grid): leave the block alone."""
        batch = extra["original_shape"][0]
        if n.shape[0] == batch:
            return False
        if not any(b == block for b, _ in self.skipped):
            self.skipped.append((block, "attn1 input split into tiles by another patch (e.g. "
                                        "HyperTile)"))
        return True

    def attn1(self, n: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: dict | None = None,
              **dit: Any):
        """The UNet call form ``(n, k, v, extra) -> (n, k, v)``. The DiT call form (ComfyUI's
        Flux/Qwen-Image blocks: ``(q, k, v, pe=, attn_mask=, extra_options=)`` returning a
        dict of what changed) gets an empty dict: DiTs are not merged."""
        self.plan = None
        self.calls += 1
        if extra is None:
            return {}
        if extra.get("original_shape") is None or n.dim() != 3:
            return n, k, v
        block = (*tuple(extra.get("block") or ()), extra.get("block_index", 0))
        self._begin(block, n, extra)
        # Only a block that would be merged can be "skipped" because another patch owns it.
        if self.call is None or not self.planner.merges(self.call, n.shape[1]) \
                or self._replaced(block, extra) or self._retiled(block, n, extra):
            return n, k, v
        self_attention = k is n and v is n
        if "attn1" not in self.method.sub_layers(self.config) \
                or (self.method.self_attention_only and not self_attention):
            return n, k, v
        plan = self.planner.plan(self.call, n, decoder=block[0] == "output")
        if plan is None:
            return n, k, v
        if self.method.unmerges:
            self.plan = plan
        return reduce_attn1(self.method, plan, n, k, v, self_attention)

    def attn1_output(self, n: torch.Tensor, extra: dict) -> torch.Tensor:
        plan, self.plan = self.plan, None
        return n if plan is None else self.method.restore(plan, n)


class DitAttn1Patch:
    """The DiT call form of ComfyUI's Flux and Qwen-Image blocks (double and single stream):
    ``p(q, k, v, pe=, attn_mask=, extra_options=)`` with ``[B, heads, S, D]`` tensors before
    RoPE, the joint sequence ``[text, image]`` (``extra_options["img_slice"] = [text, end]``)
    and ``block_type`` / ``block_index``; the block reads back ``q``, ``k``, ``v``, ``pe`` from
    the returned dict. Pooling answers with the queries rotated, the image keys (rotated, per
    ``rope``) and values pooled, and ``pe`` an identity rotation that broadcasts over any
    sequence length: valid where attention rotates only when ``pe`` is not None (Flux) and
    where the block rotates what the patch returns unconditionally (upstream Qwen-Image).
    Anything it cannot pool (a mask, a grid that does not fit: named in ``skipped``; a block
    ``blocks`` leaves out, the step window, the auto policy) is answered with ``{}``: the block
    runs as without us.

    A call starts when the first block seen comes round again (the form has no call hook);
    the grid ``(frames, h, w)`` comes from the latent under ``LATENT_KEY`` (a video latent's
    frames: one token frame each; image tokens past the grid, e.g. Kontext's reference
    latents, stay whole), else from a square image token count (one frame)."""

    def __init__(self, config: ToMeConfig, layout: _layout.Layout, unet_patcher: Any = None):
        self.config, self.dit = config, layout.dit
        self.method = dit.method_for(config)
        # What this form applies: proportional attention and residual reuse need the kernel's
        # inputs and output, and the form hands back q, k, v only, so a preset's DiT point is
        # its point without reuse (``config.without_reuse``), unbiased; ``limits`` names what
        # is left out. The schedule gives each block its factor (its per-item windows are not
        # applied: the planner's window, in the host's sigmas, is the schedule's whole span).
        from .config import without_reuse
        self.applied = without_reuse(config).replace(proportional=False)
        schedule, n = dit.schedule_of(self.applied), len(layout.blocks)
        self.factors = {i: schedule.factor(i, b.kind, n, None)
                        for i, b in enumerate(layout.blocks)}
        self.chosen = {i for i, f in self.factors.items() if f}
        self.limits = [x for x, on in (("proportional attention", config.proportional),
                                       ("residual reuse", config.reuse),
                                       ("per-step schedule windows", schedule.varies())) if on]
        start, end = schedule.window()
        window = window_of(unet_patcher, config.replace(start=start, end=end), flow=True)
        self.planner = Planner(config, layout.dit.patch, None, [layout.dit.patch],
                               method=self.method, window=window)
        self.doubles = sum(b.kind == "double" for b in layout.blocks)
        self.skipped: list[tuple[Any, str]] = []
        self.first: Any = None
        self.call: Call | None = None
        self.calls = 0  # DiT-form calls received (a host whose blocks never call us: 0)

    SILENT = ("ToMe: this ComfyUI's DiT blocks never called the attn1 patch (ComfyUI 0.8.0's "
              "Flux does not; later versions do), so nothing is pooled; update ComfyUI to pool "
              "image keys/values")

    def __deepcopy__(self, memo: dict) -> DitAttn1Patch:
        return self  # shared by clones, as ``Attn1Patch``

    def _grid(self, extra: dict, images: int) -> tuple[int, int, int] | None:
        latent = extra.get(LATENT_KEY)
        if latent is not None:
            t, hh, ww = policy.latent_grid(latent)
            h, w = -(-hh // self.dit.patch), -(-ww // self.dit.patch)
            return (t, h, w) if t * h * w <= images else None
        side = int(images ** 0.5)
        return (1, side, side) if side * side == images else None

    def _skip(self, block: Any, why: str) -> dict:
        if not any(b == block for b, _ in self.skipped):
            self.skipped.append((block, why))
        return {}

    def attn1(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extra: Any = None, *,
              pe: Any = None, attn_mask: Any = None, extra_options: dict | None = None):
        if extra is not None or extra_options is None:  # the UNet form: not a DiT block
            return (q, k, v) if extra is not None else {}
        self.calls += 1
        kind = str(extra_options.get("block_type", "double"))
        index = int(extra_options.get("block_index", 0))
        block = (kind, index)
        span = extra_options.get("img_slice")
        if self.first is None:
            self.first = block
        latent = extra_options.get(LATENT_KEY)
        grid = self._grid(extra_options, span[1] - span[0]) if span else None
        if block == self.first or self.call is None:
            size = tuple(latent) if latent is not None else \
                (grid[0], grid[1] * self.dit.patch, grid[2] * self.dit.patch) if grid else None
            self.call = None if size is None else self.planner.begin(
                size, q.device, extra_options.get("sigmas"), q.shape[0])
        position = index if kind == "double" else self.doubles + index
        if self.call is None or position not in self.chosen:
            return {}
        if attn_mask is not None:
            return self._skip(block, "an attention mask (pooling would misalign it)")
        if grid is None or q.dim() != 4:
            return self._skip(block, "no image token grid in this call")
        t, h, w = grid
        plan = self.planner.plan(self.call, q.new_zeros(()).expand(q.shape[0], t * h * w, 1))
        if plan is None:
            return {}
        f = self.factors[position]
        if f != plan.factor:  # built once per call and factor, shared by its blocks
            key = ("factor", f, t, h, w)
            if key not in self.call.plans:
                self.call.plans[key] = plan.with_factor(f)
            plan = self.call.plans[key]
        start = int(span[0])
        if pe is None:
            return {"k": plan.pool(k, start, 2), "v": plan.pool(v, start, 2)}
        keys = plan.keys(k, start, 2, pe, dit.rotate, lambda e: plan.rotations(e, start))
        return {"q": dit.rotate(q, pe), "k": keys, "v": plan.pool(v, start, 2),
                "pe": identity_rotation(pe)}


def identity_rotation(pe: torch.Tensor) -> torch.Tensor:
    """A rotation embedding like ComfyUI's ``pe`` (``[..., S, D/2, 2, 2]``) that turns nothing
    and broadcasts over any sequence length (``S`` = 1, no memory: an expanded 2x2 identity).
    ``1 * x + 0 * y`` is ``x`` exactly, so a host that rotates again changes no bit."""
    eye = torch.eye(2, dtype=pe.dtype, device=pe.device)
    return eye.expand(*pe.shape[:-4], 1, pe.shape[-3], 2, 2)


def model_sampling(unet_patcher: Any) -> Any:
    """The patched model's noise schedule object, or None: ComfyUI's ``model_sampling`` (through
    ``get_model_object``, so a ModelSampling node's shift before ours counts), the Forge
    family's ``predictor``."""
    get = getattr(unet_patcher, "get_model_object", None)
    if callable(get):
        try:
            found = get("model_sampling")
        except Exception:  # noqa: BLE001 (Forge's patcher has no such object)
            found = None
        if hasattr(found, "percent_to_sigma"):
            return found
    model = getattr(unet_patcher, "model", None)
    for name in ("model_sampling", "predictor"):
        found = getattr(model, name, None)
        if hasattr(found, "percent_to_sigma"):
            return found
    return None


def window_of(unet_patcher: Any, config: ToMeConfig, flow: bool = False) -> Window | None:
    """``config``'s start/end window as the sigmas the host hands the patch, converted with the
    model's own ``percent_to_sigma`` (SD's discrete schedule, or an unshifted flow schedule for
    a DiT, where the model has none); None for the whole pass."""
    if config.start <= 0 and config.end >= 1:
        return None
    sampling = model_sampling(unet_patcher)
    convert = sampling.percent_to_sigma if sampling is not None else \
        flow_percent_to_sigma if flow else discrete_percent_to_sigma
    return Window.sigmas(config.start, config.end, convert)


def reduce_attn1(method: Any, plan: Any, n: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 self_attention: bool):
    """What attn1 gets under ``plan``: the method's queries; its keys and values where it has
    them, else (self-attention) the queries again, or (a cross-attention attn1, i.e.
    disable_self_attn) the context unchanged."""
    queries, kv = method.reduce(plan, n)
    if kv is not None:
        return queries, kv, kv
    return (queries, queries, queries) if self_attention else (queries, k, v)


NOT_TIMED = ("this host's DiT blocks are not timed through its patch contract; the auto "
             "policy's token thresholds decide on DiTs")


def run_block(block: Any, x: torch.Tensor, context: torch.Tensor | None, planner: Planner,
              plan: Any, where: tuple = ("input", 1)) -> Any:
    """Run a Forge ``BasicTransformerBlock`` with ``plan`` applied through its patcher
    contract (``transformer_options["patches"]``), or unmerged when ``plan`` is None: how
    ``measure`` times Forge's blocks, whose attn1 gets keys and values as arguments."""
    method, held = planner.method, []

    def attn1(n, k, v, extra):
        held.append(plan if method.unmerges else None)
        return reduce_attn1(method, plan, n, k, v, k is n and v is n)

    def attn1_output(n, extra):
        p = held.pop() if held else None
        return n if p is None else method.restore(p, n)

    options: dict[str, Any] = {"block": where, "block_index": 0}
    if plan is not None:
        options["patches"] = {"attn1_patch": [attn1], "attn1_output_patch": [attn1_output]}
    return block(x, context=context, transformer_options=options)


ATTN1_LISTS = ("attn1_patch", "attn1_output_patch")


def attn1_patch_lists(unet_patcher: Any) -> list[list]:
    """The lists holding a patcher's attn1 and attn1 output patches, wherever the host keeps
    them: ComfyUI (and Forge Neo) in ``model_options["transformer_options"]["patches"]``, the
    Forge stand-in in ``patches``. Editing them edits the patcher (do it on a clone)."""
    options = getattr(unet_patcher, "model_options", None) or {}
    places = [(options.get("transformer_options") or {}).get("patches") or {},
              getattr(unet_patcher, "patches", None) or {}]
    return [place[name] for place in places if isinstance(place, dict)
            for name in ATTN1_LISTS if isinstance(place.get(name), list)]


def is_ours(fn: Any) -> bool:
    """A patch function of this adapter (a bound method of an ``Attn1Patch`` or
    ``DitAttn1Patch``)."""
    return isinstance(getattr(fn, "__self__", None), (Attn1Patch, DitAttn1Patch))


def is_tomesd(fn: Any) -> bool:
    """A patch function of another token merging (tomesd, or ComfyUI's built-in
    ``TomePatchModel`` from ``comfy_extras.nodes_tomesd``): told by its module."""
    return not is_ours(fn) and "tomesd" in (getattr(fn, "__module__", None) or "")


def carried(unet_patcher: Any) -> tuple[list[Attn1Patch | DitAttn1Patch], int]:
    """What token merging a patcher already carries: our patches (each ``Attn1Patch`` once)
    and how many foreign ToMe patch functions (``is_tomesd``)."""
    ours: list[Attn1Patch | DitAttn1Patch] = []
    foreign = 0
    for fns in attn1_patch_lists(unet_patcher):
        for fn in fns:
            if is_ours(fn) and fn.__self__ not in ours:
                ours.append(fn.__self__)
            foreign += is_tomesd(fn)
    return ours, foreign


def strip(unet_patcher: Any, which: Callable[[Any], bool]) -> int:
    """Remove the attn1 (output) patches ``which`` picks from ``unet_patcher`` (a clone: the
    lists are edited in place); how many were removed."""
    removed = 0
    for fns in attn1_patch_lists(unet_patcher):
        keep = [fn for fn in fns if not which(fn)]
        removed += len(fns) - len(keep)
        fns[:] = keep
    if removed and getattr(unet_patcher, MARK, None) is not None:
        delattr(unet_patcher, MARK)
    return removed


def attn1_replacements(unet_patcher: Any) -> Mapping:
    """``{(block, number, index): fn}``: the attn1 replacements a patcher carries."""
    options = getattr(unet_patcher, "model_options", None) or {}
    return ((options.get("transformer_options") or {}).get("patches_replace") or {}).get(
        "attn1") or {}


def patch_unet(unet_patcher: Any, layout: _layout.Layout, config: ToMeConfig,
               sampling_patcher: Callable[[], Any] | None = None, measurer: Any = None,
               runner: Callable | None = None) -> tuple[Any, PatchReport]:
    """A clone of the ``ModelPatcher`` carrying the ToMe patches of its UNet (``layout``), and
    the report (``adapters.patch_model_patcher`` chooses this form).

    ``sampling_patcher`` returns the patcher that will actually sample (a host's current
    ``forge_objects.unet``: extensions that run after us clone ours and add their own patches);
    blocks whose attn1 it replaces are left alone (``report.skipped`` fills while sampling).
    Without it, our clone's are used. Settings that merge nothing are the report's
    ``nothing``, and the patcher is returned unchanged. ``measurer``: a
    ``measurements.Measurer``; with the ``auto`` policy it measures the patcher's UNet (through
    ``runner``, ``run_block``) at the first call of each size, where the host has moved it to
    its device.
    """
    diffusion_model = layout.root
    max_ds = layout.auto_level(config.max_downsample)
    levels = {lv: len(layout.at(lv)) for lv in layout.levels if lv <= max_ds}
    report = PatchReport.of(layout, config, ATTN1_PATCH, max_downsample=max_ds, levels=levels)
    if report.nothing:
        return unet_patcher, report
    unet = unet_patcher.clone()
    current = sampling_patcher or (lambda: unet)
    measured = measurer.for_model(diffusion_model, config, runner or run_block) \
        if measurer is not None else None
    patch = Attn1Patch(config, max_ds, sorted(levels), lambda: attn1_replacements(current()),
                       measured, window_of(unet_patcher, config))
    report.skipped, report.planner = patch.skipped, patch.planner
    patch.report = report
    unet.set_model_attn1_patch(patch.attn1)
    unet.set_model_attn1_output_patch(patch.attn1_output)
    setattr(unet, MARK, patch)
    return unet, report


def patch_dit(unet_patcher: Any, layout: _layout.Layout, config: ToMeConfig
              ) -> tuple[Any, PatchReport]:
    """ComfyUI's DiT call form (``adapters.patch_model_patcher`` chooses it): one
    ``DitAttn1Patch`` on a clone. The auto policy decides by the device kind's token
    thresholds here (a DiT block is not timed through this contract)."""
    patch = DitAttn1Patch(config, layout, unet_patcher)
    p, chosen = layout.dit.patch, patch.chosen
    report = PatchReport.of(layout, config, ATTN1_PATCH, max_downsample=p,
                            levels={p: len(chosen)} if chosen and patch.method else {})
    if report.unmergeable is None and not chosen:  # the schedule this form applies names none
        report.unmergeable = layout.unmergeable(patch.applied)
    if report.nothing:
        return unet_patcher, report
    unet = unet_patcher.clone()
    report.skipped, report.planner = patch.skipped, patch.planner
    patch.report = report
    unet.set_model_attn1_patch(patch.attn1)
    setattr(unet, MARK, patch)
    return unet, report
