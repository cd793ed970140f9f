"""``python -m tome_lab.dit_bench --compile``: the shipped tiny DiT (a real diffusers Flux)
eager and compiled by blocks (``compile_repeated_blocks(fullgraph=True)``, as diffusers'
docs and our README advise), unpatched and patched, timed interleaved per size (each round
runs every variant once), with the graphs each size compiled: what a compiled user keeps of
pooling's speed-up, and whether new sizes recompile.

Tiny sizes on purpose (a CPU, inductor's compile time): the figures are CPU figures.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

VARIANTS = ("unpatched", "patched")


def _model(patched: bool, config: Any, device: Any = "cpu") -> Any:
    import tome
    from tome_lab import tinydit
    m = tinydit.load_model().to(device)
    if patched:
        tome.apply_patch(m, config=config)
    return m


def run(sizes: list[int], rounds: int = 5, backend: str = "inductor", config: Any = None,
        say: Any = print, device: Any = "cpu", sync: Any = lambda: None) -> list[dict[str, Any]]:
    """Per size (pixels) and variant: eager and compiled ms per model call (median of the
    interleaved rounds), the compiled speed-up, and the graphs that size compiled."""
    import torch._dynamo.testing

    import tome
    config = config or tome.ToMeConfig(method="downsample", downsample_factor=2)
    eager = {v: _model(v == "patched", config, device) for v in VARIANTS}
    compiled, counters = {}, {}
    torch._dynamo.reset()
    for v in VARIANTS:
        compiled[v] = copy.deepcopy(eager[v]) if v == "unpatched" else _model(True, config,
                                                                             device)
        counters[v] = torch._dynamo.testing.CompileCounterWithBackend(backend)
        compiled[v].transformer.compile_repeated_blocks(fullgraph=True, backend=counters[v])
    rows = []
    for size in sizes:
        g = torch.Generator().manual_seed(size)
        x = torch.randn(1, 3, size, size, generator=g).to(device)
        t, c = torch.full((1,), 0.7, device=device), torch.tensor([1], device=device)
        graphs = {}
        with torch.no_grad():
            for v in VARIANTS:  # the compile itself, untimed (twice: a size's first call
                before = counters[v].frame_count  # may compile what the second reuses)
                compiled[v](x, t, c), compiled[v](x, t, c)
                graphs[v] = counters[v].frame_count - before
                eager[v](x, t, c)
            times: dict[tuple[str, str], list[float]] = {}
            for _ in range(rounds):
                for v in VARIANTS:
                    for kind, m in (("eager", eager[v]), ("compiled", compiled[v])):
                        sync()
                        t0 = time.perf_counter()
                        m(x, t, c)
                        sync()
                        times.setdefault((v, kind), []).append(time.perf_counter() - t0)
        for v in VARIANTS:
            e, k = (statistics.median(times[(v, kind)]) * 1e3 for kind in ("eager", "compiled"))
            rows.append({"px": size, "tokens": (size // 2) ** 2, "variant": v, "eager_ms": e,
                         "compiled_ms": k, "graphs": graphs[v]})
            say(f"{size} px ({(size // 2) ** 2} tokens), {v}: eager {e:.1f} ms, compiled "
                f"{k:.1f} ms ({e / k:.2f}x), {graphs[v]} graphs compiled at this size")
    torch._dynamo.reset()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per size, the pooled speed-up eager and compiled, and graphs per size."""
    by = {(r["px"], r["variant"]): r for r in rows}
    lines = ["| px | tokens | eager: unpatched / patched ms | compiled: unpatched / patched ms "
             "| pooled speed-up eager / compiled | graphs at this size: unpatched / patched |",
             "|---|---|---|---|---|---|"]
    for px in sorted({r["px"] for r in rows}):
        u, p = by[(px, "unpatched")], by[(px, "patched")]
        lines.append(f"| {px} | {u['tokens']} | {u['eager_ms']:.1f} / {p['eager_ms']:.1f} | "
                     f"{u['compiled_ms']:.1f} / {p['compiled_ms']:.1f} | "
                     f"{u['eager_ms'] / p['eager_ms']:.2f}x / "
                     f"{u['compiled_ms'] / p['compiled_ms']:.2f}x | "
                     f"{u['graphs']} / {p['graphs']} |")
    return "\n".join(lines)
