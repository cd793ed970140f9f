"""Measuring whether merging pays on the device that runs it: the data behind the auto policy.

The fixed thresholds in ``policy.py`` were measured on a few machines; the real answer depends
on the user's device, dtype, attention kernel and image size. ``measure`` times, per UNet
level, one representative transformer block unmerged and merged on the user's own model, and
scales the figures to the whole level (blocks at the level, plans built per call). ``decide``
turns a row into a yes/no with a safety margin so noise cannot flip it, and
``MeasurementCache`` keeps the answers in one small JSON file, keyed by everything that
changes them (``cache_key``), so a measurement is taken once per setup, not once per image.

Measuring never changes the model: it runs under ``torch.no_grad``, draws its inputs from a
private generator, puts temporary hooks on the representative block only (removed in
``finally``), and restores the block's ``training`` flags and the global RNG state.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import memory, methods, policy
from . import plan as _plan
from .config import ToMeConfig
from .patch import context_keyword, reduce_args, restore_output, unusable
from .policy import MARGIN
from .unet import auto_level, block_levels, decoder_blocks, find_unet

CONTEXT_TOKENS = 77  # CLIP's context length: what attn2 sees in every SD model
# Version 2: each timing the fastest of its rounds (1: medians); an older file is measured again.
FORMAT, VERSION = "tome-measurements", 2
# The config fields that change the merged cost (less those the method ignores); seed, start,
# end, policy and use_rand do not.
KEY_FIELDS = ("method", "ratio", "sx", "sy", "matching", "share", "downsample_factor",
              "merge_attn", "merge_crossattn", "merge_mlp")

Clock = Callable[[Callable[[], Any]], float]


# ----------------------------------------------------------------------------- results

@dataclass(frozen=True)
class LevelTiming:
    """One UNet level, per UNet call: ``unmerged_ms`` = blocks x block time; ``merged_ms`` =
    plans x plan build + blocks x merged block time."""

    level: int         # downsample factor (1 = full resolution)
    tokens: int        # tokens a block at this level sees
    blocks: int        # transformer blocks at this level
    plans: int         # plans built per call (per UNet side, or per block with share="block")
    unmerged_ms: float
    merged_ms: float

    @property
    def speedup(self) -> float:
        return self.unmerged_ms / self.merged_ms if self.merged_ms > 0 else math.inf


def decide(row: LevelTiming, margin: float = MARGIN) -> bool:
    """Merge this level only where it was measured at least ``1 + margin`` times faster."""
    return policy.pays(row.speedup, margin)


@dataclass(frozen=True)
class Measurement:
    """What ``measure`` found on one device for one latent size, batch and method."""

    device: str                # e.g. "NVIDIA H100 80GB HBM3", "AMD EPYC 7B13", "Apple MPS"
    dtype: str                 # "float16", "float32", ...
    latent: tuple[int, int]    # (height, width) of the latent
    batch: int
    method: str
    rows: tuple[LevelTiming, ...]

    def merged_levels(self, margin: float = MARGIN) -> tuple[int, ...]:
        return tuple(r.level for r in self.rows if decide(r, margin))

    def table(self, margin: float = MARGIN) -> str:
        """An aligned plain-text table, one line per level, for the console and docs."""
        h, w = self.latent
        head = (f"ToMe measurement on {self.device}, {self.dtype}, latent {w}x{h}, "
                f"batch {self.batch}, {self.method}")
        cols = ("level", "tokens", "blocks", "plans", "unmerged ms", "merged ms", "speed-up",
                "merge")
        lines = [cols] + [(f"ds{r.level}", str(r.tokens), str(r.blocks), str(r.plans),
                           f"{r.unmerged_ms:.3f}", f"{r.merged_ms:.3f}", f"{r.speedup:.2f}x",
                           "yes" if decide(r, margin) else "no") for r in self.rows]
        widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
        return "\n".join([head] + ["  ".join(c.rjust(n) for c, n in zip(line, widths))
                                   for line in lines])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["latent"] = list(self.latent)
        return d

    @classmethod
    def from_dict(cls, d: Any) -> Measurement:
        """Strict: anything malformed raises ``ValueError`` (the cache then ignores it)."""
        try:
            rows = tuple(LevelTiming(int(r["level"]), int(r["tokens"]), int(r["blocks"]),
                                     int(r["plans"]), float(r["unmerged_ms"]),
                                     float(r["merged_ms"])) for r in d["rows"])
            h, w = (int(v) for v in d["latent"])
            m = cls(str(d["device"]), str(d["dtype"]), (h, w), int(d["batch"]),
                    str(d["method"]), rows)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"ToMe: not a measurement: {e!r}") from None
        if set(d) != {"device", "dtype", "latent", "batch", "method", "rows"} or not all(
                math.isfinite(t) and t >= 0 for r in rows for t in (r.unmerged_ms, r.merged_ms)):
            raise ValueError("ToMe: not a measurement: unexpected fields or times")
        return m

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Measurement:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"ToMe: not a measurement: {e!r}") from None
        return cls.from_dict(data)


# ----------------------------------------------------------------------------- the device

@functools.cache
def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def device_name(device: torch.device) -> str:
    """A human-readable name of the device: timings from another device are not this one's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return "Apple MPS"
    if device.type == "cpu":
        return _cpu_name()
    return str(device)


def _wall_clock(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _mps_clock(fn: Callable[[], Any]) -> float:
    torch.mps.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.mps.synchronize()
    return time.perf_counter() - t0


def _cuda_clock(device: torch.device) -> Clock:
    """CUDA events around ``fn``: the GPU's own time, with one synchronisation (on the end
    event) before the elapsed time is read."""
    def clock(fn: Callable[[], Any]) -> float:
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
    return clock


def default_clock(device: torch.device) -> Clock:
    """``clock(fn) -> seconds`` for ``device``: CUDA events, MPS-synchronised or plain wall
    clock (CPU)."""
    if device.type == "cuda":
        return _cuda_clock(device)
    if device.type == "mps":
        return _mps_clock
    return _wall_clock


def _untimed(fn: Callable[[], Any]) -> float:
    fn()
    return 0.0


_flush: dict[str, torch.Tensor] = {}


def _evict(device: torch.device) -> None:
    """Push the block's weights and activations out of the caches (CPU L2/L3, a GPU's L2)
    before a timed run: inside a UNet call every block starts cold, and a block timed again
    and again with hot caches makes merging look better than it is where the saving is small
    (few tokens: the weights, not the attention, dominate)."""
    # Always in inference mode: the buffer outlives the call that made it, and the host may
    # sample under ``torch.inference_mode`` (Forge, ComfyUI) and measure later under
    # ``torch.no_grad`` (Measure now), or the reverse; an inference tensor cannot be updated
    # in place outside inference mode, while a normal tensor can be inside it.
    with torch.inference_mode():
        buf = _flush.get(str(device))
        if buf is None:
            buf = _flush[str(device)] = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        buf.add_(1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@contextlib.contextmanager
def _kept(block: nn.Module, device: torch.device):
    """Restore what a measurement could touch: the block's ``training`` flags (it runs in eval
    mode, so dropout never draws) and the global RNG state (CPU, and CUDA on a CUDA device)."""
    flags = [(m, m.training) for m in block.modules()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    try:
        block.eval()
        yield
    finally:
        for m, training in flags:
            m.training = training
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


# ----------------------------------------------------------------------------- the model

def _channels(block: nn.Module) -> int:
    norm = getattr(block, "norm1", None)
    shape = getattr(norm, "normalized_shape", None)
    return int(shape[0]) if shape else int(block.attn1.to_q.in_features)


def _context_dim(block: nn.Module) -> int | None:
    to_k = getattr(getattr(block, "attn2", None), "to_k", None)
    return int(to_k.in_features) if to_k is not None else None


def _levels(unet: nn.Module, config: ToMeConfig, levels: Iterable[int] | None
            ) -> tuple[dict[int, list[nn.Module]], list[int]]:
    """The blocks of each level, in the UNet's order, and the levels to measure: ``levels``,
    or those with blocks up to the config's max downsample (auto: the first with blocks)."""
    by_level: dict[int, list[nn.Module]] = {}
    for block, lv in block_levels(unet).items():
        if lv > 0:
            by_level.setdefault(lv, []).append(block)
    if levels is None:
        max_ds = auto_level(config.max_downsample, list(by_level))
        return by_level, sorted(lv for lv in by_level if lv <= max_ds)
    chosen = sorted(set(levels))
    missing = [lv for lv in chosen if lv not in by_level]
    if missing:
        raise ValueError(f"ToMe: no transformer blocks at level(s) {missing}; this UNet has "
                         f"them at {sorted(by_level)}")
    return by_level, chosen


def fingerprint(model: Any) -> str:
    """A short hash of the UNet's architecture (class; per transformer block: level, side,
    channels, heads, context dim), never its weights: fine-tunes of one model share timings."""
    unet = find_unet(model)
    decoder = decoder_blocks(unet)
    blocks = [[lv, b in decoder, _channels(b), getattr(b.attn1, "heads", None), _context_dim(b)]
              for b, lv in block_levels(unet).items()]
    arch = {"class": f"{type(unet).__module__}.{type(unet).__qualname__}", "blocks": blocks}
    return hashlib.sha1(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


def attention_backend(model: Any) -> str:
    """Best effort: which attention kernel the blocks run. diffusers: attn1's processor class;
    ldm/sgm: attn1's class ``forward`` (the WebUI swaps it for xFormers, SDPA, sub-quadratic);
    on CUDA also the SDPA back-ends enabled."""
    blocks = list(block_levels(find_unet(model)))
    if not blocks:
        return "none"
    attn = blocks[0].attn1
    processor = getattr(attn, "processor", None)
    if processor is not None:
        name = type(processor).__name__
    else:
        fn = type(attn).forward
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
        swapped = memory.kernel(attn)  # Forge, ComfyUI: chosen at start-up, module-wide
        if swapped:
            name += f" {swapped}"
    if next(blocks[0].parameters()).device.type == "cuda":
        flags = [n for n in ("flash", "mem_efficient", "math", "cudnn")
                 if getattr(torch.backends.cuda, f"{n}_sdp_enabled", lambda: False)()]
        name += " sdp:" + ",".join(flags)
    return name


@dataclass(frozen=True)
class CacheKey:
    """``digest``: sha1 of the canonical JSON of ``parts``, which stay readable in the file."""

    digest: str
    parts_json: str

    @property
    def parts(self) -> dict[str, Any]:
        return json.loads(self.parts_json)

    @classmethod
    def of(cls, parts: dict[str, Any]) -> CacheKey:
        text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        return cls(hashlib.sha1(text.encode()).hexdigest(), text)


def cache_key(model: Any, latent: tuple[int, int], batch: int, config: ToMeConfig, *,
              levels: Iterable[int] | None = None) -> CacheKey:
    """Everything that changes ``measure``'s answer: device (and CUDA compute capability),
    torch version, attention backend, dtype, CPU threads, architecture, latent, batch, the
    levels measured and the config fields that change the merged cost."""
    unet = find_unet(model)
    by_level, chosen = _levels(unet, config, levels)
    p = next(by_level[chosen[0]][0].parameters()) if chosen else next(unet.parameters())
    dev = p.device
    parts = {
        "device": device_name(dev),
        "capability": list(torch.cuda.get_device_capability(dev)) if dev.type == "cuda"
        else None,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "torch": torch.__version__,
        "attention": attention_backend(unet),
        "dtype": str(p.dtype).removeprefix("torch."),
        "unet": fingerprint(unet),
        "latent": [int(latent[0]), int(latent[1])],
        "batch": int(batch),
        "levels": chosen,
        "config": {f: getattr(config, f) for f in KEY_FIELDS
                   if f not in methods.get(config.method).ignores},
    }
    return CacheKey.of(parts)


# ----------------------------------------------------------------------------- measuring

@contextlib.contextmanager
def _merged(block: nn.Module, planner: _plan.Planner, plan: Any):
    """Run ``block`` with ``plan`` applied, as a patched block would (the patch's own argument
    plumbing, on temporary hooks of the method's sub-layers, removed on exit)."""
    method, kv_name, handles = planner.method, context_keyword(block), []
    try:
        for name in method.sub_layers(planner.config) if plan is not None else ():
            sub = getattr(block, name)
            handles.append(sub.register_forward_pre_hook(
                lambda m, a, k: reduce_args(method, plan, a, k, kv_name), with_kwargs=True))
            if method.unmerges:
                handles.append(sub.register_forward_hook(
                    lambda m, a, k, out: restore_output(method, plan, out), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


def representative(blocks: list[nn.Module], sub_layers: Iterable[str]) -> nn.Module | None:
    """The block that stands for its level: the first one that can run our way
    (``patch.unusable``: none another extension took over, which could not run on a bare
    input); None if there is none."""
    subs = tuple(sub_layers)
    return next((b for b in blocks if unusable(b, subs) is None), None)


def _plan_count(planner: _plan.Planner, call: Any, x: torch.Tensor, blocks: list[nn.Module],
                decoder: set[nn.Module]) -> int:
    """Plans built per UNet call at one level: ask the planner for every block's plan in one
    call and count the distinct ones (one per UNet side with share="level", one per block
    with share="block", one per grid for ToDo)."""
    plans = [planner.plan(call, x, b in decoder) for b in blocks]
    return len({id(p): p for p in plans if p is not None})


def hook_runner(block: nn.Module, x: torch.Tensor, context: torch.Tensor | None,
                planner: _plan.Planner, plan: Any) -> Any:
    """Run ``block`` on ``x`` with ``plan`` applied (None: unmerged), as the hook adapter
    would: temporary hooks on the method's sub-layers."""
    kw = {} if context is None else {context_keyword(block): context}
    with _merged(block, planner, plan):
        return block(x, **kw)


Runner = Callable[[nn.Module, torch.Tensor, "torch.Tensor | None", _plan.Planner, Any], Any]


def _check_memory(unet: nn.Module, latent: tuple[int, int], batch: int,
                  chosen: dict[int, nn.Module | None]) -> None:
    """Raise ``memory.NotEnoughMemoryError`` before anything runs if the largest timed run
    would not fit (``memory.py``: measuring must never take the host down)."""
    runs = [(b, policy.level_tokens(latent, lv), _channels(b)) for lv, b in chosen.items()
            if b is not None]
    if runs:
        backend = attention_backend(unet)
        memory.check(memory.estimate(runs, batch, backend), next(runs[0][0].parameters()).device,
                     memory.full_scores(backend), backend)


def _clear(speedups: list[float], margin: float = MARGIN) -> bool:
    """Every round so far lands on the same side of the decision, with room to spare: more
    rounds could not change it (a large level at 2x, or one that clearly costs)."""
    return min(speedups) >= (1.0 + margin) ** 2 or max(speedups) < 1.0 / (1.0 + margin)


def measure(model: Any, latent: tuple[int, int], batch: int, config: ToMeConfig, *,
            rounds: int = 5, warmup: int = 1, clock: Clock | None = None,
            levels: Iterable[int] | None = None, runner: Runner = hook_runner,
            min_rounds: int = 3) -> Measurement:
    """Time each mergeable level of ``model``'s UNet unmerged and merged with ``config``.

    Per level, one transformer block stands for all of them (blocks at one level have the same
    shape; ``representative``; a level whose every block another extension has taken over gets
    no row, so the thresholds decide it). Each round times the block unmerged, the plan build (a
    fresh call, as in sampling) and the block merged, unmerged first in one round and last in
    the next. Each is the fastest of at most ``rounds`` after ``warmup`` untimed rounds: other
    work on the machine only ever adds time, and the fastest run is the least disturbed (on a
    2-core CPU with a UNet running on the other core, the median moved by 25% from one
    measurement to the next, the fastest by 5%). A level stops after ``min_rounds`` once every
    round's speed-up lands clearly on one side of the decision (``_clear``: the large levels,
    the costly ones to time, are rarely near the margin). ``clock(fn) -> seconds`` replaces the
    device's clock (tests); ``runner`` runs a block with or without a plan the way the host does
    (``hook_runner``, or Forge's patcher contract: ``forge.run_block``). Runs on the device and
    dtype of the UNet's blocks, with inputs from a private generator; the model, its hooks,
    flags and the global RNG state are left exactly as they were.

    Cost: ``warmup`` + ``min_rounds`` to ``rounds`` x (two block runs + one plan build) per
    level; SD1.5 at 512 px on a CPU (level 1 only, the default) takes about one UNet forward,
    hence the cache.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"ToMe: rounds must be >= 1 and warmup >= 0, not {rounds}, {warmup}")
    unet = find_unet(model)
    by_level, chosen = _levels(unet, config, levels)
    decoder = decoder_blocks(unet)
    # Seed, window and use_rand do not change the cost: build as a random-destination call would.
    cfg = config.replace(policy="fixed", start=0.0, end=1.0, use_rand=True)
    latent = (int(latent[0]), int(latent[1]))
    rows = []
    device = dtype = None
    subs = methods.get(config.method).sub_layers(cfg)
    chosen = {level: representative(by_level[level], subs) for level in chosen}
    _check_memory(unet, latent, batch, chosen)
    for level, block in chosen.items():
        blocks = by_level[level]
        if block is None:
            continue
        p = next(block.parameters())
        device, dtype = p.device, p.dtype
        tick = clock or default_clock(device)
        tokens = policy.level_tokens(latent, level)
        g = torch.Generator().manual_seed(level)
        x = torch.randn(batch, tokens, _channels(block), generator=g).to(device, dtype)
        ctx = None
        if _context_dim(block) is not None:
            ctx = torch.randn(batch, CONTEXT_TOKENS, _context_dim(block), generator=g)
            ctx = ctx.to(device, dtype)
        planner = _plan.Planner(cfg, level)
        t = torch.tensor(500.0, device=device)
        built: list[Any] = [None]

        def plain(block=block, x=x, ctx=ctx, planner=planner):
            return runner(block, x, ctx, planner, None)

        def merged(block=block, x=x, ctx=ctx, planner=planner, built=built):
            return runner(block, x, ctx, planner, built[0])

        def build(planner=planner, t=t, x=x, built=built, device=device):
            built[0] = planner.plan(planner.begin(latent, device, t), x, False)

        samples, n = [], len(blocks)
        with torch.no_grad(), _kept(block, device):
            plans = _plan_count(planner, planner.begin(latent, device, t), x, blocks, decoder)

            def timing(block_s, plan_s, merged_s, level=level, tokens=tokens, n=n, plans=plans):
                """One round's (or the fastest) seconds as the level's per-call row."""
                return LevelTiming(level, tokens, n, plans, n * block_s * 1e3,
                                   (plans * plan_s + n * merged_s) * 1e3)

            for i in range(warmup + rounds):
                if i == warmup:
                    _sync(device)
                timed = tick if i >= warmup else _untimed

                def run(fn, timed=timed, device=device):
                    _evict(device)
                    return timed(fn)
                if i % 2:  # alternate the order, so whatever runs first is no handicap
                    b, m = run(build), run(merged)
                    sample = [run(plain), b, m]
                else:
                    sample = [run(plain), run(build), run(merged)]
                if i >= warmup:
                    samples.append(sample)
                    if len(samples) >= min_rounds and _clear(
                            [timing(*ts).speedup for ts in samples]):
                        break
        rows.append(timing(*(min(ts) for ts in zip(*samples))))
    if device is None:
        p = next(unet.parameters())
        device, dtype = p.device, p.dtype
    return Measurement(device_name(device), str(dtype).removeprefix("torch."), latent,
                       int(batch), config.method, tuple(rows))


# ----------------------------------------------------------------------------- the cache

def default_cache_path() -> Path:
    """``$TOME_CACHE_DIR/measurements.json``, else ``$XDG_CACHE_HOME/tome-sd/...``, else
    ``~/.cache/tome-sd/measurements.json``."""
    if os.environ.get("TOME_CACHE_DIR"):
        return Path(os.environ["TOME_CACHE_DIR"]) / "measurements.json"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tome-sd" / "measurements.json"


def _consistent(parts: dict[str, Any], m: Measurement) -> bool:
    """The measurement is of the setup its key names (a hand-edited file might not be)."""
    return (m.device == parts.get("device") and m.dtype == parts.get("dtype")
            and list(m.latent) == parts.get("latent") and m.batch == parts.get("batch")
            and m.method == parts.get("config", {}).get("method"))


class MeasurementCache:
    """Measurements in one small JSON file: ``{"format", "version", "entries": {digest:
    {"parts": ..., "measurement": ...}}}``.

    A bad file (unreadable, corrupt, another format or version, entries that do not parse or
    whose parts do not match their key) is never an error: it is ignored with one console line
    (``say``) and rewritten by the next ``put``. Only valid entries survive a rewrite.
    """

    def __init__(self, path: str | os.PathLike | None = None, say: Callable[[str], Any] = print):
        self.path = Path(path) if path is not None else default_cache_path()
        self.say = say
        self._said: set[str] = set()

    def _once(self, kind: str, line: str) -> None:
        """One console line per kind of problem, however often the file is read."""
        if kind not in self._said:
            self._said.add(kind)
            self.say(line)

    def _complain(self, why: str) -> None:
        self._once("read", f"ToMe: ignoring the measurement cache {self.path} ({why}); it "
                   "will be rewritten")

    def _load(self) -> dict[str, dict[str, Any]]:
        """The valid entries of the file (none when it is missing or bad)."""
        try:
            data = json.loads(self.path.read_bytes())
        except (FileNotFoundError, NotADirectoryError):  # nothing measured yet
            return {}
        except (OSError, ValueError) as e:
            self._complain(f"unreadable: {type(e).__name__}")
            return {}
        if isinstance(data, dict) and data.get("format") == FORMAT \
                and isinstance(data.get("version"), int) and data["version"] < VERSION:
            self._once("read", f"ToMe: the measurements in {self.path} were taken by an older "
                       "ToMe; each size is measured again and the file rewritten")
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT \
                or data.get("version") != VERSION or not isinstance(data.get("entries"), dict):
            self._complain(f"not a {FORMAT} version {VERSION} file")
            return {}
        good = {}
        for digest, entry in data["entries"].items():
            try:
                if not isinstance(entry.get("parts"), dict):
                    raise ValueError("no parts")
                key = CacheKey.of(entry["parts"])
                m = Measurement.from_dict(entry["measurement"])
                if key.digest != digest or not _consistent(key.parts, m):
                    raise ValueError("parts do not match")
                good[digest] = entry
            except (AttributeError, KeyError, TypeError, ValueError):
                self._complain("an entry does not match its key")
        return good

    def get(self, key: CacheKey) -> Measurement | None:
        entry = self._load().get(key.digest)
        if entry is None or entry["parts"] != key.parts:
            return None
        return Measurement.from_dict(entry["measurement"])

    def put(self, key: CacheKey, measurement: Measurement) -> bool:
        """Store and write atomically (temp file + ``os.replace``); False, with one console
        line, when the file cannot be written."""
        entries = self._load()
        entries[key.digest] = {"parts": key.parts, "measurement": measurement.to_dict()}
        data = {"format": FORMAT, "version": VERSION, "entries": entries}
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".measurements-", suffix=".tmp",
                                       dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
            return True
        except OSError as e:
            self._once("write", f"ToMe: could not write the measurement cache {self.path}: {e}")
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return False


# ----------------------------------------------------------------------------- measuring lazily

class Measurer:
    """Measures for the ``auto`` policy when a patched model meets a new size: the service
    behind ``Planner.measurer``. Results are kept in memory and in the cache file, so each
    setup is measured once; failures never fail a generation (one console line, then the
    thresholds decide).

    ``say``: where the one line per measurement goes; ``progress``: called with a short text
    before measuring and with None after it (the WebUI's progress text).
    """

    def __init__(self, cache: MeasurementCache | None = None, say: Callable[[str], Any] = print,
                 progress: Callable[[str], Any] | None = None, rounds: int = 5,
                 warmup: int = 1, clock: Clock | None = None):
        self.cache = cache if cache is not None else MeasurementCache(say=say)
        self.say, self.progress = say, progress
        self.rounds, self.warmup, self.clock = rounds, warmup, clock
        self.results: dict[str, Measurement] = {}  # key digest -> measurement
        # (model, its device and dtype, size, batch, config) -> measurement: skips building the
        # key (walking the model) when a patch is re-applied for every pass.
        self.seen: dict[tuple, Measurement] = {}
        self.last: Measurement | None = None
        self.reason: str | None = None  # why the latest ``get`` returned None (its line)

    def get(self, model: Any, latent: tuple[int, int], batch: int, config: ToMeConfig, *,
            device: torch.device | None = None, runner: Runner = hook_runner,
            levels: Iterable[int] | None = None) -> Measurement | None:
        """The measurement of ``model`` at this size: from memory, the cache, or measured now.
        None (and one console line, also kept as ``reason``) where it is not measured: the
        UNet's blocks are not on ``device`` (the sampling device; --medvram/--lowvram keep them
        elsewhere until they run), a timed run would not fit in memory (``memory.py``; not
        remembered: memory may be free next time), or measuring failed."""
        self.reason = None
        h, w = latent
        try:
            p = next(find_unet(model).parameters())
            quick = (id(model), p.device, p.dtype, tuple(latent), batch, config.replace(
                seed=0, policy="auto", start=0.0, end=1.0, use_rand=True),
                None if levels is None else tuple(levels))
            if quick in self.seen:
                return self.seen[quick]
            key = cache_key(model, latent, batch, config, levels=levels)
            found = self.results.get(key.digest) or self.cache.get(key)
            if found is None:
                found = self._measure(model, latent, batch, config, device, runner, levels, key)
        except memory.NotEnoughMemoryError as e:
            return self._not(f"ToMe: not measured at {w * 8}x{h * 8} px, batch {batch}: {e}; "
                             "the token thresholds decide")
        except Exception as e:  # noqa: BLE001 (the thresholds decide instead)
            return self._not(f"ToMe: could not measure {w * 8}x{h * 8} px ({type(e).__name__}: "
                             f"{e}); the token thresholds decide")
        if found is not None:
            self.results[key.digest] = self.seen[quick] = self.last = found
        return found

    def _not(self, line: str) -> None:
        self.reason = line
        self.say(line)
        return None

    def _measure(self, model, latent, batch, config, device, runner, levels, key):
        unet = find_unet(model)
        on = next(unet.parameters()).device
        if device is not None and torch.device(device) != on:
            return self._not(f"ToMe: not measured: the UNet is on {on}, sampling runs on "
                             f"{device} (--medvram/--lowvram); the token thresholds decide")
        h, w = latent
        if self.progress is not None:
            self.progress(f"ToMe: measuring {w * 8}x{h * 8} px")
        t0 = time.perf_counter()
        try:
            m = measure(unet, latent, batch, config, rounds=self.rounds, warmup=self.warmup,
                        clock=self.clock, levels=levels, runner=runner)
        finally:
            if self.progress is not None:
                self.progress(None)
        seconds = time.perf_counter() - t0
        self.cache.put(key, m)
        rows = ", ".join(f"ds{r.level} {r.speedup:.2f}x "
                         + ("merged" if decide(r) else "not merged") for r in m.rows)
        self.say(f"ToMe: measured {w * 8}x{h * 8} px, batch {batch}, {m.method}, on {m.device} "
                 f"({m.dtype}) in {seconds:.1f} s: {rows or 'no level to merge'}")
        return m

    def for_model(self, model: Any, config: ToMeConfig, runner: Runner = hook_runner
                  ) -> Callable[[tuple[int, int], int, torch.device], dict[int, tuple]]:
        """The ``Planner.measurer`` of one patched model: ``(size, batch, device) ->
        {level: (speed-up, device name)}``."""
        def measured(size: tuple[int, int], batch: int, device: torch.device) -> dict:
            m = self.get(model, size, batch, config, device=device, runner=runner)
            return {} if m is None else speedups(m)
        return measured


def speedups(m: Measurement) -> dict[int, tuple[float, str]]:
    """``{level: (speed-up, device name)}``: what the policy reads."""
    return {r.level: (r.speedup, m.device) for r in m.rows}
