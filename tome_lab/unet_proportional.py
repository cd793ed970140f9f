"""Would proportional attention help ToMe's merging on a UNet? (issue 34, item 4; measured,
not shipped: docs/quality.md#proportional-attention-on-a-unet)

ToMe's paper adds ``log(size)`` to the logits of a merged token (the tokens it stands for) in
ViTs; tomesd does not. Here the tiny UNet's self-attention gets that bias while it runs on a
merged sequence (``[kept | destinations]``, sizes from the merge plan), through a lab-only
replacement of its attention forward, and the images are compared with plain merging at the
same ratios and on the same seeds.

    python -m tome_lab.unet_proportional       # ~3 min on one thread
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F

from tome import merge

from . import quality
from .settings import parse_settings

SETTINGS = ("unmerged", "merge:0.5", "merge:0.75")


@contextlib.contextmanager
def proportional():
    """Merged self-attention with ``log(size)`` on each merged key, for the duration."""
    from .tinyldm.model import SDPACrossAttention
    last: list = [None]
    merge_fn, forward = merge.Plan.merge, SDPACrossAttention.forward

    def recording(self, x, mode="mean"):
        last[0] = self
        return merge_fn(self, x, mode)

    def biased(self, x, context=None, mask=None):
        plan = last[0]
        if context is not None or mask is not None or plan is None or x.shape[1] != plan.size:
            return forward(self, x, context, mask)
        b, n, _ = x.shape
        sizes = torch.cat([x.new_ones(plan.batch, plan.n_kept),
                           plan.inv_count.reciprocal().view(plan.batch, -1).to(x.dtype)], 1)
        bias = sizes.log().repeat_interleave(b // plan.batch, 0).view(b, 1, 1, n)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2)
                   for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))

    merge.Plan.merge, SDPACrossAttention.forward = recording, biased
    try:
        yield
    finally:
        merge.Plan.merge, SDPACrossAttention.forward = merge_fn, forward


def main(argv: list[str] | None = None) -> int:
    from .tinyldm.model import load_model
    torch.set_num_threads(1)
    model = load_model()
    images = [(c, s + c) for s in (0, 4) for c in range(4)]
    heldout, _ = quality.heldout_batch(8, 64)
    settings = parse_settings(SETTINGS)
    plain = quality.evaluate(model, settings, images, heldout=heldout)
    with proportional():
        prop = quality.evaluate(model, settings, images, heldout=heldout)
    print("| setting | plain: speed-up, PSNR, loss Δ | proportional: speed-up, PSNR, loss Δ |")
    print("|---|---|---|")
    for a, b in zip(plain[1:], prop[1:]):
        cells = [f"{r['speedup']:.2f}x, {r['psnr']:.1f} dB" + (
            f", {sum(r['loss_increase'].values()) / len(r['loss_increase']):+.2%}"
            if "loss_increase" in r else "") for r in (a, b)]
        print(f"| {a['setting']} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
