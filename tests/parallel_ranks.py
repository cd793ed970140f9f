"""One rank of a two-rank check under diffusers' context parallelism (run by ``torchrun
--nproc_per_node 2``; gloo on the CPU, where ``tests/test_parallel.py`` starts it, or NCCL on
GPUs): a random ``FluxTransformer2DModel`` called in one process, unpatched and pooled, then
under ``enable_parallelism``; rank 0 writes what it found as JSON to ``argv[1]``.

What it finds: the pooled output under Ulysses and Ring against the one-process pooled
output (the patch applied before or after ``enable_parallelism``), and after removal against
the unpatched one, with the bytes each rank sends per attention call and the seconds per
model call; the ValueError's message where a grid's cells straddle the shards (at the first
call) and where ``ulysses_anything`` is asked (at apply_patch). ``argv[2:8]`` (measuring):
the grid's rows and columns, rounds, heads, head dim, text tokens (default: 8x8 tokens, one
round, 4 heads of 8, 8 text tokens); ``argv[8]`` ``straddle``: only the grid given, whose
rows per rank must straddle cells, pooled after the all-to-all."""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist

import tome

HEADS, DIM, TEXT = 4, 8, 8
DEVICE = "cpu"  # a rank's GPU where there is one (NCCL), else the CPU (gloo)


class Wire:
    """Bytes this rank sends in collectives inside the model's attention modules (funcol's
    all_to_all_single and all_gather_tensor, torch.distributed's all_gather), per kind: an
    all-to-all sends all but its own part, a gather its whole tensor."""

    def __init__(self):
        self.sent: dict[str, int] = {}
        self.on = False

    def wrap(self, owner, name):
        original = getattr(owner, name)

        def counted(x, *args, **kwargs):
            t = x if isinstance(x, torch.Tensor) else args[0]
            if self.on:
                n = t.numel() * t.element_size()
                if name == "all_to_all_single":
                    n -= n // dist.get_world_size()
                self.sent[name] = self.sent.get(name, 0) + n
            return original(x, *args, **kwargs)
        setattr(owner, name, counted)

    def attach(self, m):
        """Count inside ``m``'s attention modules only (not the output's gather)."""
        for name, sub in m.named_modules():
            if name.endswith(".attn"):
                sub.register_forward_pre_hook(lambda *a: setattr(self, "on", True))
                sub.register_forward_hook(lambda *a: setattr(self, "on", False))
        return m


def lse_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
           enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """A stand-in for an attention kernel that returns the log-sum-exp Ring merges with
    (flash-attn's, cuDNN's on a GPU; diffusers' native CPU op returns none): attention
    written out, ``[B, S, H, D]`` in and out, the LSE as ``[B, S, H]``."""
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    s = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
    if attn_mask is not None:
        s = s + attn_mask
    lse = s.logsumexp(-1)
    out = ((s - lse[..., None]).exp() @ v).permute(0, 2, 1, 3)
    return (out, lse.permute(0, 2, 1)) if return_lse else out


def model():
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1,
                                  num_single_layers=1, attention_head_dim=DIM,
                                  num_attention_heads=HEADS, joint_attention_dim=16,
                                  pooled_projection_dim=8,
                                  axes_dims_rope=(DIM // 4, DIM // 4, DIM // 2)).eval().to(DEVICE)


def inputs(h: int, w: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(h * w, 3)
    ids[:, 1] = torch.arange(h).repeat_interleave(w)
    ids[:, 2] = torch.arange(w).repeat(h)
    kw = {"hidden_states": torch.randn(1, h * w, 8, generator=g),
          "encoder_hidden_states": torch.randn(1, TEXT, 16, generator=g),
          "pooled_projections": torch.randn(1, 8, generator=g),
          "timestep": torch.tensor([0.5]), "img_ids": ids, "txt_ids": torch.zeros(TEXT, 3)}
    return {**{k: v.to(DEVICE) for k, v in kw.items()}, "return_dict": False}


def run(m, kw, wire=None, rounds=1):
    with torch.no_grad():
        if wire is not None:
            wire.sent = {}
        t0 = time.perf_counter()
        for _ in range(rounds):
            out = m(**kw)[0]
        if DEVICE != "cpu":
            torch.cuda.synchronize()
        took = (time.perf_counter() - t0) / rounds
    return out, took


def parallel(m, **cp):
    from diffusers import ContextParallelConfig
    m.enable_parallelism(config=ContextParallelConfig(**cp))
    return m


POOL = {"method": "downsample", "downsample_factor": 2, "proportional": True, "measure": False}


def degrees(found: dict, h: int, w: int, wire: Wire, rounds: int) -> None:
    """Ulysses (diffusers' native kernel) and Ring (``lse_op`` standing in for a kernel with
    a log-sum-exp) against the one-process outputs: pooled, then after removal."""
    from diffusers.models import attention_dispatch
    kw = inputs(h, w)
    whole, _ = run(model(), kw)
    pooled, _ = run(tome.apply_patch(model(), **POOL), kw)
    found["pooling"] = (pooled - whole).abs().max().item()
    calls = 2  # a double-stream and a single-stream block: two attention calls per model call
    for name, cp in (("ulysses", {"ulysses_degree": 2}), ("ring", {"ring_degree": 2})):
        if name == "ring":
            attention_dispatch._native_attention_forward_op = lse_op
        for order in ("patch first", "parallel first"):
            m = wire.attach(model())
            if order == "patch first":
                m = parallel(tome.apply_patch(m, **POOL), **cp)
            else:
                m = tome.apply_patch(parallel(m, **cp), **POOL)
            for state, ref in (("pooled", pooled), ("removed", whole)):
                out, took = run(m, kw, wire, rounds)
                found[f"{name}, {order}, {state}"] = {
                    "error": (out - ref).abs().max().item(), "s": took,
                    "bytes": {k: v // rounds // calls for k, v in wire.sent.items()}}
                tome.remove_patch(m)


def video_and_qwen(found: dict) -> None:
    """Wan (a 4-frame video: two whole frames per rank; the text is not split) and
    Qwen-Image (its text split, its RoPE split after ``pos_embed``) under Ulysses, patched
    after ``enable_parallelism``: the pooled output against the one-process pooled one."""
    import diffusers
    from models import randomised

    def wan():
        return randomised(diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=64), 0.5)

    def qwen():
        return randomised(diffusers.QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(4, 6, 6)), 0.5)

    g = torch.Generator().manual_seed(2)
    cases = {  # wan3: 3 frames, a frame split between the ranks (pooled after the all-to-all)
        name: (wan, {"hidden_states": torch.randn(1, 4, frames, 16, 24, generator=g),
                     "timestep": torch.full((1,), 700.0),
                     "encoder_hidden_states": torch.randn(1, 7, 16, generator=g)})
        for name, frames in (("wan", 4), ("wan3", 3))}
    cases["qwen"] = (qwen, {"hidden_states": torch.randn(1, 96, 16, generator=g),
                            "encoder_hidden_states": torch.randn(1, 6, 24, generator=g),
                            "timestep": torch.full((1,), 0.7), "img_shapes": [[(1, 8, 12)]]})
    for name, (build, kw) in cases.items():
        kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
        kw["return_dict"] = False
        whole, _ = run(build().to(DEVICE), kw)
        pooled, _ = run(tome.apply_patch(build().to(DEVICE), **POOL), kw)
        m = tome.apply_patch(parallel(build().to(DEVICE), ulysses_degree=2), **POOL)
        out, _ = run(m, kw)
        found[name] = {"pooling": (pooled - whole).abs().max().item(),
                       "error": (out - pooled).abs().max().item()}
    try:  # Qwen-Image's maths pool by themselves: cells across the shards refused
        m = tome.apply_patch(parallel(qwen().to(DEVICE), ulysses_degree=2), **POOL)
        run(m, {"hidden_states": torch.randn(1, 72, 16).to(DEVICE), "return_dict": False,
                "encoder_hidden_states": torch.randn(1, 6, 24).to(DEVICE),
                "timestep": torch.full((1,), 0.7).to(DEVICE), "img_shapes": [[(1, 6, 12)]]})
        found["qwen across"] = None
    except ValueError as e:
        found["qwen across"] = str(e)


def straddle(found: dict, wire: Wire, h: int = 6, w: int = 4, rounds: int = 1) -> None:
    """``h`` rows in two shards (6: shards of 3 rows; 2x2 cells straddle them): under Ulysses
    pooled after the all-to-all, against the one-process pooled output, with the bytes and
    seconds (unpooled: after removal); under Ring refused."""
    kw = inputs(h, w)
    pooled, _ = run(tome.apply_patch(model(), **POOL), kw)
    m = tome.apply_patch(parallel(wire.attach(model()), ulysses_degree=2), **POOL)
    for state in ("pooled", "removed"):
        out, took = run(m, kw, wire, rounds)
        found[f"straddle, ulysses, {state}"] = {
            "error": (out - pooled).abs().max().item(), "s": took,
            "bytes": {k: v // rounds // 2 for k, v in wire.sent.items()}}
        tome.remove_patch(m)
    try:
        run(tome.apply_patch(parallel(model(), ring_degree=2), **POOL), kw)
        found["straddle, ring"] = None
    except ValueError as e:
        found["straddle, ring"] = str(e)


def refused() -> str | None:
    """The ValueError's message where ``ulysses_anything`` is asked, or None."""
    try:
        tome.apply_patch(parallel(model(), ulysses_degree=2, ulysses_anything=True), **POOL)
    except ValueError as e:
        return str(e)
    return None


def main() -> None:
    global HEADS, DIM, TEXT, DEVICE
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        DEVICE = f"cuda:{dist.get_rank() % torch.cuda.device_count()}"
        torch.cuda.set_device(DEVICE)
    else:  # enable_parallelism takes its device from the accelerator: "cpu" here, with a
        # count of 0 (``rank % device_count()``): the ranks share the CPU as one device
        torch.accelerator.device_count = lambda: 1
    import torch.distributed._functional_collectives as funcol
    wire = Wire()
    for owner, name in ((funcol, "all_to_all_single"), (funcol, "all_gather_tensor"),
                        (dist, "all_gather"), (dist, "all_to_all_single")):
        wire.wrap(owner, name)
    found: dict = {}
    h, w, rounds = 8, 8, 1
    if len(sys.argv) > 2:  # measuring (docs/speed.md): grid, rounds, heads, head dim, text
        h, w, rounds, HEADS, DIM, TEXT = (int(x) for x in sys.argv[2:8])
    if sys.argv[8:] == ["straddle"]:  # measuring the pooled-after-the-all-to-all path only
        straddle(found, wire, h, w, rounds)
    else:
        degrees(found, h, w, wire, rounds)
        video_and_qwen(found)
        straddle(found, wire)
    found["anything"] = refused()
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(found, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
