"""The algorithm: bipartite soft matching on a 2-D token grid, and token downsampling.

Pure tensor code with no knowledge of models, hosts or the WebUI.

ToMe for SD (Bolya & Hoffman 2023): the tokens of an ``h x w`` grid are split into
destinations (one per ``sy x sx`` cell) and sources (the rest). Each source finds its most
similar destination (cosine similarity of the block input); the ``r`` sources with the best
match are averaged into their destination. After the sub-layer runs on the reduced set, every
merged source copies its destination's output back ("unmerge").

Differences from tomesd's ``merge.py`` that do not change its results:
- global matching never holds the whole ``(N - N/4) x N/4`` score matrix: sources are scored
  in chunks bounded by bytes (``CHUNK_BYTES``), and only the chunk is normalised, so memory
  stays flat at any image size;
- merge is one row gather plus one ``index_add_`` (no ``scatter_reduce``, no concatenation);
  unmerge is one row gather through a precomputed inverse index instead of three scatters;
- the partition is built once per grid and reused by every block at that level.

``local_match`` is the fast variant: a source only looks at the destinations of the 3 x 3
cells around its own, which is ``9`` dot products per source instead of ``N / (sx*sy)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

Fn = Callable[[torch.Tensor], torch.Tensor]

# Byte budget of one chunk of scores (global) or of candidate features (local), whole batch.
CHUNK_BYTES = 32 << 20
_OFFSETS = [(di, dj) for di in (-1, 0, 1) for dj in (-1, 0, 1)]


def do_nothing(x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
    return x


def random_cells(h: int, w: int, sx: int, sy: int, generator: torch.Generator) -> torch.Tensor:
    """One random destination per ``sy x sx`` cell: a ``(h // sy, w // sx)`` tensor in
    [0, sx*sy)."""
    return torch.randint(sx * sy, (h // sy, w // sx), generator=generator,
                         device=generator.device)


def partition(h: int, w: int, sx: int, sy: int, cells: torch.Tensor | None = None,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Split the raster-ordered tokens of an ``h x w`` grid into ``(src_idx, dst_idx)``.

    ``cells`` gives the chosen position inside each cell (row-major, from ``random_cells``);
    None picks the top-left token. Rows and columns left over when the stride does not divide
    the grid are always sources, as in tomesd. Both index lists come in exactly tomesd's
    order (its argsort of a -1/0 buffer is not stable), so ties between equal scores, which
    are common in bf16, are broken as tomesd breaks them.
    """
    hsy, wsx = h // sy, w // sx
    if cells is None:
        cells = torch.zeros(hsy, wsx, dtype=torch.long)
    cells = cells.to(device=device, dtype=torch.long)
    view = torch.zeros(hsy, wsx, sy * sx, dtype=torch.long, device=device)
    view.scatter_(2, cells[..., None], -1)
    view = view.view(hsy, wsx, sy, sx).transpose(1, 2).reshape(hsy * sy, wsx * sx)
    if hsy * sy < h or wsx * sx < w:
        buf = torch.zeros(h, w, dtype=torch.long, device=device)
        buf[:hsy * sy, :wsx * sx] = view
        view = buf
    order = view.reshape(1, -1, 1).argsort(dim=1)[0, :, 0]
    num_dst = hsy * wsx
    return order[num_dst:], order[:num_dst]


def cell_of(idx: torch.Tensor, w: int, sx: int, sy: int, hsy: int, wsx: int) -> torch.Tensor:
    """Row-major cell number of raster token ids (leftover rows/columns: the nearest cell)."""
    return (idx // w // sy).clamp(max=hsy - 1) * wsx + (idx % w // sx).clamp(max=wsx - 1)


def _chunk_rows(cols: int, batch: int, itemsize: int) -> int:
    """Rows per chunk so that ``rows x cols`` values for the whole batch fit ``CHUNK_BYTES``."""
    return max(1, CHUNK_BYTES // max(1, cols * batch * itemsize))


def global_match(metric: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """tomesd's matching: every source against every destination, in chunks of sources.

    Returns ``(node_max, node_idx)`` [B, Ns]: each source's best cosine score and the position
    of its destination in ``dst_idx``. The sources are gathered chunk by chunk, so the extra
    memory is the normalised destinations plus one chunk, whatever the image size.
    """
    B, _, C = metric.shape
    b = metric[:, dst_idx]
    b.div_(b.norm(dim=-1, keepdim=True))  # in place: the gather is already a copy
    bt = b.transpose(-1, -2)
    chunk = _chunk_rows(b.shape[1] + C, B, max(metric.element_size(), 4))
    maxes, idxs = [], []
    for part in src_idx.split(chunk):
        a = metric[:, part]
        a = a / a.norm(dim=-1, keepdim=True)
        m, i = (a @ bt).max(dim=-1)
        maxes.append(m)
        idxs.append(i)
    if len(maxes) == 1:
        return maxes[0], idxs[0]
    return torch.cat(maxes, dim=1), torch.cat(idxs, dim=1)


def local_match(metric: torch.Tensor, h: int, w: int, sx: int, sy: int,
                src_idx: torch.Tensor, dst_idx: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Matching restricted to the neighbourhood: a source in cell ``(i, j)`` is compared only
    with the destinations of cells ``(i-1..i+1, j-1..j+1)``.

    Same outputs as ``global_match`` (``node_max``, ``node_idx`` into ``dst_idx``), which it
    equals whenever every source's best destination is a neighbour. Rows and columns left
    over by the stride belong to the nearest cell. Scores are ``x . d / |x|`` with ``d`` the
    normalised destination, so no normalised copy of the whole metric is made; the work is
    chunked over rows of cells with a byte budget.
    """
    B, N, C = metric.shape
    hsy, wsx = h // sy, w // sx
    if hsy == 0 or wsx == 0:
        return global_match(metric, src_idx, dst_idx)
    dev, S = metric.device, sx * sy
    # Destinations in cell order (one per cell); results are mapped back to dst_idx positions.
    by_cell = cell_of(dst_idx, w, sx, sy, hsy, wsx).argsort()
    grid = metric.new_zeros(B, hsy + 2, wsx + 2, C)  # a zero ring of cells around the grid
    inner = grid[:, 1:-1, 1:-1]
    inner.copy_(metric[:, dst_idx[by_cell]].view(B, hsy, wsx, C))
    inner.div_(inner.norm(dim=-1, keepdim=True))
    # -inf for neighbours outside the grid; [hsy, wsx, 9]
    ok = torch.ones(hsy + 2, wsx + 2, dtype=torch.bool, device=dev)
    ok[0], ok[-1], ok[:, 0], ok[:, -1] = False, False, False, False
    mask = torch.stack([ok[1 + di:hsy + 1 + di, 1 + dj:wsx + 1 + dj] for di, dj in _OFFSETS], -1)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=dev).masked_fill_(~mask,
                                                                                  -math.inf)
    best = torch.empty(B, h, w, dtype=torch.float32, device=dev)
    arg = torch.empty(B, h, w, dtype=torch.long, device=dev)
    x = metric.view(B, h, w, C)
    hm, wm = hsy * sy, wsx * sx
    itemsize = max(metric.element_size(), 2)
    rows = max(1, CHUNK_BYTES // max(1, B * wsx * (S + 9) * C * itemsize))
    for i0 in range(0, hsy, rows):
        i1 = min(hsy, i0 + rows)
        n = i1 - i0
        # Tokens of these cells, cell-major: [B*n*wsx, S, C]
        xc = x[:, i0 * sy:i1 * sy, :wm].reshape(B, n, sy, wsx, sx, C).permute(0, 1, 3, 2, 4, 5)
        xc = xc.reshape(B * n * wsx, S, C)
        # The 9 neighbouring destinations of each cell: [B*n*wsx, C, 9]
        nb = torch.stack([grid[:, i0 + 1 + di:i1 + 1 + di, 1 + dj:wsx + 1 + dj]
                          for di, dj in _OFFSETS], dim=-1).reshape(B * n * wsx, C, 9)
        sc = torch.bmm(xc, nb).view(B, n, wsx, S, 9).float() + bias[i0:i1, :, None]
        m, k = sc.max(dim=-1)                                     # [B, n, wsx, S]
        best[:, i0 * sy:i1 * sy, :wm] = m.view(B, n, wsx, sy, sx).permute(0, 1, 3, 2, 4) \
            .reshape(B, n * sy, wm)
        arg[:, i0 * sy:i1 * sy, :wm] = k.view(B, n, wsx, sy, sx).permute(0, 1, 3, 2, 4) \
            .reshape(B, n * sy, wm)
    if hm < h or wm < w:  # leftover rows / columns: the nearest cell's neighbourhood
        ys = torch.arange(h, device=dev)
        xs = torch.arange(w, device=dev)
        left = ((ys[:, None] >= hm) | (xs[None, :] >= wm)).reshape(-1).nonzero().squeeze(1)
        cell = cell_of(left, w, sx, sy, hsy, wsx)
        ci, cj = cell // wsx, cell % wsx
        nb = torch.stack([grid[:, ci + 1 + di, cj + 1 + dj] for di, dj in _OFFSETS], dim=-1)
        sc = torch.einsum("blc,blck->blk", metric[:, left], nb).float() + bias[ci, cj]
        m, k = sc.max(dim=-1)
        best.view(B, N)[:, left] = m
        arg.view(B, N)[:, left] = k
    best = best.view(B, N)[:, src_idx]
    k = arg.view(B, N)[:, src_idx]
    # Cell of each source, then of the chosen neighbour, as an index into dst_idx.
    cell = cell_of(src_idx, w, sx, sy, hsy, wsx)
    ci, cj = cell // wsx, cell % wsx
    di = torch.tensor([o[0] for o in _OFFSETS], device=dev)[k]
    dj = torch.tensor([o[1] for o in _OFFSETS], device=dev)[k]
    node_idx = by_cell[(ci + di) * wsx + (cj + dj)]
    norms = torch.cat([metric[:, p].float().norm(dim=-1)  # chunked: no fp32 copy of all
                       for p in src_idx.split(_chunk_rows(C, B, 4))], dim=1)
    node_max = (best / norms).to(metric.dtype)
    return node_max, node_idx


class Plan:
    """A merge/unmerge pair for one block input: which sources merge into which destinations.

    The index tensors are computed once per block call and serve every merged sub-layer.
    ``merge`` is one row gather (``[kept | dst]``), one gather of the merged sources and one
    ``index_add_``, then a scale of the destinations by ``1 / count``; ``unmerge`` is one row
    gather. Indices are flattened over the batch so every copy is a contiguous row copy.
    """

    def __init__(self, metric: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                 r: int, match: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None):
        B, N, _ = metric.shape
        dev = metric.device
        src_idx = src_idx.to(dev)
        dst_idx = dst_idx.to(dev)
        num_dst = dst_idx.numel()
        r = min(r, src_idx.numel())
        with torch.no_grad():
            if match is None:
                node_max, node_idx = global_match(metric, src_idx, dst_idx)
            else:
                node_max, node_idx = match(metric, src_idx, dst_idx)
            order = node_max.argsort(dim=-1, descending=True)
            merged, kept = order[:, :r], order[:, r:]
            self.dst_of_merged = node_idx.gather(1, merged)              # [B, r] in 0..num_dst
            self.merged_idx = src_idx[merged]                            # [B, r] token ids
            self.kept_idx = src_idx[kept]                                # [B, n_kept] token ids
            self.dst_idx = dst_idx                                       # [num_dst] token ids
            n_kept = self.kept_idx.shape[1]
            M = n_kept + num_dst
            base = torch.arange(B, device=dev)[:, None]
            # Rows of x (flattened over the batch) that make the merged sequence [kept | dst].
            self.gather_rows = torch.cat([self.kept_idx, dst_idx.expand(B, num_dst)], 1) \
                .add_(base * N).reshape(-1)
            self.src_rows = self.merged_idx.add(base * N).reshape(-1)
            self.add_rows = self.dst_of_merged.add(base * M + n_kept).reshape(-1)
            count = torch.ones(B * M, device=dev).index_add_(
                0, self.add_rows, torch.ones(B * r, device=dev))
            self.count = count.view(B, M, 1)[:, n_kept:]
            # Position of every original token in the merged sequence [kept | dst].
            inverse = torch.empty(B, N, dtype=torch.long, device=dev)
            inverse.scatter_(1, self.kept_idx, torch.arange(n_kept, device=dev).expand(B, n_kept))
            inverse[:, dst_idx] = torch.arange(n_kept, M, device=dev)
            inverse.scatter_(1, self.merged_idx, self.dst_of_merged + n_kept)
            self.inverse_rows = inverse.add_(base * M).reshape(-1)
        self.r, self.num_tokens, self.n_kept, self.size = r, N, n_kept, M

    def merge(self, x: torch.Tensor, mode: str = "mean") -> torch.Tensor:
        B, N, C = x.shape
        if mode not in ("mean", "sum"):  # other reductions: the general path
            return self._merge_reduce(x, mode)
        flat = x.reshape(B * N, C)
        out = flat.index_select(0, self.gather_rows)
        out.index_add_(0, self.add_rows, flat.index_select(0, self.src_rows))
        out = out.view(B, self.size, C)
        if mode == "mean":
            out[:, self.n_kept:].div_(self.count.to(x.dtype))
        return out

    def _merge_reduce(self, x: torch.Tensor, mode: str) -> torch.Tensor:
        B, _, C = x.shape
        kept = x.gather(1, self.kept_idx[..., None].expand(B, -1, C))
        src = x.gather(1, self.merged_idx[..., None].expand(B, -1, C))
        dst = x[:, self.dst_idx].scatter_reduce(
            1, self.dst_of_merged[..., None].expand(B, -1, C), src, reduce=mode)
        return torch.cat([kept, dst], dim=1)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        B, M, C = x.shape
        return x.reshape(B * M, C).index_select(0, self.inverse_rows).view(B, self.num_tokens, C)


def bipartite_soft_matching_random2d(metric: torch.Tensor, w: int, h: int, sx: int, sy: int,
                                     r: int, no_rand: bool = False,
                                     generator: torch.Generator | None = None,
                                     matching: str = "global"
                                     ) -> tuple[Callable[..., torch.Tensor], Fn]:
    """tomesd's function, same signature and results: ``(merge, unmerge)`` for ``metric``.

    Kept so the two implementations can be compared directly (tests, benchmark).
    ``matching="local"`` uses ``local_match`` instead (not tomesd's result).
    """
    if r <= 0:
        return do_nothing, do_nothing
    if not no_rand and generator is None:
        raise ValueError("random destinations need a generator (or no_rand=True)")
    cells = None if no_rand else random_cells(h, w, sx, sy, generator)
    src_idx, dst_idx = partition(h, w, sx, sy, cells, metric.device)
    plan = Plan(metric, src_idx, dst_idx, r, matcher(matching, h, w, sx, sy))
    return plan.merge, plan.unmerge


def matcher(matching: str, h: int, w: int, sx: int, sy: int):
    """The match function for a ``ToMeConfig.matching`` value (None: global)."""
    if matching == "global":
        return None
    if matching == "local":
        return lambda m, s, d: local_match(m, h, w, sx, sy, s, d)
    raise ValueError(f"ToMe: unknown matching {matching!r}")


def grid_size(tokens: int, height: int, width: int) -> tuple[int, int, int]:
    """The ``(downsample, h, w)`` of a block seeing ``tokens`` tokens of a ``height x width``
    latent.

    ``ceil`` mirrors the UNet's stride-2 convolutions with padding, so odd sizes work.
    """
    downsample = math.ceil(math.sqrt(height * width // tokens))
    return downsample, math.ceil(height / downsample), math.ceil(width / downsample)


def downsample_tokens(x: torch.Tensor, h: int, w: int, factor: int,
                      mode: str = "nearest") -> torch.Tensor:
    """Token downsampling (ToDo, Smith et al. 2024): pool the ``h x w`` grid of ``x`` by ``factor``.

    Used for the keys and values of self-attention; queries keep every token, so no unmerge
    is needed. ``nearest`` is nearest-exact sampling, as in the reference implementation (a
    strided view when ``factor`` divides the grid, so it costs one copy); ``avg`` averages each
    ``factor x factor`` window.
    """
    if factor <= 1:
        return x
    B, _, C = x.shape
    if mode == "nearest" and h % factor == 0 and w % factor == 0:
        o = factor // 2  # nearest-exact picks floor((i + 0.5) * factor) = i * factor + o
        return x.view(B, h, w, C)[:, o::factor, o::factor].reshape(B, -1, C)
    grid = x.transpose(1, 2).reshape(B, C, h, w)
    size = (max(1, h // factor), max(1, w // factor))
    if mode == "avg":
        return F.adaptive_avg_pool2d(grid, size).flatten(2).transpose(1, 2)
    if mode != "nearest":
        raise ValueError(f"ToMe: unknown downsample mode {mode!r}")
    return F.interpolate(grid, size=size, mode="nearest-exact").flatten(2).transpose(1, 2)
