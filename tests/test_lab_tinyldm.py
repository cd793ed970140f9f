"""The shipped tiny diffusion model: loads offline, samples deterministically, scores data."""

from __future__ import annotations

import socket

import pytest
import torch

from tome_lab import tinyldm
from tome_lab.tinyldm import data


@pytest.fixture(scope="module")
def model():
    return tinyldm.load_model()


def test_loads_shipped_weights_without_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load_model tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    m = tinyldm.load_model()
    assert tinyldm.DEFAULT_WEIGHTS.stat().st_size <= 20 * 2**20
    assert int(m.metadata["steps"]) > 0
    assert all(p.dtype == torch.float32 for p in m.parameters())
    unet = m.model.diffusion_model  # where Stable Diffusion patchers look for the UNet
    blocks = [b for b in unet.modules() if type(b).__name__ == "BasicTransformerBlock"]
    assert blocks and not any(b.checkpoint for b in blocks)


def test_top_level_attends_over_4096_tokens(model):
    seen = []
    block = next(b for b in model.modules() if type(b).__name__ == "BasicTransformerBlock")
    handle = block.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape))
    try:
        model(torch.zeros(1, 3, 64, 64), torch.tensor([10]), torch.tensor([0]))
    finally:
        handle.remove()
    assert seen[0][1] == 64 * 64


def test_sampling_is_deterministic_and_leaves_global_rng_alone(model):
    state = torch.get_rng_state()
    a = tinyldm.sample(model, [0, 3], seed=7, steps=4)
    b = tinyldm.sample(model, [0, 3], seed=7, steps=4)
    assert torch.equal(state, torch.get_rng_state())
    assert a.shape == (2, 3, 64, 64)
    assert torch.equal(a, b)
    assert 0 <= a.min() and a.max() <= 1
    c = tinyldm.sample(model, [0], seed=8, steps=4)
    assert not torch.equal(a[:1], c)


def test_denoising_loss_is_finite_and_repeatable(model):
    g = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, 64, 64, generator=g)
    ids, t = torch.tensor([0, 1, 2, 3]), torch.tensor([50, 300, 600, 900])
    a = tinyldm.denoising_loss(model, images, ids, t, seed=1)
    assert torch.isfinite(a) and a.ndim == 0
    assert torch.equal(a, tinyldm.denoising_loss(model, images, ids, t, seed=1))


def test_heldout_photos_are_denoised_well(model):
    """Needs the Debian packages (downloaded once into the cache); skipped without them."""
    try:
        images, ids = data.heldout_batch(8)
    except (RuntimeError, OSError) as e:
        pytest.skip(f"photo packages unavailable: {e}")
    assert images.shape == (8, 3, 64, 64) and set(ids.tolist()) <= {0, 1, 2, 3}
    t = torch.linspace(20, 980, 8).long()
    loss = tinyldm.denoising_loss(model, images, ids, t, seed=0)
    assert torch.isfinite(loss)
    assert loss < 0.2  # an untrained model scores about 1.0
