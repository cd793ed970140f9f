"""Remembering measurements: the cache key, the cache file and the measuring service.

``measure.py`` times a model; this room makes sure that happens once per setup, not once per
image: ``cache_key`` names everything that changes the answer, ``MeasurementCache`` keeps the
answers in one small JSON file (a corrupt or foreign file is ignored, never trusted), and
``Measurer`` is the service behind the auto policy: asked by a host adapter at the first call
of each size, it answers from memory, the file, or a new measurement, and says one line;
``Measurer.forget`` drops a size's reading (a host's "re-measure").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import memory, methods
from .config import ToMeConfig
from .layout import UnsupportedModelError, attention, context_dim, denoiser, read
from .measure import (
    Clock,
    Measurement,
    Runner,
    attention_backend,
    device_name,
    measure,
    width,
)
from .policy import LevelSpeed, latent_grid, size_text

# Version 2: each timing the fastest of its rounds (1: medians); an older file is measured again.
# A reading also keeps when it was taken and each row its rounds' spread (``low``, ``high``):
# optional fields, so a version 2 file written before them is read as it is, its readings
# certain (they were taken the way every reading was until then; ``forget`` drops one).
FORMAT, VERSION = "tome-measurements", 2
# The config fields that change the merged cost (less those the method ignores); seed, start,
# end, policy and use_rand do not. The form that runs a block adds its own (``key_fields``: a
# DiT form's rope, blocks, proportional, schedule; a UNet's method none, so UNet keys stay).
KEY_FIELDS = ("method", "ratio", "sx", "sy", "matching", "share", "downsample_factor",
              "merge_attn", "merge_crossattn", "merge_mlp")


def fingerprint(model: Any) -> str:
    """A short hash of the UNet's architecture (class; per transformer block: level, side,
    channels, heads, context dim, and its kind where it is not a UNet's block: a DiT's double
    or single), never its weights: fine-tunes of one model share timings."""
    layout = read(model)
    unet = layout.root
    blocks = [[b.level, b.decoder, width(b.module), _heads(b.module),
               context_dim(b.module)] + ([b.kind] if b.kind != "unet" else [])
              for b in layout.blocks]
    arch = {"class": f"{type(unet).__module__}.{type(unet).__qualname__}", "blocks": blocks}
    return hashlib.sha1(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


def _heads(block: Any) -> Any:
    """The block's attention heads where its attention module names them (None where a
    host's DiT block has no ``attn``: ComfyUI's Flux)."""
    try:
        return getattr(attention(block), "heads", None)
    except UnsupportedModelError:
        return None


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


# Key fields added after readings were cached, with the value every earlier reading had: left
# out at that value, so those readings keep their keys (as an image's key has no ``frames``).
ADDED = {"reuse": 0, "temporal": 1}


def key_config(layout: Any, config: ToMeConfig) -> dict[str, Any]:
    """The config fields that change the merged cost of ``layout``'s blocks: ``KEY_FIELDS`` and
    the ``key_fields`` of the form that runs each block (a block of a kind other than a UNet's
    runs the method's DiT form, ``Method.dit_form``), less those the method ignores and those
    ``ADDED`` later at their earlier value."""
    method = methods.get(config.method)
    extra = {f for b in layout.blocks for f in getattr(
        method.dit_form if b.kind != "unet" else method, "key_fields", ())}
    return {f: getattr(config, f) for f in KEY_FIELDS + tuple(sorted(extra))
            if f not in method.ignores and not (f in ADDED and getattr(config, f) == ADDED[f])}


def cache_key(model: Any, latent: tuple[int, ...], batch: int, config: ToMeConfig, *,
              levels: Iterable[int] | None = None, refresh: float = 0) -> CacheKey:
    """Everything that changes ``measure``'s answer: device (and CUDA compute capability),
    torch version, attention backend, dtype, CPU threads, architecture, latent (``(height,
    width)``; a video's ``(frames, height, width)`` adds ``frames``, so an image's key is
    what it always was), batch, the levels measured and the config fields that change the
    merged cost; ``refresh``: residual reuse's period where it is not the settings' N (paced
    to the steps, or a step cache's skips: ``Counts.refresh_period``)."""
    layout = read(model)
    by_level, chosen = layout.levels_to_measure(config, levels)
    p = next(by_level[chosen[0]][0].parameters()) if chosen else next(layout.root.parameters())
    dev = p.device
    frames, h, w = latent_grid(latent)
    parts = {
        "device": device_name(dev),
        "capability": list(torch.cuda.get_device_capability(dev)) if dev.type == "cuda"
        else None,
        "threads": torch.get_num_threads() if dev.type == "cpu" else None,
        "torch": torch.__version__,
        "attention": attention_backend(layout),
        "dtype": str(p.dtype).removeprefix("torch."),
        "unet": fingerprint(layout),
        "latent": [h, w],
        "batch": int(batch),
        "levels": chosen,
        "config": key_config(layout, config),
    }
    if frames > 1:
        parts["frames"] = frames
    if refresh and refresh != config.reuse:
        parts["refresh"] = refresh
    return CacheKey.of(parts)




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
            and list(m.latent[-2:]) == parts.get("latent") and m.batch == parts.get("batch")
            and (len(m.latent) == 2 or m.latent[0] == parts.get("frames"))
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
        return self._write(entries)

    def drop(self, key: CacheKey) -> bool:
        """Remove ``key``'s reading from the file (the others stay); True if there was one
        and the file was rewritten without it."""
        entries = self._load()
        if entries.pop(key.digest, None) is None:
            return False
        return self._write(entries)

    def _write(self, entries: dict[str, dict[str, Any]]) -> bool:
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
                 warmup: int = 1, clock: Clock | None = None, retakes: int = 2):
        self.cache = cache if cache is not None else MeasurementCache(say=say)
        self.say, self.progress = say, progress
        self.rounds, self.warmup, self.clock = rounds, warmup, clock
        self.retakes = retakes  # ``measure``'s: a level whose rounds disagree is timed again
        self.results: dict[str, Measurement] = {}  # key digest -> measurement
        # (model, its device and dtype, size, batch, config) -> key digest: skips building the
        # key (walking the model) when a patch is re-applied for every pass.
        self.seen: dict[tuple, str] = {}
        self.last: Measurement | None = None
        self.reason: str | None = None  # why the latest ``get`` returned None (its line)

    def get(self, model: Any, latent: tuple[int, ...], batch: int, config: ToMeConfig, *,
            runner: Runner, device: torch.device | None = None,
            levels: Iterable[int] | None = None) -> Measurement | None:
        """The measurement of ``model`` at this size: from memory, the cache, or measured now.
        None (and one console line, also kept as ``reason``) where it is not measured: the
        UNet's blocks are not on ``device`` (the sampling device; --medvram/--lowvram keep them
        elsewhere until they run), a timed run would not fit in memory (``memory.py``; not
        remembered: memory may be free next time), measuring failed, or the latent is a
        video's (``(frames, height, width)``) and ``runner`` cannot time one (only the per-call
        DiT forms' runner says ``video``). A runner's ``period`` (residual reuse's refresh
        period the generation will run) is part of the key: a new one is measured anew."""
        self.reason = None
        grid, size = latent_grid(latent), size_text(latent)
        if grid[0] > 1 and not getattr(runner, "video", False):
            return self._not(f"ToMe: not measured at {size}: video grids are not timed yet; "
                             "the token thresholds decide")
        latent = grid[1:] if grid[0] == 1 else grid  # an image: (height, width), as ever
        period = getattr(runner, "period", None)
        refresh = period() if period is not None else 0
        try:
            quick = (*self._quick(model, latent, batch, config, levels), refresh)
            if self.seen.get(quick) in self.results:
                return self.results[self.seen[quick]]
            key = cache_key(model, latent, batch, config, levels=levels, refresh=refresh)
            found = self.results.get(key.digest) or self.cache.get(key)
            if found is None:
                found = self._measure(model, latent, batch, config, device, runner, levels, key)
        except memory.NotEnoughMemoryError as e:
            return self._not(f"ToMe: not measured at {size}, batch {batch}: {e}; "
                             "the token thresholds decide")
        except Exception as e:  # noqa: BLE001 (the thresholds decide instead)
            return self._not(f"ToMe: could not measure {size} ({type(e).__name__}: "
                             f"{e}); the token thresholds decide")
        if found is not None:
            self.results[key.digest] = self.last = found
            self.seen[quick] = key.digest
        return found

    @staticmethod
    def _quick(model: Any, latent: tuple[int, ...], batch: int, config: ToMeConfig,
               levels: Iterable[int] | None) -> tuple:
        p = next(denoiser(model).parameters())
        return (id(model), p.device, p.dtype, latent, batch, config.replace(
            seed=0, policy="auto", start=0.0, end=1.0, use_rand=True),
            None if levels is None else tuple(levels))

    def forget(self, model: Any, latent: tuple[int, ...], batch: int, config: ToMeConfig, *,
               levels: Iterable[int] | None = None) -> bool:
        """Drop the reading ``get`` would answer for this model, size, batch and config (from
        memory and the cache file; every other size stays), so the next ``get`` measures it
        again: a reading taken while the machine was busy. True if there was one."""
        grid = latent_grid(latent)
        latent = grid[1:] if grid[0] == 1 else grid
        try:
            key = cache_key(model, latent, batch, config, levels=levels)
        except Exception:  # noqa: BLE001 (nothing measured to drop; ``get`` says why)
            return False
        known = self.results.pop(key.digest, None)
        self.seen = {q: d for q, d in self.seen.items() if d != key.digest}
        if known is not None and known is self.last:
            self.last = None
        return self.cache.drop(key) or known is not None

    def _not(self, line: str) -> None:
        self.reason = line
        self.say(line)
        return None

    def _measure(self, model, latent, batch, config, device, runner, levels, key):
        layout = read(model)
        on = next(layout.root.parameters()).device
        if device is not None and torch.device(device) != on:
            return self._not(f"ToMe: not measured: the UNet is on {on}, sampling runs on "
                             f"{device} (--medvram/--lowvram); the token thresholds decide")
        size = size_text(latent)
        if self.progress is not None:
            self.progress(f"ToMe: measuring {size}")
        t0 = time.perf_counter()
        try:
            m = measure(layout, latent, batch, config, rounds=self.rounds, warmup=self.warmup,
                        clock=self.clock, levels=levels, runner=runner, retakes=self.retakes)
        finally:
            if self.progress is not None:
                self.progress(None)
        seconds = time.perf_counter() - t0
        self.cache.put(key, m)
        rows = ", ".join(f"ds{r.level} {r.speedup:.2f}x {r.verdict()}" for r in m.rows)
        self.say(f"ToMe: measured {size}, batch {batch}, {m.method}, on {m.device} "
                 f"({m.dtype}) in {seconds:.1f} s: {rows or 'no level to merge'}")
        return m

    def for_model(self, model: Any, config: ToMeConfig, runner: Runner
                  ) -> Callable[[tuple[int, ...], int, torch.device], dict[int, LevelSpeed]]:
        """The ``Planner.measurer`` of one patched model, built by its host adapter (which
        says how its blocks run merged: ``runner``): ``(size, batch, device) -> {level:
        LevelSpeed}``."""
        def measured(size: tuple[int, ...], batch: int, device: torch.device) -> dict:
            m = self.get(model, size, batch, config, device=device, runner=runner)
            return {} if m is None else speedups(m)
        return measured


def speedups(m: Measurement) -> dict[int, LevelSpeed]:
    """``{level: LevelSpeed}`` (speed-up, device, spread): what the policy reads."""
    return {r.level: LevelSpeed(r.speedup, m.device, r.low, r.high) for r in m.rows}
