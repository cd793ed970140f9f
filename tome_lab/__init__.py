"""The lab: measuring what token merging does, beside the library it measures.

Nothing here is needed to use ``tome``; it needs the ``bench`` extras (ldm, diffusers, tomesd,
matplotlib, pillow, safetensors). One module per job:

- ``models``: SD1.5 / SD2 / SDXL UNets from their configs with random weights, their inputs,
  ldm attention through SDPA (as the WebUI runs it)
- ``device``: which device and dtype to run on, and why
- ``settings``: ``Setting``, one way of running a UNet (ours, tomesd, ceiling, match-only),
  parsed from a spec string and built on ``ToMeConfig``
- ``timing``: time, peak memory and FLOPs of one call on CPU, CUDA or MPS; torch.compile counters
- ``run``: the benchmark's interleaved run loop
- ``matching``: the matching step alone, ours vs tomesd
- ``sweep``: does the auto policy decide right (measured decisions against timed UNet calls)
- ``quality``: image metrics and the quality evaluation on the tiny model
- ``report``: tables, JSON, plots and the image grid
- ``bench``, ``showcase``, ``speed_demo``: the command lines (``make bench``, ``make demo``,
  ``make speed-demo``)
- ``tinyldm``: the small trained diffusion model the quality figures use
- ``tinydit``: the small trained DiT (Flux-like joint blocks) the DiT quality figures use
- ``tinyvdit``: the small trained video DiT (Wan, 32 px x 9 frames) the video figures use
- ``dit_bench``: Flux-, SD3-, Qwen-Image- and Wan-shaped transformers (``dit_shapes``: their
  configs, sizes and inputs) timed unpooled and pooled (``make bench-dit``);
  ``dit_bias_bench``: what the proportional-attention bias costs per kernel;
  ``video_quality``: pooling on the trained tiny video DiT (per frame, time-axis cells,
  reuse, step caches: PSNR/SSIM per frame, frame-to-frame difference, motion kept)
- ``dit_quality``: the DiT settings' fidelity on the tiny DiT (PSNR, held-out loss);
  ``dit_frontier``: the DiT presets' frontier (approach by approach, its plot and grid)
- ``unet_proportional``: proportional attention for UNet merging, measured (not shipped)
"""
