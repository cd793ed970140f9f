"""A similarity gate for time-axis cells, prototyped in the lab: pool two frames' keys/values
in time only where the frames are close, measured against plain time cells on the trained
tiny video DiT (``tome_lab/tinyvdit``).

    python -m tome_lab.similarity_gate                 # writes out/similarity-gate/
    python -m tome_lab.similarity_gate --seeds 0 --steps 6

The prototype stands in for ``F.scaled_dot_product_attention`` during sampling and pools the
video's self-attention keys/values itself (the keys arrive rotated: the presets' ``rope
before``): 2x2 cells within each frame (x2), then each pair of frames (0-1, 2-3, ...; the 9th
alone) per cell: where the cosine similarity of the two frames' cell keys (all heads' channels
as one vector) is at least ``threshold`` the pair becomes one key (the mean, 8 tokens: log 8
added to its logit, proportional attention), elsewhere both stay (4 tokens each: log 4). One
batch holds videos with different pairs merged, so every pair has two key slots and a merged
pair's second is masked out: the prototype measures quality at the keys a gate would keep
(``keys a frame``: the mean), not speed. Threshold -1 merges every pair (plain 2x2x2 time
cells; checked against the library's ``temporal=2``), 2 none (per-frame x2).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import tome

from . import tinyvdit
from .tinyvdit import model as tinyvdit_model
from .video_quality import compare_videos

THRESHOLDS = (-1.0, 0.9, 0.95, 0.97, 0.98, 0.99, 2.0)


class Gate:
    """The stand-in kernel: self-attention over the gated pooled keys (``frames x h x w``
    tokens), every other call passed on; ``merged``/``pairs``: the pair-cells merged so far."""

    def __init__(self, threshold: float, frames: int, h: int, w: int):
        self.threshold, self.grid = threshold, (frames, h, w)
        self.real = F.scaled_dot_product_attention
        self.merged = self.pairs = 0

    def pool(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keys, values (``[B, H, n, D]``) and the additive mask (``[B, 1, 1, n]``)."""
        frames, h, w = self.grid
        b, heads, _, d = k.shape

        def cells(x: torch.Tensor) -> torch.Tensor:  # [B, H, F, cells, D], 2x2 means
            x = x.reshape(b, heads, frames, h // 2, 2, w // 2, 2, d)
            return x.mean((4, 6)).reshape(b, heads, frames, -1, d)

        kc, vc = cells(k), cells(v)
        pairs = frames // 2
        ka, kb = kc[:, :, 0:2 * pairs:2], kc[:, :, 1:2 * pairs:2]  # [B, H, P, C, D]
        va, vb = vc[:, :, 0:2 * pairs:2], vc[:, :, 1:2 * pairs:2]
        sim = F.cosine_similarity(ka.permute(0, 2, 3, 1, 4).flatten(3),
                                  kb.permute(0, 2, 3, 1, 4).flatten(3), dim=-1)  # [B, P, C]
        merge = (sim >= self.threshold)
        self.merged += int(merge.sum())
        self.pairs += merge.numel()
        m = merge[:, None, :, :, None]
        first_k = torch.where(m, (ka + kb) / 2, ka)
        first_v = torch.where(m, (va + vb) / 2, va)
        log4, log8 = math.log(4), math.log(8)
        bias_first = torch.where(merge, log8, log4)
        bias_second = torch.where(merge, float("-inf"), log4)
        keys = [first_k.flatten(2, 3), kb.flatten(2, 3)]
        values = [first_v.flatten(2, 3), vb.flatten(2, 3)]
        biases = [bias_first.flatten(1), bias_second.flatten(1)]
        if frames % 2:  # the last frame alone: its own cells
            keys.append(kc[:, :, -1])
            values.append(vc[:, :, -1])
            biases.append(torch.full((b, kc.shape[3]), log4))
        mask = torch.cat(biases, 1).to(k.dtype)[:, None, None, :]
        return torch.cat(keys, 2), torch.cat(values, 2), mask

    def __call__(self, *a: Any, **kw: Any) -> torch.Tensor:
        names = ("query", "key", "value")
        q, k, v = (a[i] if len(a) > i else kw.pop(n) for i, n in enumerate(names))
        tokens = math.prod(self.grid)
        if q.shape[-2] != tokens or k.shape[-2] != tokens:
            return self.real(q, k, v, *a[3:], **kw)
        kp, vp, mask = self.pool(k, v)
        kw.pop("attn_mask", None)
        return self.real(q, kp, vp, attn_mask=mask, **kw)


@contextlib.contextmanager
def gated(gate: Gate):
    F.scaled_dot_product_attention = gate
    try:
        yield gate
    finally:
        F.scaled_dot_product_attention = gate.real


def run(seeds: list[int], steps: int, guidance: float, progress=None) -> list[dict[str, Any]]:
    model = tinyvdit.load_model()
    classes = list(range(len(tinyvdit.CLASSES)))
    frames = tinyvdit_model.FRAMES
    side = tinyvdit_model.SIZE // tinyvdit_model.CONFIG["patch_size"][-1]
    ref = torch.cat([tinyvdit.sample(model, classes, seed=s, steps=steps, guidance=guidance)
                     for s in seeds])
    rows = []
    for threshold in THRESHOLDS:
        if progress:
            progress(f"{steps} steps, cfg {guidance:g}: threshold {threshold:g}")
        gate = Gate(threshold, frames, side, side)
        with gated(gate):
            got = torch.cat([tinyvdit.sample(model, classes, seed=s, steps=steps,
                                             guidance=guidance) for s in seeds])
        share = gate.merged / max(gate.pairs, 1)
        # keys a frame: 16 cells, a pair merged leaves 8 a frame, the 9th frame keeps 16
        keys = (2 * (frames // 2) * 16 * (1 - share / 2) + 16 * (frames % 2)) / frames
        rows.append({"steps": steps, "guidance": guidance, "threshold": threshold,
                     "merged": share, "keys_per_frame": keys, "videos": got,
                     **compare_videos(got, ref)})
    # the prototype's plain time cells against the library's (the same maths?)
    with contextlib.ExitStack() as stack:
        tome.apply_patch(model, method="downsample", downsample_factor=2, temporal=2,
                         rope="before", policy="fixed")
        stack.callback(tome.remove_patch, model)
        lib = torch.cat([tinyvdit.sample(model, classes, seed=s, steps=steps,
                                         guidance=guidance) for s in seeds])
    rows[0]["library_psnr"] = compare_videos(rows[0]["videos"], lib)["psnr"]
    rows.append({"steps": steps, "guidance": guidance, "threshold": "library 2x2x2",
                 "merged": 1.0, "keys_per_frame": rows[0]["keys_per_frame"], "videos": lib,
                 **compare_videos(lib, ref)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| steps | cfg | gate | pairs merged | keys a frame | PSNR | SSIM | "
             "frame-to-frame error | motion kept |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r["threshold"]
        name = (t if isinstance(t, str) else "always (2x2x2)" if t < -0.5 else
                "never (x2)" if t > 1 else f"cos >= {t:g}")
        lines.append(f"| {r['steps']} | {r['guidance']:g} | {name} | {r['merged']:.0%} | "
                     f"{r['keys_per_frame']:.1f} | {r['psnr']:.2f} dB | {r['ssim']:.3f} | "
                     f"{r['motion_error']:.1%} | {r['motion_ratio']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tome_lab.similarity_gate",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", default="20,6")
    ap.add_argument("--guidance", default="1")
    ap.add_argument("--out", default="out/similarity-gate")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()

    def progress(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {msg}", file=sys.stderr, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    for steps in (int(s) for s in args.steps.split(",")):
        for g in (float(x) for x in args.guidance.split(",")):
            rows += run([int(s) for s in args.seeds.split(",")], steps, g, progress)
            (out / "similarity_gate.md").write_text(table(rows) + "\n")
    (out / "similarity_gate.json").write_text(json.dumps(
        [{k: v for k, v in r.items() if k != "videos"} for r in rows], indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
