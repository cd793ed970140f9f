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
- merge is deterministic on every device (no ``scatter_reduce``, no atomics): a row gather plus
  a fixed-point sorted segment sum; unmerge is one row gather through an inverse index;
- a plan can be built once per UNet level and call and reused by every block at that level;
- random destinations can come from a counter-based hash of ``(seed, timestep, cell)``
  computed on the device (``hashed_cells``), so nothing is read back to the host.

``local_match`` is the fast variant: a source only looks at the destinations of the 3 x 3
cells around its own, which is ``9`` dot products per source instead of ``N / (sx*sy)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .graphs import compiling

Fn = Callable[[torch.Tensor], torch.Tensor]

# Byte budget of one chunk of scores (global) or of candidate features (local), whole batch:
# cache-sized on CPUs; on accelerators large enough that up to ~1536 px takes one chunk.
CHUNK_BYTES = 32 << 20
DEVICE_CHUNK_BYTES = 1 << 30
_OFFSETS = [(di, dj) for di in (-1, 0, 1) for dj in (-1, 0, 1)]


def do_nothing(x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
    return x


def random_cells(h: int, w: int, sx: int, sy: int, generator: torch.Generator) -> torch.Tensor:
    """One random destination per ``sy x sx`` cell from a ``torch.Generator`` (tomesd's way):
    a ``(h // sy, w // sx)`` tensor in [0, sx*sy)."""
    return torch.randint(sx * sy, (h // sy, w // sx), generator=generator,
                         device=generator.device)


_M32 = 0xFFFFFFFF


def _hash32(z: torch.Tensor | int) -> torch.Tensor | int:
    """A 32-bit integer hash (lowbias32's shape, with multipliers below 2**31 so int64 tensor
    arithmetic never overflows): the same bits on CPU, CUDA and MPS, for tensors and ints."""
    z = z & _M32
    z = ((z ^ (z >> 16)) * 0x7FEB352D) & _M32
    z = ((z ^ (z >> 15)) * 0x2C1B3C6D) & _M32
    return z ^ (z >> 16)


def hashed_cells(h: int, w: int, sx: int, sy: int, key: int,
                 timestep: torch.Tensor | float | None, device: torch.device | str
                 ) -> torch.Tensor:
    """One pseudo-random destination per ``sy x sx`` cell, a pure function of
    ``(key, timestep, cell)`` computed where the tokens live.

    ``timestep`` may be a device tensor (its first value is used): it is never read on the
    host, so there is no device sync and a compiled graph does not depend on its value.
    Counter-based, like Philox: no generator state, identical on every device.
    """
    hsy, wsx = h // sy, w // sx
    seed = _hash32(key)
    if isinstance(timestep, torch.Tensor):
        t = (timestep.reshape(-1)[:1].to(device=device, dtype=torch.float32) * 1000).round()
        seed = (t.to(torch.int64) * 0x2C1B3C6D + seed) & _M32
    elif timestep is not None:
        seed = (round(float(timestep) * 1000) * 0x2C1B3C6D + seed) & _M32
    cell = torch.arange(hsy * wsx, device=device, dtype=torch.int64)
    return (_hash32(cell + seed) % (sx * sy)).view(hsy, wsx)


def partition(h: int, w: int, sx: int, sy: int, cells: torch.Tensor | None = None,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the raster-ordered tokens of an ``h x w`` grid into ``(src_idx, dst_idx)``.

    ``cells`` gives the chosen position inside each cell (row-major, from ``random_cells`` or
    ``hashed_cells``); None picks the top-left token. Rows and columns left over when the
    stride does not divide the grid are always sources, as in tomesd. Both index lists come in
    exactly tomesd's order (its argsort of a -1/0 buffer is not stable), so ties between equal
    scores, which are common in bf16, are broken as tomesd breaks them.
    """
    hsy, wsx = h // sy, w // sx
    device = device if device is not None else (cells.device if cells is not None else "cpu")
    if cells is None:
        cells = torch.zeros(hsy, wsx, dtype=torch.long, device=device)
    cells = cells.to(device=device, dtype=torch.long)
    view = torch.zeros(hsy, wsx, sy * sx, dtype=torch.long, device=device)
    view.scatter_(2, cells[..., None], -1)
    view = view.view(hsy, wsx, sy, sx).transpose(1, 2).reshape(hsy * sy, wsx * sx)
    if hsy * sy < h or wsx * sx < w:
        view = F.pad(view, (0, w - wsx * sx, 0, h - hsy * sy))
    order = view.reshape(1, -1, 1).argsort(dim=1)[0, :, 0]
    num_dst = hsy * wsx
    return order[num_dst:], order[:num_dst]


def cell_of(idx: torch.Tensor, w: int, sx: int, sy: int, hsy: int, wsx: int) -> torch.Tensor:
    """Row-major cell number of raster token ids (leftover rows/columns: the nearest cell)."""
    return (idx // w // sy).clamp(max=hsy - 1) * wsx + (idx % w // sx).clamp(max=wsx - 1)


_DEVICE_BUDGET: dict[str, int] = {}


def chunk_budget(device: torch.device) -> int:
    """Bytes one chunk may take: ``CHUNK_BYTES`` on CPUs; on CUDA an eighth of the memory free
    when the device is first used (read once per process, never inside a compiled graph),
    between ``CHUNK_BYTES`` and 4 GiB, so large images take few chunks where memory allows."""
    if device.type == "cpu":
        return CHUNK_BYTES
    key = str(device)
    if key not in _DEVICE_BUDGET and device.type == "cuda" \
            and not compiling():
        free, _ = torch.cuda.mem_get_info(device)
        _DEVICE_BUDGET[key] = int(min(max(free // 8, CHUNK_BYTES), 4 << 30))
    return _DEVICE_BUDGET.get(key, max(CHUNK_BYTES, DEVICE_CHUNK_BYTES))


def _chunk_rows(cols: int, batch: int, itemsize: int, device: torch.device) -> int:
    """Rows per chunk so that ``rows x cols`` values for the whole batch fit the budget."""
    return max(1, chunk_budget(device) // max(1, cols * batch * itemsize))


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
    chunk = _chunk_rows(b.shape[1] + C, B, max(metric.element_size(), 4), metric.device)
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
    # -inf for neighbours outside the grid; [hsy, wsx, 9] in _OFFSETS order (3x3 windows of
    # a padded grid, unfolded: views, not nine copies).
    bias = F.pad(torch.zeros(hsy, wsx, device=dev), (1, 1, 1, 1), value=-math.inf)
    bias = bias.unfold(0, 3, 1).unfold(1, 3, 1).reshape(hsy, wsx, 9)
    best = torch.empty(B, h, w, dtype=torch.float32, device=dev)
    arg = torch.empty(B, h, w, dtype=torch.long, device=dev)
    x = metric.view(B, h, w, C)
    hm, wm = hsy * sy, wsx * sx
    itemsize = max(metric.element_size(), 2)
    rows = max(1, chunk_budget(dev) // max(1, B * wsx * (S + 9) * C * itemsize))
    for i0 in range(0, hsy, rows):
        i1 = min(hsy, i0 + rows)
        n = i1 - i0
        # Tokens of these cells, cell-major: [B*n*wsx, S, C]
        xc = x[:, i0 * sy:i1 * sy, :wm].reshape(B, n, sy, wsx, sx, C).permute(0, 1, 3, 2, 4, 5)
        xc = xc.reshape(B * n * wsx, S, C)
        # The 9 neighbouring destinations of each cell: [B*n*wsx, C, 9]
        nb = grid[:, i0:i1 + 2].unfold(1, 3, 1).unfold(2, 3, 1).reshape(B * n * wsx, C, 9)
        sc = torch.bmm(xc, nb).view(B, n, wsx, S, 9).float() + bias[i0:i1, :, None]
        m, k = sc.max(dim=-1)                                     # [B, n, wsx, S]
        best[:, i0 * sy:i1 * sy, :wm] = m.view(B, n, wsx, sy, sx).permute(0, 1, 3, 2, 4) \
            .reshape(B, n * sy, wm)
        arg[:, i0 * sy:i1 * sy, :wm] = k.view(B, n, wsx, sy, sx).permute(0, 1, 3, 2, 4) \
            .reshape(B, n * sy, wm)
    if hm < h or wm < w:  # leftover rows / columns: the nearest cell's neighbourhood
        left = _leftovers(h, w, hm, wm, dev)
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
    di, dj = k // 3 - 1, k % 3 - 1  # _OFFSETS is row-major over (-1, 0, 1)^2
    node_idx = by_cell[(ci + di) * wsx + (cj + dj)]
    norms = torch.cat([metric[:, p].float().norm(dim=-1)  # chunked: no fp32 copy of all
                       for p in src_idx.split(_chunk_rows(C, B, 4, dev))], dim=1)
    node_max = (best / norms).to(metric.dtype)
    return node_max, node_idx


# Fixed-point scale of the merge sum: values are summed as int64 multiples of 2**-24, which is
# exact and independent of the summation order (bit-identical on every device and run), for
# |x| up to 2**39 / r: far beyond any activation a UNet produces.
SCALE = float(1 << 24)
_INT_SCAN: dict[str, bool] = {}


def exact_scan(device: torch.device) -> bool:
    """Whether ``device`` scans int64 (all but MPS before macOS 13.3, which then gets a float32
    scan: deterministic on one machine, no longer exact). Probed once per device."""
    if device.type != "mps":
        return True
    key = str(device)
    if key not in _INT_SCAN:
        try:
            torch.ones(2, dtype=torch.int64, device=device).cumsum(0)
            _INT_SCAN[key] = True
        except (RuntimeError, NotImplementedError):
            _INT_SCAN[key] = False
    return _INT_SCAN[key]


def _leftovers(h: int, w: int, hm: int, wm: int, device: torch.device) -> torch.Tensor:
    """Raster ids of the tokens outside the ``hm x wm`` stride-aligned corner, in raster order,
    built from shapes alone (no ``nonzero``: a fixed size, so compiled graphs do not break)."""
    right = (torch.arange(hm, device=device)[:, None] * w
             + torch.arange(wm, w, device=device)[None, :]).reshape(-1)
    below = torch.arange(hm * w, h * w, device=device)
    return torch.cat([right, below])


class Plan:
    """A merge/unmerge pair for one block input: which sources merge into which destinations.

    Built once (per block, or per UNet level and call when blocks share it) and applied to
    every merged sub-layer. Deterministic on every device, with no atomic accumulation:

    - ``merge`` gathers ``[kept | dst]`` in one row gather, then adds the merged sources as a
      sorted segment sum: the sources are gathered in destination order, summed with an int64
      prefix sum in fixed point (integer addition is associative, so the result does not depend
      on how a GPU schedules the scan), and each destination takes the difference of the prefix
      sum at its segment's two ends; a fused multiply-add then forms the mean.
    - ``unmerge`` is one row gather through the inverse index.

    Indices are flattened over the batch so every copy is a contiguous row copy.
    """

    def __init__(self, metric: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                 r: int, match: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None):
        B, N, _ = metric.shape
        dev = metric.device
        num_dst = dst_idx.numel()
        r = max(0, min(r, src_idx.numel()))
        with torch.no_grad():
            node_max, node_idx = (match or global_match)(metric, src_idx, dst_idx)
            order = node_max.argsort(dim=-1, descending=True)
            merged, kept = order[:, :r], order[:, r:]
            dst_of_merged = node_idx.gather(1, merged)                   # [B, r] in 0..num_dst
            merged_idx = src_idx[merged]                                 # [B, r] token ids
            kept_idx = src_idx[kept]                                     # [B, n_kept] token ids
            n_kept = kept_idx.shape[1]
            M = n_kept + num_dst
            base = torch.arange(B, device=dev)[:, None]
            # Rows of x (flattened over the batch) that make the merged sequence [kept | dst].
            self.gather_rows = torch.cat([kept_idx, dst_idx.expand(B, num_dst)], 1) \
                .add_(base * N).reshape(-1)
            # Merged sources in destination order, flattened over the batch, after one leading
            # row (any row: it cancels out). Destination k's sources are the rows (starts[k],
            # ends[k]] of that list, so its sum is prefix[ends[k]] - prefix[starts[k]].
            by_dst = dst_of_merged.argsort(dim=1, stable=True)
            keys = dst_of_merged.gather(1, by_dst).add_(base * num_dst).reshape(-1)
            sources = merged_idx.gather(1, by_dst).add_(base * N).reshape(-1)
            self.src_rows = torch.cat([sources[:1], sources])
            slots = torch.arange(B * num_dst, device=dev)
            self.ends = torch.searchsorted(keys, slots, right=True)
            self.starts = torch.searchsorted(keys, slots)
            count = (self.ends - self.starts + 1).to(torch.float32).view(B, num_dst, 1)
            self.inv_count = count.reciprocal()
            self.scale = SCALE if exact_scan(dev) else 1.0
            self.weight = self.inv_count / self.scale
            # Position of every original token in the merged sequence [kept | dst].
            inverse = torch.empty(B, N, dtype=torch.long, device=dev)
            inverse.scatter_(1, kept_idx, torch.arange(n_kept, device=dev).expand(B, n_kept))
            inverse[:, dst_idx] = torch.arange(n_kept, M, device=dev)
            inverse.scatter_(1, merged_idx, dst_of_merged + n_kept)
            self.inverse_rows = inverse.add_(base * M).reshape(-1)
        self.r, self.num_tokens, self.n_kept, self.size, self.batch = r, N, n_kept, M, B

    def merge(self, x: torch.Tensor, mode: str = "mean") -> torch.Tensor:
        """``[B, N, C] -> [B, N - r, C]``: kept sources, then destinations averaged with the
        sources merged into them (``mode="sum"``: summed)."""
        B, N, C = x.shape
        flat = x.reshape(B * N, C)
        out = flat.index_select(0, self.gather_rows).view(B, self.size, C)
        if self.r == 0:
            return out
        fixed = flat.index_select(0, self.src_rows).to(torch.float32)
        if self.scale != 1.0:
            fixed = fixed.mul_(self.scale).to(torch.int64)
        total = fixed.cumsum_(0)
        sums = total.index_select(0, self.ends) - total.index_select(0, self.starts)
        dst = out[:, self.n_kept:]
        if mode == "mean":
            dst.mul_(self.inv_count).addcmul_(sums.view(B, -1, C), self.weight)
        elif mode == "sum":
            dst.add_(sums.view(B, -1, C), alpha=1 / self.scale)
        else:
            raise ValueError(f"ToMe: unknown merge mode {mode!r}; use 'mean' or 'sum'")
        return out

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, N - r, C] -> [B, N, C]``: every merged source takes its destination's value."""
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
    Integer arithmetic only: inside a compiled graph the sizes are symbolic (a block's tokens
    and the call's grid), and each comparison of the search below is a guard that holds at
    every size of that block, where a float square root would pin the sizes.
    """
    quotient = height * width // tokens
    if compiling():
        downsample = 1
        while downsample * downsample < quotient:
            downsample += 1
    else:
        downsample = math.isqrt(quotient)
        downsample += downsample * downsample < quotient
    downsample = max(downsample, 1)
    return downsample, -(-height // downsample), -(-width // downsample)


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
