"""Output: the benchmark's tables, JSON rows and plot, and the quality figures' table, image
grid and plot."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from typing import Any

import torch

from .quality import at_equal_speed, loss_at
from .run import derive

# ----------------------------------------------------------------------------- formatting


def _num(v: float, fmt: str) -> str:
    return "∞" if math.isinf(v) else format(v, fmt)


def _mib(b: float | None) -> str:
    if b is None or (isinstance(b, float) and math.isnan(b)):
        return "–"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.0f} MiB"


def _x(v: float | None, digits: int = 2, bold: bool = True) -> str:
    if v is None or math.isnan(v):
        return "–"
    return f"**{v:.{digits}f}x**" if bold and v >= 1.0 else f"{v:.{digits}f}x"


def _secs(t: float) -> str:
    if math.isnan(t):
        return "–"
    return f"{t * 1000:.1f} ms" if t < 1 else f"{t:.2f} s"


def _case(r: dict[str, Any]) -> tuple:
    return (r["model"], r["size"], r["dtype"], r["batch"], r.get("device", "cpu"))


def _cases(rows: Sequence[dict[str, Any]]) -> list[tuple]:
    return list(dict.fromkeys(_case(r) for r in rows))


# ----------------------------------------------------------------------------- benchmark


def markdown_table(rows: Sequence[dict[str, Any]]) -> str:
    """One Markdown table per case (model, size, dtype, batch, device)."""
    out = []
    compiled = any(r.get("compile") for r in rows)
    for k in _cases(rows):
        rs = [r for r in rows if _case(r) == k]
        n = len(rs[0]["times"])
        out.append(f"**{k[0]}, {k[1]}x{k[1]} px, {k[2]}, batch {k[3]}, {k[4]}** "
                   f"(median of {n} interleaved runs after warm-up"
                   f"{', torch.compile' if compiled else ''})\n")
        head = ["method", "blocks", "time", "speed-up", "vs tomesd", "min–max", "GFLOPs",
                "peak memory", "deviation"] + (["graphs / breaks / recompiles"]
                                               if compiled else [])
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in rs:
            gf = "–" if r["flops"] is None else f"{r['flops'] / 1e9:,.0f}"
            cells = [r["setting"], r["patched"] or "–", _secs(r["median"]), _x(r["speedup"]),
                     _x(r["vs_tomesd"]), f"{_secs(r['min'])}–{_secs(r['max'])}", gf,
                     _mib(r["peak"]), f"{r['deviation']:.4f}"]
            if compiled:
                c = r.get("compile") or {}
                cells.append(f"{c.get('graphs', '–')} / {c.get('breaks', '–')} / "
                             f"{c.get('recompiles', '–')}")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    methods = {r["method"] for r in rows}
    out.append("Speed-up: unmerged median / median. Peak memory: CUDA max_memory_allocated, or "
               "live tensor bytes allocated during the forward (PyTorch profiler) on the CPU. "
               "Deviation: ||out - unmerged|| / ||unmerged||."
               + (" Ceiling: self-attention removed at the merged levels (the most any token "
                  "reduction there can gain)." if "ceiling" in methods else "")
               + (" Match-only: merging at ratio 0.01, i.e. what the matching alone costs."
                  if "match-only" in methods else ""))
    if compiled:
        out.append(compile_notes(rows))
    return "\n".join(out)


def compile_notes(rows: Sequence[dict[str, Any]]) -> str:
    """The graph-break reasons per setting (first lines), for the table's footnote."""
    lines = ["Graphs / breaks / recompiles: graphs dynamo captured for the setting, graph "
             "breaks, and frames compiled again after its first call (each one is a "
             "recompilation during warm-up or timing)."]
    seen: dict[str, list[str]] = {}
    for r in rows:
        for reason in (r.get("compile") or {}).get("reasons", []):
            seen.setdefault(reason, [])
            if r["setting"] not in seen[reason]:
                seen[reason].append(r["setting"])
    for reason, who in seen.items():
        lines.append(f"- graph break in {', '.join(who)}: {reason}")
    return "\n".join(lines)


#: The summary's columns: (header, row filter).
SUMMARY = (
    ("ceiling", lambda r: r["method"] == "ceiling" and not r["options"]),
    ("tomesd r=0.5", lambda r: r["method"] == "tomesd" and r["value"] == 0.5
     and not r["options"]),
    ("merge 0.5", lambda r: r["method"] == "merge" and r["value"] == 0.5 and not r["options"]),
    ("local 0.5", lambda r: r["method"] == "merge" and r["value"] == 0.5
     and r["options"] == {"matching": "local"}),
    ("downsample x2", lambda r: r["method"] == "downsample" and r["value"] == 2
     and not r["options"]),
)


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """One line per case: the unmerged time, then each standard setting's speed-up vs the
    unmerged model and, after the slash, vs tomesd r=0.5; match-only: ours / tomesd's
    speed-up. Empty string when the rows have fewer than two of these settings."""
    def pick(rs, pred):
        return next((r for r in rs if pred(r)), None)

    cols = [(h, f) for h, f in SUMMARY if any(f(r) for r in rows)]
    match = any(r["method"] == "match-only" for r in rows)
    if len(cols) + match < 2:
        return ""
    head = (["model", "px", "dtype", "unmerged"] + [h for h, _ in cols]
            + (["match-only ours / tomesd"] if match else []))
    lines = ["Speed-up vs the unmerged model in the same run (after the slash: vs tomesd "
             "r=0.5)", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in _cases(rows):
        rs = [r for r in rows if _case(r) == k]
        base = pick(rs, lambda r: r["method"] == "baseline")
        cells = [k[0], str(k[1]), k[2], _secs(base["median"]) if base else "–"]
        for _, f in cols:
            r = pick(rs, f)
            if r is None:
                cells.append("–")
            elif r["method"] == "tomesd":
                cells.append(_x(r["speedup"], bold=False))
            else:
                cells.append(f"{_x(r['speedup'], bold=False)} / {_x(r['vs_tomesd'], bold=False)}")
        if match:
            ours = pick(rs, lambda r: r["method"] == "match-only" and r.get("impl") != "tomesd")
            theirs = pick(rs, lambda r: r["method"] == "match-only" and r.get("impl") == "tomesd")
            cells.append(" / ".join(_x(r["speedup"], bold=False) if r else "–"
                                    for r in (ours, theirs)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def matching_table(rows: list[dict[str, Any]]) -> str:
    names = {"tomesd": "tomesd 0.1.3", "global": "ours, global (= tomesd's result)",
             "local": "ours, local (3x3 cells)"}
    r0 = rows[0]
    lines = [(f"Matching only: {r0['tokens']} tokens, C={r0['channels']}, batch {r0['batch']}, "
              f"{r0['dtype']}, {r0.get('device', 'cpu')}, ratio 0.5; peak = extra memory"),
             "", "| implementation | time (median) | faster than tomesd | peak extra memory |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {names.get(r['impl'], r['impl'])} | {_secs(r['median'])} | "
                     f"{_x(r['vs_tomesd'], 1)} | {_mib(r['peak'])} |")
    return "\n".join(lines)


def save_json(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def load_rows(path: str) -> list[dict[str, Any]]:
    """Rows from a ``--json`` file, speed-ups recomputed (to re-render tables or plots)."""
    with open(path) as f:
        rows = json.load(f)["unet"]
    for key in _cases(rows):
        derive([r for r in rows if _case(r) == key])
    return rows


def _group(r: dict[str, Any]) -> str:
    if r.get("group"):
        return r["group"]
    opts = ",".join(f"{a}={b}" for a, b in r["options"].items())
    return r["method"] + (f" ({opts})" if opts else "")


def plot(rows: list[dict[str, Any]], path: str) -> str:
    """Per case: speed-up and deviation against token reduction, and deviation against
    speed-up (lower right is better), one line per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = _cases(rows)
    colours: dict[str, str] = {}  # one colour per method across all cases
    fig, axes = plt.subplots(len(keys), 3, figsize=(15, 3.8 * len(keys)), squeeze=False)
    for (ax1, ax2, ax3), k in zip(axes, keys):
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in rows:
            if _case(r) == k and r["method"] != "baseline":
                groups.setdefault(_group(r), []).append(r)
        for name, g in groups.items():
            g = sorted(g, key=lambda r: r["reduction"])
            xs = [r["reduction"] for r in g]
            style = {"label": name, "color": colours.setdefault(name, f"C{len(colours) % 10}")}
            ax1.plot(xs, [r["speedup"] for r in g], "o-", **style)
            ax2.plot(xs, [r["deviation"] for r in g], "o-", **style)
            ax3.plot([r["speedup"] for r in g], [r["deviation"] for r in g], "o-", **style)
        ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
        title = f"{k[0]} {k[1]}px {k[2]} b{k[3]} {k[4]}"
        ax1.set(title=f"{title}: speed-up", xlabel="tokens removed (ratio; 1-1/f² for "
                "downsample)", ylabel="speed-up vs unmerged")
        ax2.set(title=f"{title}: deviation", xlabel="tokens removed",
                ylabel="||out - base|| / ||base||")
        ax3.set(title=f"{title}: deviation vs speed-up", xlabel="speed-up vs unmerged",
                ylabel="||out - base|| / ||base||")
        ax1.legend(fontsize=8)
        for ax in (ax1, ax2, ax3):
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- quality


def quality_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (images and raw times left out).

    Loss columns appear when the rows have held-out losses, an SD1.5 column when
    ``sd_deviation`` was added to them (see ``python -m tome_lab.showcase --sd``).
    """
    ts = list(rows[0].get("loss", {}))
    head = ["setting", "s / image", "speed-up", "MSE", "PSNR (dB)", "SSIM"]
    head += [f"loss Δ t={t}" for t in ts]
    sd = "sd_deviation" in rows[0]
    if sd:
        head.append("SD1.5 deviation")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["setting"], f"{r['time']:.2f}", f"{r['speedup']:.2f}x",
                 f"{r['mse']:.1e}", _num(r["psnr"], ".1f"), f"{r['ssim']:.4f}"]
        cells += [f"{100 * r['loss_increase'][t]:+.1f}%" for t in ts]
        if sd:
            cells.append(f"{r['sd_deviation']:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def equal_speed_table(rows: Sequence[dict[str, Any]], speedups: Sequence[float] = (1.5, 2.0)
                      ) -> str:
    """Markdown: one line per method, PSNR / SSIM (/ loss increase) at each speed-up."""
    pts = at_equal_speed(rows, speedups)
    loss = any("loss" in p for p in pts)
    head = ["method"] + [f"at {x:g}x" for x in speedups]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in dict.fromkeys(p["group"] for p in pts):
        cells = [name]
        for p in (p for p in pts if p["group"] == name):
            if "mse" not in p:
                cells.append("– (not that fast)")
                continue
            text = f"{_num(p['psnr'], '.1f')} dB, SSIM {p['ssim']:.4f}"
            cells.append(text + (f", loss Δ {100 * p['loss']:+.2f}%" if loss else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # scalable font: Pillow >= 10.1 + FreeType
    except (TypeError, OSError):
        return ImageFont.load_default()


def caption(row: dict[str, Any], j: int) -> list[str]:
    """Caption lines of image ``j`` of a row: setting, time, distance to the unmerged image."""
    t = row["per_image"]["time"][j]
    if row["unmerged"]:
        return [row["setting"], f"{t:.1f} s", "reference"]
    p, s = row["per_image"]["psnr"][j], row["per_image"]["ssim"][j]
    return [row["setting"], f"{t:.1f} s ({row['speedup']:.2f}x)",
            f"PSNR {_num(p, '.1f')}  SSIM {s:.3f}"]


def _tile(x: torch.Tensor, size: tuple[int, int]):
    from PIL import Image

    t = (x.float().clamp(0, 1) * 255).round().byte()
    t = t.expand(3, *t.shape[-2:]) if t.dim() == 2 or t.shape[0] == 1 else t
    return Image.fromarray(t.permute(1, 2, 0).numpy()).resize(size, Image.NEAREST)


def grid_image(rows: Sequence[dict[str, Any]], scale: int = 3, row_labels=None,
               diff_gain: float = 0):
    """A PIL image: one column per setting, one row per (class, seed), captions under each.

    ``diff_gain`` > 0 adds under each row its differences from the unmerged image,
    |image - unmerged| (mean of the channels) times the gain, dark on white: changes far
    too small to see in the images themselves show where merging acted.
    """
    from PIL import Image, ImageDraw

    ncol, nrow = len(rows), len(rows[0]["jobs"])
    h, w = rows[0]["images"].shape[-2:]
    tw, th = w * scale, h * scale
    texts = [t for r in rows for j in range(nrow) for t in caption(r, j)]
    fs = max(9, min(16, tw // 12))
    while fs > 9 and max(_font(fs).getlength(t) for t in texts) > tw:
        fs -= 1  # the widest caption fits under its image
    font = _font(fs)
    line = fs + 4
    pad = 8
    block = th + 3 * line + 6 + pad + (th + line + 6 + pad if diff_gain else 0)
    left = 0 if row_labels is None else int(max(font.getlength(t) for t in row_labels)) + pad
    img = Image.new("RGB", (left + pad + ncol * (tw + pad), pad + nrow * block), "white")
    draw = ImageDraw.Draw(img)
    ref = next(r for r in rows if r["unmerged"])["images"]
    for j in range(nrow):
        y = pad + j * block
        if row_labels is not None:
            draw.text((pad, y + th // 2 - fs), row_labels[j], fill="black", font=font)
        for i, r in enumerate(rows):
            x = left + pad + i * (tw + pad)
            img.paste(_tile(r["images"][j], (tw, th)), (x, y))
            for k, text in enumerate(caption(r, j)):
                draw.text((x, y + th + 3 + k * line), text, fill="black", font=font)
            if not diff_gain:
                continue
            yd = y + th + 3 * line + 6 + pad
            if r["unmerged"]:
                draw.text((x, yd + th // 2 - line), f"differences x{diff_gain:g}",
                          fill="black", font=font)
                draw.text((x, yd + th // 2), "(white = same)", fill="black", font=font)
                continue
            d = (r["images"][j].float() - ref[j].float()).abs().mean(0) * diff_gain
            img.paste(_tile(1 - d, (tw, th)), (x, yd))
            draw.rectangle((x, yd, x + tw - 1, yd + th - 1), outline=(200, 200, 200))
            mx = (r["images"][j].float() - ref[j].float()).abs().max().item()
            draw.text((x, yd + th + 3), f"max diff {255 * mx:.0f}/255", fill="black", font=font)
    return img


def quality_plot(rows: Sequence[dict[str, Any]], path: str, title: str = "") -> str:
    """Quality against speed-up, one line per method: PSNR, SSIM and held-out loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("psnr", "PSNR vs unmerged (dB, higher = closer)"),
              ("ssim", "SSIM vs unmerged (higher = closer)")]
    if "loss_increase" in rows[0]:
        t = loss_at(rows[0])[0]
        panels.append(("loss", f"held-out loss increase at t={t} (%, lower = better)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.3))
    groups: dict[str, list] = {}
    for r in rows:
        if not r["unmerged"]:
            groups.setdefault(r["group"], []).append(r)

    def y_of(r, key):
        return 100 * loss_at(r)[1] if key == "loss" else r[key]

    for ax, (key, label) in zip(axes, panels):
        for (name, g), marker in zip(groups.items(), itertools.cycle("osD^v<>p*hX")):
            g = sorted(g, key=lambda r: r["speedup"])
            xs, ys = [r["speedup"] for r in g], [y_of(r, key) for r in g]
            ax.plot(xs, ys, marker=marker, ls="-" if len(g) > 1 else "", label=name)
            for r, x, y in zip(g, xs, ys):
                ax.annotate(r["value"], (x, y), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
        if key == "loss":
            ax.axhline(0, color="grey", lw=0.8, ls="--")
        ax.set(xlabel="speed-up vs unmerged (sampling time)", ylabel=label)
        ax.grid(alpha=0.3)
    if len(groups) <= 5:
        axes[0].legend(fontsize=8)
    else:  # many settings: keep the points visible
        axes[-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
