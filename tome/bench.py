"""Benchmark: real UNets from config (random weights), baseline vs tomesd vs our methods.

    python -m tome.bench --quick                       # < 2 min on one CPU thread
    python -m tome.bench --model sd15 --sizes 1024 --dtype bf16 --ratios 0.5 --factors 2,4
    python -m tome.bench --suite matching --tokens 65536

Every variant of a case runs on the same model and inputs, interleaved (A B C, C B A, ...)
after one warm-up run per variant. The warm-up run also counts FLOPs
(``torch.utils.flop_counter``), records peak memory (allocations reported by the PyTorch
profiler, live bytes above the level at the call's start: no tracemalloc, works for CPU
tensors) and gives the output compared with the baseline's.

The functions are importable: ``build_case``, ``run_benchmark(cases, ...) -> rows``,
``markdown_table(rows)``, ``plot(rows, path)``, ``run_matching(...) -> rows``,
``matching_table(rows)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .sdpa import ldm_sdpa, sdpa_forward  # noqa: F401 - re-exported for callers

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# ----------------------------------------------------------------------------- models

# SD1.5 (v1-inference.yaml) and SD2 (v2-inference.yaml) UNets, ldm layout.
SD15 = {"image_size": 64, "in_channels": 4, "out_channels": 4, "model_channels": 320,
        "attention_resolutions": [4, 2, 1], "num_res_blocks": 2, "channel_mult": [1, 2, 4, 4],
        "num_heads": 8, "use_spatial_transformer": True, "transformer_depth": 1,
        "context_dim": 768, "use_checkpoint": False, "legacy": False}
SD2 = {**SD15, "num_heads": -1, "num_head_channels": 64, "context_dim": 1024,
       "use_linear_in_transformer": True}
# SDXL base (sd_xl_base.yaml) as a diffusers UNet2DConditionModel (same blocks and levels).
SDXL = {"sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
        "block_out_channels": (320, 640, 1280),
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        "transformer_layers_per_block": (1, 2, 10), "attention_head_dim": (5, 10, 20),
        "cross_attention_dim": 2048, "use_linear_projection": True,
        "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816}
DIFFUSERS_SD15 = {"sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
                  "block_out_channels": (320, 640, 1280, 1280), "cross_attention_dim": 768,
                  "attention_head_dim": 8}
MODELS = {
    # name: (family, config, context length, context dim)
    "sd15": ("ldm", SD15, 77, 768),
    "sd2": ("ldm", SD2, 77, 1024),
    "sdxl": ("diffusers", SDXL, 77, 2048),
    "diffusers-sd15": ("diffusers", DIFFUSERS_SD15, 77, 768),
}


def wake(model: nn.Module, seed: int) -> nn.Module:
    """Random weights for zero-initialised layers (ldm's ``zero_module`` outputs).

    A fresh UNet's transformer and residual outputs are exactly zero, so merging could not
    change anything: benchmarks would report no deviation and tests would pass vacuously.
    """
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1 and not p.any():
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 / p[0].numel() ** 0.5))
    return model


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    family, cfg, _, _ = MODELS[name]
    torch.manual_seed(seed)
    if family == "ldm":
        from ldm.modules.diffusionmodules.openaimodel import UNetModel
        model = UNetModel(**cfg)
    else:
        from diffusers import UNet2DConditionModel
        model = UNet2DConditionModel(**cfg)
    model = wake(model, seed).to(dtype).eval().requires_grad_(False)
    if family == "ldm":  # ldm casts the latent to .dtype but not the timestep embedding
        model.dtype = dtype
        for m in model.modules():  # GroupNorm32 normalises in fp32: keep its affine in fp32
            if type(m).__name__ == "GroupNorm32":
                m.float()
        model.time_embed.register_forward_pre_hook(lambda m, a: (a[0].to(dtype), *a[1:]))
    return model


@dataclass
class Case:
    """One model at one size: the model, its inputs and how to call it."""

    model_name: str
    size: int                      # pixels (latent = size // 8)
    dtype: str = "bf16"
    batch: int = 2
    seed: int = 0
    model: nn.Module | None = None
    inputs: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"{self.model_name} {self.size}px {self.dtype} b{self.batch}"

    def forward(self) -> torch.Tensor:
        assert self.model is not None
        i = self.inputs
        if MODELS[self.model_name][0] == "ldm":
            return self.model(i["x"], i["t"], context=i["ctx"])
        return self.model(i["x"], i["t"], encoder_hidden_states=i["ctx"],
                          added_cond_kwargs=i.get("added"), return_dict=False)[0]


def build_case(model_name: str, size: int, dtype: str = "bf16", batch: int = 2, seed: int = 0,
               model: nn.Module | None = None, context_dim: int | None = None) -> Case:
    """A case with its model (built unless given: then ``context_dim`` may say its width)
    and fixed random inputs."""
    dt = DTYPES[dtype]
    _, _, ctx_len, ctx_dim = MODELS[model_name]
    ctx_dim = context_dim or ctx_dim
    if model is None:
        model = build_model(model_name, dt, seed)
    g = torch.Generator().manual_seed(seed + 7)
    lat = size // 8
    inputs: dict[str, Any] = {
        "x": torch.randn(batch, 4, lat, lat, generator=g).to(dt),
        "t": torch.full((batch,), 500.0),
        "ctx": torch.randn(batch, ctx_len, ctx_dim, generator=g).to(dt),
    }
    if model_name == "sdxl":
        inputs["added"] = {"text_embeds": torch.randn(batch, 1280, generator=g).to(dt),
                           "time_ids": torch.tensor([[size, size, 0, 0, size, size]] * batch,
                                                    dtype=dt)}
    return Case(model_name, size, dtype, batch, seed, model, inputs)


# ----------------------------------------------------------------------------- variants

@dataclass
class Variant:
    """One way of running the model: ``baseline``, ``tomesd``, ``merge`` or ``downsample``.

    ``value`` is the ratio (tomesd, merge) or the downsample factor; ``options`` are extra
    settings (``ToMeConfig`` fields for ours, ``apply_patch`` keywords for tomesd).
    """

    method: str
    value: float = 0.0
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """``method[:value][:key=val,key=val]``, e.g. ``merge:0.5:matching=local``."""
        parts = spec.strip().split(":")
        method = parts[0]
        if method not in ("baseline", "tomesd", "merge", "downsample"):
            raise ValueError(f"unknown method in variant {spec!r}")
        value = float(parts[1]) if len(parts) > 1 and parts[1] else 0.0
        options: dict[str, Any] = {}
        for kv in (parts[2].split(",") if len(parts) > 2 and parts[2] else []):
            k, v = kv.split("=", 1)
            options[k.strip()] = _literal(v.strip())
        return cls(method, value, options)

    @property
    def label(self) -> str:
        if self.method == "baseline":
            return "baseline"
        v = f"{self.value:g}" if self.method != "downsample" else f"x{int(self.value)}"
        opts = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"{self.method} {v}" + (f" ({opts})" if opts else "")

    @property
    def reduction(self) -> float:
        """Fraction of self-attention tokens (keys/values for downsample) removed: plot x."""
        if self.method == "downsample":
            return 1.0 - 1.0 / self.value ** 2
        return self.value

    def apply(self, case: Case) -> None:
        model = case.model
        if self.method == "tomesd":
            import tomesd
            tomesd.apply_patch(_tomesd_target(case), ratio=self.value, **self.options)
        elif self.method == "merge":
            import tome
            tome.apply_patch(model, ratio=self.value, **self.options)
        elif self.method == "downsample":
            import tome
            opts = {"ratio": 0.0, **self.options}
            tome.apply_patch(model, method="downsample", downsample_factor=int(self.value),
                             **opts)

    def remove(self, case: Case) -> None:
        if self.method == "tomesd":
            import tomesd
            tomesd.remove_patch(_tomesd_target(case))
        elif self.method in ("merge", "downsample"):
            import tome
            tome.remove_patch(case.model)


def _literal(v: str) -> Any:
    low = v.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "auto"):
        return None
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


class _LdmWrapper(nn.Module):
    """tomesd wants an object with ``.model.diffusion_model`` for ldm UNets."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.model = nn.Module()
        self.model.diffusion_model = unet


def _tomesd_target(case: Case) -> nn.Module:
    if MODELS[case.model_name][0] == "diffusers":
        return case.model
    wrap = case.inputs.get("_tomesd_wrapper")
    if wrap is None:
        wrap = case.inputs["_tomesd_wrapper"] = _LdmWrapper(case.model)
    return wrap


def default_variants(methods: Sequence[str], ratios: Sequence[float],
                     factors: Sequence[int]) -> list[Variant]:
    out = [Variant("baseline")]
    for m in methods:
        if m == "tomesd":
            out += [Variant("tomesd", r) for r in ratios]
        elif m == "merge":
            out += [Variant("merge", r) for r in ratios]
        elif m == "merge-local":
            out += [Variant("merge", r, {"matching": "local"}) for r in ratios]
        elif m == "downsample":
            out += [Variant("downsample", f) for f in factors]
        elif m != "baseline":
            raise ValueError(f"unknown method {m!r}")
    return out


# ----------------------------------------------------------------------------- measuring

def _sdpa_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(query, key, value)


def flop_counter() -> Any:
    """A ``FlopCounterMode`` that also counts CPU fused attention (not registered upstream)."""
    from torch.utils.flop_counter import FlopCounterMode
    aten = torch.ops.aten
    custom = {}
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        custom[aten._scaled_dot_product_flash_attention_for_cpu] = _sdpa_flops
    return FlopCounterMode(display=False, custom_mapping=custom)


@contextlib.contextmanager
def peak_memory(result: dict[str, float]):
    """Peak of live CPU tensor bytes allocated inside the block, above its starting level,
    from the PyTorch profiler's allocation events. Sets ``result["peak"]`` (bytes)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, n in events:
        cur += n
        peak = max(peak, cur)
    result["peak"] = peak


def _quiet_profiler():
    # The profiler prints "profiler_start/stop" lines on some builds; keep tables clean.
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")


class _Progress:
    """tqdm when installed, else one line per step on stderr."""

    def __init__(self, total: int, enabled: bool = True):
        self.bar = None
        self.total, self.n, self.enabled = total, 0, enabled
        if enabled:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, unit="run", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                pass

    def step(self, text: str) -> None:
        self.n += 1
        if self.bar is not None:
            self.bar.set_description(text[:60])
            self.bar.update(1)
        elif self.enabled:
            print(f"[{self.n}/{self.total}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _deviation(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def run_benchmark(cases: Iterable[Case], variants: Sequence[Variant], repeats: int = 3,
                  measure: bool = True, progress: bool = True,
                  on_row: Callable[[dict[str, Any]], None] | None = None
                  ) -> list[dict[str, Any]]:
    """Time every variant on every case; one row per (case, variant).

    Per case: one warm-up run per variant (which also counts FLOPs and peak memory when
    ``measure``, and gives the output for the deviation), then ``repeats`` timed rounds
    in alternating order. Rows carry the raw times and the derived numbers.
    """
    _quiet_profiler()
    cases = list(cases)
    total = sum((1 + repeats) * len(variants) for _ in cases)
    bar = _Progress(total, progress)
    rows: list[dict[str, Any]] = []
    try:
        for case in cases:
            rows += _run_case(case, variants, repeats, measure, bar)
            if on_row:
                for r in rows[-len(variants):]:
                    on_row(r)
    finally:
        bar.close()
    return rows


def _run_case(case: Case, variants: Sequence[Variant], repeats: int, measure: bool,
              bar: _Progress) -> list[dict[str, Any]]:
    n = len(variants)
    times: list[list[float]] = [[] for _ in range(n)]
    outputs: list[torch.Tensor | None] = [None] * n
    flops: list[int | None] = [None] * n
    peaks: list[float | None] = [None] * n
    patched: list[str] = [""] * n
    with torch.inference_mode(), ldm_sdpa():
        for rnd in range(1 + repeats):
            order = list(range(n)) if rnd % 2 == 0 else list(reversed(range(n)))
            for i in order:
                v = variants[i]
                v.apply(case)
                try:
                    torch.manual_seed(case.seed)  # tomesd draws its random cells globally
                    if rnd == 0:
                        mem: dict[str, float] = {}
                        ctx = contextlib.ExitStack()
                        if measure:
                            counter = ctx.enter_context(flop_counter())
                            ctx.enter_context(peak_memory(mem))
                        with ctx:
                            out = case.forward()
                        outputs[i] = out.float()
                        if measure:
                            flops[i] = counter.get_total_flops()
                            peaks[i] = mem.get("peak")
                        patched[i] = _patched_blocks(case, v)
                    else:
                        t0 = time.perf_counter()
                        case.forward()
                        times[i].append(time.perf_counter() - t0)
                finally:
                    v.remove(case)
                bar.step(f"{case.label} {v.label} {'warm-up' if rnd == 0 else f'#{rnd}'}")
    base = next((i for i, v in enumerate(variants) if v.method == "baseline"), None)
    rows = []
    for i, v in enumerate(variants):
        med = statistics.median(times[i]) if times[i] else math.nan
        row = {
            "model": case.model_name, "size": case.size, "dtype": case.dtype,
            "batch": case.batch, "variant": v.label, "method": v.method, "value": v.value,
            "options": v.options, "reduction": v.reduction, "times": times[i],
            "median": med, "min": min(times[i], default=math.nan),
            "max": max(times[i], default=math.nan), "flops": flops[i], "peak": peaks[i],
            "patched": patched[i],
            "deviation": (_deviation(outputs[i], outputs[base])
                          if base is not None and outputs[i] is not None else math.nan),
        }
        rows.append(row)
    _derive(rows)
    return rows


def _patched_blocks(case: Case, v: Variant) -> str:
    """``merged/total`` transformer blocks that this variant actually changes."""
    import tome
    blocks = [m for m in case.model.modules()
              if any(c.__name__ == "BasicTransformerBlock" for c in type(m).__mro__)]
    if v.method == "tomesd":
        info = getattr(case.model, "_tome_info", {}).get("args", {})
        size = case.size // 8
        n = sum(1 for b in blocks if type(b).__name__ == "ToMeBlock")
        # tomesd patches every block but merges only where downsample <= max_downsample.
        from .patch import block_levels
        levels = block_levels(case.model)
        n = sum(1 for b in blocks if type(b).__name__ == "ToMeBlock"
                and 0 < levels.get(b, 0) <= info.get("max_downsample", 1)) if size else n
        return f"{n}/{len(blocks)}"
    rep = tome.patch_report(case.model)
    return f"{rep.patched_blocks}/{rep.total_blocks}" if rep is not None else ""


def _derive(rows: list[dict[str, Any]]) -> None:
    """Speed-ups vs the case's baseline and vs tomesd: the tomesd row with the same ratio
    (merge), else tomesd at its default ratio 0.5 (downsample), else the first tomesd row."""
    base = next((r for r in rows if r["method"] == "baseline"), None)
    tomesd = [r for r in rows if r["method"] == "tomesd"]
    for r in rows:
        r["speedup"] = base["median"] / r["median"] if base else math.nan
        want = r["value"] if r["method"] in ("merge", "tomesd") else 0.5
        ref = next((t for t in tomesd if t["value"] == want and not t["options"]),
                   next((t for t in tomesd if t["value"] == want),
                        tomesd[0] if tomesd else None))
        r["vs_tomesd"] = (ref["median"] / r["median"]
                          if ref is not None and r["method"] != "baseline" else math.nan)


# ----------------------------------------------------------------------------- matching

def run_matching(tokens: int = 65536, channels: int = 320, batch: int = 2,
                 dtype: str = "fp32", ratio: float = 0.5, repeats: int = 2,
                 which: Sequence[str] = ("tomesd", "global", "local"),
                 progress: bool = True) -> list[dict[str, Any]]:
    """The matching step alone (building merge/unmerge for one block input), as tomesd's
    ``bipartite_soft_matching_random2d``: time and peak extra memory per implementation."""
    from . import merge
    _quiet_profiler()
    h = w = round(math.sqrt(tokens))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, h * w, channels, generator=g).to(DTYPES[dtype])
    r = int(h * w * ratio)

    def fn(name: str) -> Callable[[], Any]:
        gen = torch.Generator().manual_seed(1)
        if name == "tomesd":
            from tomesd.merge import bipartite_soft_matching_random2d as ref
            return lambda: ref(x, w, h, 2, 2, r, no_rand=False, generator=gen)
        return lambda: merge.bipartite_soft_matching_random2d(
            x, w, h, 2, 2, r, no_rand=False, generator=gen, matching=name)

    bar = _Progress(len(which) * (1 + repeats), progress)
    rows = []
    try:
        with torch.inference_mode():
            for name in which:
                f = fn(name)
                mem: dict[str, float] = {}
                with peak_memory(mem):
                    f()
                bar.step(f"matching {name} memory")
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t0)
                    bar.step(f"matching {name} timed")
                rows.append({"impl": name, "tokens": h * w, "channels": channels,
                             "batch": batch, "dtype": dtype, "times": ts,
                             "median": statistics.median(ts), "peak": mem["peak"]})
    finally:
        bar.close()
    ref = next((row for row in rows if row["impl"] == "tomesd"), None)
    for row in rows:
        row["vs_tomesd"] = ref["median"] / row["median"] if ref else math.nan
    return rows


def matching_table(rows: list[dict[str, Any]]) -> str:
    names = {"tomesd": "tomesd 0.1.3", "global": "ours, global (= tomesd's result)",
             "local": "ours, local (3x3 cells)"}
    r0 = rows[0]
    lines = [(f"Matching only: {r0['tokens']} tokens, C={r0['channels']}, batch {r0['batch']}, "
             f"{r0['dtype']}, ratio 0.5; peak = extra memory (PyTorch profiler allocations)"),
             "", "| implementation | time (s, median) | faster than tomesd | peak extra memory |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {names.get(r['impl'], r['impl'])} | {r['median']:.3f} | "
                     f"{_x(r['vs_tomesd'], 1)} | {_mib(r['peak'])} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- output

def _mib(b: float | None) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "–"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _x(v: float, digits: int = 2) -> str:
    if v is None or math.isnan(v):
        return "–"
    return f"**{v:.{digits}f}x**" if v >= 1.0 else f"{v:.{digits}f}x"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return (f"{cpu}, {torch.get_num_threads()} thread(s), torch {torch.__version__}, "
            f"{platform.system()}")


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One Markdown table per case (model, size, dtype, batch)."""
    out = []
    keys: list[tuple] = []
    for r in rows:
        k = (r["model"], r["size"], r["dtype"], r["batch"])
        if k not in keys:
            keys.append(k)
    for k in keys:
        rs = [r for r in rows if (r["model"], r["size"], r["dtype"], r["batch"]) == k]
        n = len(rs[0]["times"])
        out.append(f"**{k[0]}, {k[1]}x{k[1]} px, {k[2]}, batch {k[3]}** "
                   f"(median of {n} interleaved runs after a warm-up)\n")
        out.append("| method | blocks | time (s) | speed-up | vs tomesd | min–max (s) | "
                   "GFLOPs | peak memory | deviation |")
        out.append("|---|---|---|---|---|---|---|---|---|")
        for r in rs:
            gf = "–" if r["flops"] is None else f"{r['flops'] / 1e9:,.0f}"
            out.append(
                f"| {r['variant']} | {r['patched'] or '–'} | {r['median']:.2f} | "
                f"{_x(r['speedup'])} | {_x(r['vs_tomesd'])} | "
                f"{r['min']:.2f}–{r['max']:.2f} | {gf} | {_mib(r['peak'])} | "
                f"{r['deviation']:.4f} |")
        out.append("")
    out.append("Speed-up: baseline median / median. Peak memory: live tensor bytes allocated "
               "during the forward (PyTorch profiler). Deviation: ||out - baseline|| / "
               "||baseline||.")
    return "\n".join(out)


def load_rows(path: str) -> list[dict[str, Any]]:
    """Rows from a ``--json`` file, speed-ups recomputed (to re-render tables or plots)."""
    with open(path) as f:
        rows = json.load(f)["unet"]
    for key in sorted({(r["model"], r["size"], r["dtype"], r["batch"]) for r in rows}):
        _derive([r for r in rows if (r["model"], r["size"], r["dtype"], r["batch"]) == key])
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> str:
    """Per case: speed-up and deviation against token reduction, and deviation against
    speed-up (lower right is better), one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys: list[tuple] = []
    for r in rows:
        k = (r["model"], r["size"], r["dtype"], r["batch"])
        if k not in keys:
            keys.append(k)
    colours: dict[str, str] = {}  # one colour per method across all cases
    fig, axes = plt.subplots(len(keys), 3, figsize=(15, 3.8 * len(keys)), squeeze=False)
    for (ax1, ax2, ax3), k in zip(axes, keys):
        rs = [r for r in rows if (r["model"], r["size"], r["dtype"], r["batch"]) == k]
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in rs:
            if r["method"] == "baseline":
                continue
            name = r["method"] + (f" ({','.join(f'{a}={b}' for a, b in r['options'].items())})"
                                  if r["options"] else "")
            groups.setdefault(name, []).append(r)
        for name, g in groups.items():
            g = sorted(g, key=lambda r: r["reduction"])
            xs = [r["reduction"] for r in g]
            style = {"label": name, "color": colours.setdefault(name, f"C{len(colours) % 10}")}
            ax1.plot(xs, [r["speedup"] for r in g], "o-", **style)
            ax2.plot(xs, [r["deviation"] for r in g], "o-", **style)
            ax3.plot([r["speedup"] for r in g], [r["deviation"] for r in g], "o-", **style)
        ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
        title = f"{k[0]} {k[1]}px {k[2]} b{k[3]}"
        ax1.set(title=f"{title}: speed-up", xlabel="tokens removed (ratio; 1-1/f² for "
                "downsample)", ylabel="speed-up vs baseline")
        ax2.set(title=f"{title}: deviation", xlabel="tokens removed",
                ylabel="||out - base|| / ||base||")
        ax3.set(title=f"{title}: deviation vs speed-up", xlabel="speed-up vs baseline",
                ylabel="||out - base|| / ||base||")
        ax1.legend(fontsize=8)
        for ax in (ax1, ax2, ax3):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- CLI

def _floats(s: str) -> list[float]:
    return [float(v) for v in s.split(",") if v.strip()]


def _ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tome.bench", description=__doc__.split("\n")[0])
    p.add_argument("--suite", choices=("unet", "matching", "all"), default="unet")
    p.add_argument("--model", default="sd15",
                   help=f"comma-separated: {', '.join(MODELS)} (default sd15)")
    p.add_argument("--sizes", default="512", help="image sizes in pixels (default 512)")
    p.add_argument("--methods", default="tomesd,merge,merge-local,downsample",
                   help="which of tomesd, merge, merge-local, downsample to run (the baseline "
                        "always runs)")
    p.add_argument("--ratios", default="0.5", help="merge ratios for tomesd/merge")
    p.add_argument("--factors", default="2", help="downsample factors")
    p.add_argument("--variant", action="append", default=[],
                   help="extra variant, e.g. merge:0.5:max_downsample=2 or "
                        "tomesd:0.5:max_downsample=2 (repeatable)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-measure", action="store_true",
                   help="skip FLOPs and peak memory (faster warm-up)")
    p.add_argument("--tokens", type=int, default=65536, help="matching suite: tokens")
    p.add_argument("--channels", type=int, default=320, help="matching suite: channels")
    p.add_argument("--matching-dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--quick", action="store_true",
                   help="SD1.5 at 256 px and matching at 4096 tokens: under 2 minutes")
    p.add_argument("--plot", default=None, help="write the PNG plot here")
    p.add_argument("--json", default=None, help="write the raw rows here")
    p.add_argument("--markdown", default=None, help="also write the tables here")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)

    if a.quick:
        a.suite, a.model, a.sizes, a.repeats, a.tokens = "all", "sd15", "256", 2, 4096
    torch.set_num_threads(a.threads)
    progress = not a.no_progress
    text = [f"Machine: {machine()}", ""]
    result: dict[str, Any] = {"machine": machine(), "argv": list(argv or sys.argv[1:])}
    if a.suite in ("unet", "all"):
        variants = default_variants(a.methods.split(","), _floats(a.ratios), _ints(a.factors))
        variants += [Variant.parse(s) for s in a.variant]
        rows: list[dict[str, Any]] = []
        for name in a.model.split(","):
            if name not in MODELS:
                p.error(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
            model = None
            for size in _ints(a.sizes):
                t0 = time.perf_counter()
                case = build_case(name, size, a.dtype, a.batch, model=model)
                model = case.model
                if progress:
                    print(f"built {case.label} in {time.perf_counter() - t0:.1f} s",
                          file=sys.stderr)
                rows += run_benchmark([case], variants, a.repeats, not a.no_measure, progress)
            del model
        text.append(markdown_table(rows))
        result["unet"] = rows
        if a.plot:
            text.append(f"\nPlot: {plot(rows, a.plot)}")
    if a.suite in ("matching", "all"):
        mrows = run_matching(a.tokens, a.channels, a.batch, a.matching_dtype,
                             repeats=1 if a.quick else 2, progress=progress)
        text.append("")
        text.append(matching_table(mrows))
        result["matching"] = mrows
    out = "\n".join(text)
    print(out)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(out + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
