"""The algorithm: bipartite soft matching on a 2-D token grid, and token downsampling.

Pure tensor code with no knowledge of models, hosts or the WebUI.

ToMe for SD (Bolya & Hoffman 2023): the tokens of an ``h x w`` grid are split into
destinations (one per ``sy x sx`` cell) and sources (the rest). Each source finds its most
similar destination (cosine similarity of the block input); the ``r`` sources with the best
match are averaged into their destination. After the sub-layer runs on the reduced set, every
merged source copies its destination's output back ("unmerge").

Differences from tomesd's ``merge.py`` that do not change its results:
- matching never holds the whole ``(N - N/4) x N/4`` score matrix (chunked best match), so
  memory stays flat at large images;
- unmerge is one gather through a precomputed inverse index instead of three scatters;
- the partition is built once per grid and reused by every block at that level.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

Fn = Callable[[torch.Tensor], torch.Tensor]

# Source rows scored per chunk in global matching: chunk x num_dst floats per batch item.
CHUNK_ELEMENTS = 1 << 24


def do_nothing(x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
    return x


def random_cells(h: int, w: int, sx: int, sy: int, generator: torch.Generator) -> torch.Tensor:
    """One random destination per ``sy x sx`` cell: a ``(h // sy, w // sx)`` tensor in [0, sx*sy)."""
    return torch.randint(sx * sy, (h // sy, w // sx), generator=generator,
                         device=generator.device)


def partition(h: int, w: int, sx: int, sy: int, cells: torch.Tensor | None = None,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Split the raster-ordered tokens of an ``h x w`` grid into ``(src_idx, dst_idx)``.

    ``cells`` gives the chosen position inside each cell (row-major, from ``random_cells``);
    None picks the top-left token. Rows and columns left over when the stride does not divide
    the grid are always sources, as in tomesd.
    """
    hsy, wsx = h // sy, w // sx
    if cells is None:
        cells = torch.zeros(hsy, wsx, dtype=torch.long)
    cells = cells.to(device=device, dtype=torch.long)
    ys = torch.arange(hsy, device=device)[:, None] * sy + cells // sx
    xs = torch.arange(wsx, device=device)[None, :] * sx + cells % sx
    dst_idx = (ys * w + xs).reshape(-1)
    is_dst = torch.zeros(h * w, dtype=torch.bool, device=device)
    is_dst[dst_idx] = True
    src_idx = (~is_dst).nonzero().squeeze(1)
    return src_idx, dst_idx


def best_match(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of ``a`` [B, Na, C], the best cosine score and index among ``b`` [B, Nb, C].

    Scores are computed in chunks of source rows, so peak extra memory is bounded by
    ``CHUNK_ELEMENTS`` per batch item instead of ``Na * Nb``.
    """
    a = a / a.norm(dim=-1, keepdim=True)
    b = b / b.norm(dim=-1, keepdim=True)
    bt = b.transpose(-1, -2)
    chunk = max(1, CHUNK_ELEMENTS // max(1, b.shape[1]))
    if a.shape[1] <= chunk:
        return (a @ bt).max(dim=-1)
    maxes, idxs = zip(*((part @ bt).max(dim=-1) for part in a.split(chunk, dim=1)))
    return torch.cat(maxes, dim=1), torch.cat(idxs, dim=1)


class Plan:
    """A merge/unmerge pair for one block input: which sources merge into which destinations.

    Index tensors are computed once; ``merge`` costs three gathers and one scatter-reduce,
    ``unmerge`` a single gather.
    """

    def __init__(self, metric: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                 r: int):
        B, N, _ = metric.shape
        src_idx = src_idx.to(metric.device)
        dst_idx = dst_idx.to(metric.device)
        num_dst = dst_idx.numel()
        r = min(r, src_idx.numel())
        with torch.no_grad():
            node_max, node_idx = best_match(metric[:, src_idx], metric[:, dst_idx])
            order = node_max.argsort(dim=-1, descending=True)
            merged, kept = order[:, :r], order[:, r:]
            self.dst_of_merged = node_idx.gather(1, merged)              # [B, r] in 0..num_dst
            self.merged_idx = src_idx[merged]                            # [B, r] token ids
            self.kept_idx = src_idx[kept]                                # [B, n_kept] token ids
            self.dst_idx = dst_idx                                       # [num_dst] token ids
            n_kept = self.kept_idx.shape[1]
            # Position of every original token in the merged sequence [kept | dst].
            inverse = torch.empty(B, N, dtype=torch.long, device=metric.device)
            inverse.scatter_(1, self.kept_idx, torch.arange(n_kept, device=metric.device)
                             .expand(B, n_kept))
            inverse[:, dst_idx] = torch.arange(n_kept, n_kept + num_dst, device=metric.device)
            inverse.scatter_(1, self.merged_idx, self.dst_of_merged + n_kept)
            self.inverse = inverse
        self.r, self.num_tokens = r, N

    def merge(self, x: torch.Tensor, mode: str = "mean") -> torch.Tensor:
        B, _, C = x.shape
        kept = x.gather(1, self.kept_idx[..., None].expand(B, -1, C))
        src = x.gather(1, self.merged_idx[..., None].expand(B, -1, C))
        dst = x[:, self.dst_idx].scatter_reduce(
            1, self.dst_of_merged[..., None].expand(B, -1, C), src, reduce=mode)
        return torch.cat([kept, dst], dim=1)

    def unmerge(self, x: torch.Tensor) -> torch.Tensor:
        B, _, C = x.shape
        return x.gather(1, self.inverse[..., None].expand(B, -1, C))


def bipartite_soft_matching_random2d(metric: torch.Tensor, w: int, h: int, sx: int, sy: int,
                                     r: int, no_rand: bool = False,
                                     generator: torch.Generator | None = None
                                     ) -> tuple[Callable[..., torch.Tensor], Fn]:
    """tomesd's function, same signature and results: ``(merge, unmerge)`` for ``metric``.

    Kept so the two implementations can be compared directly (tests, benchmark).
    """
    if r <= 0:
        return do_nothing, do_nothing
    if not no_rand and generator is None:
        raise ValueError("random destinations need a generator (or no_rand=True)")
    cells = None if no_rand else random_cells(h, w, sx, sy, generator)
    src_idx, dst_idx = partition(h, w, sx, sy, cells, metric.device)
    plan = Plan(metric, src_idx, dst_idx, r)
    return plan.merge, plan.unmerge


def grid_size(tokens: int, height: int, width: int) -> tuple[int, int, int]:
    """The ``(downsample, h, w)`` of a block seeing ``tokens`` tokens of a ``height x width`` latent.

    ``ceil`` mirrors the UNet's stride-2 convolutions with padding, so odd sizes work.
    """
    downsample = int(math.ceil(math.sqrt(height * width // tokens)))
    return downsample, int(math.ceil(height / downsample)), int(math.ceil(width / downsample))


def downsample_tokens(x: torch.Tensor, h: int, w: int, factor: int) -> torch.Tensor:
    """Token downsampling (ToDo, Smith et al. 2024): pool the ``h x w`` grid of ``x`` by ``factor``.

    Used for the keys and values of self-attention; queries keep every token, so no unmerge
    is needed. Nearest-exact sampling, as in the reference implementation.
    """
    if factor <= 1:
        return x
    B, N, C = x.shape
    grid = x.transpose(1, 2).reshape(B, C, h, w)
    size = (max(1, h // factor), max(1, w // factor))
    return F.interpolate(grid, size=size, mode="nearest-exact").flatten(2).transpose(1, 2)
