"""What proportional attention costs per kernel path: pooled joint attention with no bias,
with the bias as an additive [1, 1, 1, S] mask (SDPA), and with it as one extra query/key
channel (``tome.attend.count_channel``, padded to 8: the path for kernels that take no mask).

    python -m tome_lab.dit_bias_bench             # this machine's CPU, one thread
    python -m tome_lab.dit_bias_bench --device cuda   # prints the same table on a GPU

Shapes: the tiny DiT (1024 image tokens, 3 heads x 32) and Flux at 1024 px (4096 image
tokens, 512 text, 24 heads x 128), image keys pooled x2. Variants interleaved per round; the
median of the rounds and its ratio to the unbiased kernel.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tome import attend, dit

#: (name, batch, heads, head dim, text tokens, image grid side)
SHAPES = (("tiny DiT 64 px", 1, 3, 32, 4, 32), ("Flux 1024 px", 1, 24, 128, 512, 64))


def variants(b: int, heads: int, d: int, text: int, side: int, device: str, dtype):
    g = torch.Generator().manual_seed(0)
    n = text + side * side
    q, k, v = (torch.randn(b, heads, n, d, generator=g).to(device, dtype) for _ in range(3))
    plan = dit.DitPlan(side, side, 2, "pooled", True)
    kp, vp = plan.pool(k, text, 2), plan.pool(v, text, 2)
    bias = plan.bias(text, n, device)

    def plain():
        return F.scaled_dot_product_attention(q, kp, vp)

    def mask():
        return F.scaled_dot_product_attention(q, kp, vp, attn_mask=bias.to(dtype).view(1, 1, 1, -1))

    def channel():
        q2, k2, v2 = attend.count_channel(q, kp, vp, bias, 2)
        return F.scaled_dot_product_attention(q2, k2, v2, scale=d ** -0.5)[..., :d]

    return {"pooled, no bias": plain, "bias as mask": mask, "bias as channel": channel}


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tome_lab.dit_bias_bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = torch.bfloat16
    print(f"device {a.device}, {dtype}, {torch.get_num_threads()} thread(s), torch "
          f"{torch.__version__}; median of {a.rounds} interleaved rounds")
    print("| shape | variant | time | vs no bias |\n|---|---|---|---|")
    with torch.no_grad():
        for name, *shape in SHAPES:
            vs = variants(*shape, a.device, dtype)
            ref = vs["pooled, no bias"]()
            for f in vs.values():  # warm up; and every path agrees on the unbiased part
                assert f().shape == ref.shape
            times: dict[str, list[float]] = {k: [] for k in vs}
            for r in range(a.rounds):
                for k in (list(vs) if r % 2 == 0 else list(vs)[::-1]):
                    times[k].append(timed(vs[k], a.device))
            base = statistics.median(times["pooled, no bias"])
            for k, ts in times.items():
                m = statistics.median(ts)
                print(f"| {name} | {k} | {m * 1e3:.2f} ms | {m / base:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
