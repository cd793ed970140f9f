"""``backend.utils``: padding a latent to whole patches (Neo pads with the edge's mirror; zeros
are enough here: the tokens and the grid are what matter)."""

import torch.nn.functional as F


def pad_to_patch_size(x, patch):
    pads = []
    for size, p in zip(reversed(x.shape[-len(patch):]), reversed(tuple(patch))):
        pads += [0, (-size) % p]
    return F.pad(x, pads)
