"""One Wan 2.1 1.3B block end to end on the CPU: unpooled, per-frame x2, time-axis cells,
time cells with residual reuse, against the ceiling (the video's keys removed from
self-attention) and the Amdahl bound (self-attention's share x the keys removed).

    python -m tome_lab.wan_block                              # 832x480 x 33 and x 81 frames
    python -m tome_lab.wan_block --sizes 832x480x33 --rounds 2

The model: diffusers' ``WanTransformer3DModel`` with Wan2.1-T2V-1.3B's config (12 heads x 128
= 1536 wide, FFN 8960, 512 umT5 tokens in cross-attention) and **one** block, random weights,
float32 (bf16 is not native on this CPU), batch 1 (one CFG half). A forward is that block plus
the patch embedding, the timestep and text embeddings and the output head (measured apart:
``head``, the forward with the block skipped). The time: the thread's CPU time of one
forward, one thread, variants interleaved (the order reversed every other round), the median.
Reuse: ``reuse=5`` in one generation, the first call a refresh (the full attention and the
pooled one, their difference kept), the second reused (pooled, the difference added): a step's
mean over a period of 5 is (refresh + 4 reused) / 5.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import tome

from .device import machine
from .dit_shapes import Size, build, inputs, text_tokens

#: name -> ``apply_patch`` settings; the keys each leaves of a frame's (fraction removed).
VARIANTS: dict[str, dict[str, Any] | None] = {
    "none": None, "x2": {"downsample_factor": 2}, "x2 2x2x2": {"downsample_factor": 2,
                                                               "temporal": 2},
    "reuse refresh": {"downsample_factor": 2, "temporal": 2, "reuse": 5},
    "ceiling": None}
REMOVED = {"x2": 3 / 4, "x2 2x2x2": 7 / 8, "ceiling": 1.0}  # 2x2x2: at an even frame count


class SelfAttentionClock:
    """``F.scaled_dot_product_attention`` timed per call (thread CPU time); self-attention
    (the video's queries, keys not the text's) apart, its calls with the whole video's keys
    counted (``full``) apart from pooled ones; ``drop``: self-attention gets one key (the
    ceiling)."""

    def __init__(self, video: int, text: int):
        self.video, self.text, self.real = video, text, F.scaled_dot_product_attention
        self.reset()

    def reset(self, drop: bool = False) -> None:
        self.drop, self.self_s, self.other_s, self.full, self.pooled = drop, 0.0, 0.0, 0, 0

    def __call__(self, *a, **kw):
        names = ("query", "key", "value")
        q, k, v = (a[i] if len(a) > i else kw.pop(n) for i, n in enumerate(names))
        a = a[3:]
        is_self = q.shape[-2] == self.video and k.shape[-2] != self.text
        if is_self and self.drop:
            k, v = k[..., :1, :], v[..., :1, :]
        t0 = time.thread_time()
        out = self.real(q, k, v, *a, **kw)
        took = time.thread_time() - t0
        if is_self:
            self.self_s += took
            if k.shape[-2] == self.video:
                self.full += 1
            else:
                self.pooled += 1
        else:
            self.other_s += took
        return out


@contextlib.contextmanager
def swapped(clock: SelfAttentionClock):
    F.scaled_dot_product_attention = clock
    try:
        yield
    finally:
        F.scaled_dot_product_attention = clock.real


def one(model, args, spec, clock: SelfAttentionClock, drop: bool = False) -> dict[str, Any]:
    """One forward (two for reuse: the refresh, then a reused call) timed."""
    out = {}
    if spec is not None:
        tome.apply_patch(model, method="downsample", policy="fixed", rope="before", **spec)
    try:
        with tome.generation(model, 5), swapped(clock):
            for label, t in (("", 0.9), ("reused", 0.8))[:2 if spec and spec.get("reuse")
                                                        else 1]:
                clock.reset(drop)
                call = dict(args, timestep=torch.tensor([1000.0 * t]))
                t0 = time.thread_time()
                model(**call)
                out[label] = {"s": time.thread_time() - t0, "self_s": clock.self_s,
                              "other_attention_s": clock.other_s, "full": clock.full,
                              "pooled": clock.pooled}
    finally:
        if spec is not None:
            tome.remove_patch(model)
    return out


def head_time(model, args) -> float:
    """The forward with the block skipped: the embeddings and the output head."""
    blocks = model.blocks
    model.blocks = torch.nn.ModuleList()
    try:
        t0 = time.thread_time()
        model(**args)
        return time.thread_time() - t0
    finally:
        model.blocks = blocks


def run_size(model, size: Size, rounds: int, say, names: list[str] | None = None
             ) -> dict[str, Any]:
    args = inputs(model, "wan", size, torch.float32, False)
    clock = SelfAttentionClock(size.tokens, text_tokens("wan", False))
    got: dict[str, list[dict[str, Any]]] = {}
    names = names or list(VARIANTS)
    with torch.no_grad():
        head = head_time(model, args)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                res = one(model, args, VARIANTS[name], clock, drop=name == "ceiling")
                if name == "reuse refresh":
                    got.setdefault("reuse refresh", []).append(res[""])
                    got.setdefault("reuse reused", []).append(res["reused"])
                else:
                    got.setdefault(name, []).append(res[""])
                say(f"{size.label} round {r + 1}: {name} " + ", ".join(
                    f"{k or 'call'} {v['s']:.1f} s (self-attention {v['self_s']:.1f} s, "
                    f"{v['full']} full / {v['pooled']} pooled)" for k, v in res.items()))

    def med(name: str, key: str = "s") -> float:
        return statistics.median(x[key] for x in got[name])

    if "none" not in got:  # a part of a run (the reference timed in another): the times only
        return {"size": size.label, "tokens": size.tokens, "head_s": head, "rounds": rounds,
                "rows": {n: {"forward_s": med(n), "self_attention_s": med(n, "self_s")}
                         for n in got}}

    none = med("none")
    share = med("none", "self_s") / none
    frames, h, w = size.grid()  # an odd frame count leaves its last frame alone
    removed = dict(REMOVED, **{"x2 2x2x2": 1 - -(-frames // 2) * -(-h // 2) * -(-w // 2)
                               / size.tokens})
    rows = {}
    for name in got:
        rows[name] = {"block_s": med(name) - head, "forward_s": med(name),
                      "self_attention_s": med(name, "self_s"), "speedup": none / med(name)}
    if "reuse refresh" in got:
        mean5 = (med("reuse refresh") + 4 * med("reuse reused")) / 5
        rows["reuse 5 (mean step)"] = {"forward_s": mean5, "block_s": mean5 - head,
                                       "speedup": none / mean5,
                                       "amdahl": 1 / (1 - share * removed["x2 2x2x2"])}
    for name, part in removed.items():
        if name in rows:
            rows[name]["amdahl"] = 1 / (1 - share * part)
    return {"size": size.label, "tokens": size.tokens, "head_s": head, "rounds": rounds,
            "self_attention_share": share, "rows": rows}


def table(results: list[dict[str, Any]], blocks: int = 30, steps: int = 50) -> str:
    lines = [f"| size | tokens | variant | forward (1 block) | block | self-attention | speed-up "
             f"(forward) | Amdahl bound | {blocks} blocks x {steps} steps, one CFG half |",
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for name, r in res["rows"].items():
            att = f"{r['self_attention_s']:.1f} s" if "self_attention_s" in r else "–"
            bound = f"{r['amdahl']:.2f}x" if "amdahl" in r else "–"
            total = (res["head_s"] + blocks * r["block_s"]) * steps / 3600
            lines.append(f"| {res['size']} | {res['tokens']} | {name} | {r['forward_s']:.1f} s | "
                         f"{r['block_s']:.1f} s | {att} | {r['speedup']:.2f}x | {bound} | "
                         f"{total:.1f} h |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_lab.wan_block",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="832x480x33,832x480x81")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="out/wan-block")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="in this order (none first: the reference)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from diffusers.utils import logging as diffusers_logging
    diffusers_logging.set_verbosity_error()
    model = build("wan", (1, 0), False, torch.float32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)

    results = []
    for text in args.sizes.split(","):
        results.append(run_size(model, Size.parse(text), args.rounds, say,
                                args.variants.split(",")))
        (out / "wan_block.json").write_text(json.dumps(
            {"machine": machine(torch.device("cpu")), "threads": args.threads,
             "results": results}, indent=1))
        if "self_attention_share" in results[-1]:
            (out / "wan_block.md").write_text(table(results) + "\n")
            say(f"self-attention share {results[-1]['self_attention_share']:.0%}")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
