"""Which device and dtype the lab runs on, why, and what the machine is.

``pick_device("auto")`` takes CUDA, then MPS, then the CPU. ``pick_dtype`` takes fp16 on GPUs
and, on a CPU, bf16 only where the CPU computes it natively (AMX or AVX512-BF16; elsewhere a
short timed matmul decides): without it bf16 is emulated and many times slower than fp32 (about
90x for the tiny model's convolutions on an AVX2 core). An explicit dtype always wins. Both
return the reason, so tools can print one line saying what was chosen and why.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import time

import torch

from .models import DTYPES

DEVICES = ("auto", "cpu", "cuda", "mps")
X86 = ("x86_64", "amd64", "i386", "i686", "x86")


def mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def pick_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA if available, else MPS, else the CPU. A named device that is not
    available raises ``ValueError`` (instead of silently measuring something else)."""
    name = (name or "auto").lower()
    if name not in DEVICES and not name.startswith("cuda:"):
        raise ValueError(f"unknown device {name!r}; choose from {', '.join(DEVICES)}")
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps") if mps_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device (torch.cuda.is_available() is False)")
    if name == "mps" and not mps_available():
        raise ValueError("--device mps: no MPS device (torch.backends.mps.is_available() is "
                         "False)")
    return torch.device(name)


def _cpu_flag(name: str) -> bool | None:
    """A ``torch.cpu._is_*_supported()`` flag, or None where this torch has no such check."""
    fn = getattr(torch.cpu, name, None)
    if fn is None:
        return None
    try:
        return bool(fn())
    except Exception:  # noqa: BLE001 - a failing probe means "unknown", not a crash
        return None


def cpu_capability() -> str:
    """PyTorch's CPU kernel level: "AVX2", "AVX512", "DEFAULT", "SVE256", ..."""
    with contextlib.suppress(Exception):
        return str(torch.backends.cpu.get_cpu_capability())
    return "unknown"


def matmul_probe(n: int = 512, repeats: int = 3) -> tuple[float, float]:
    """Best-of-``repeats`` seconds of an ``n x n`` matmul in fp32 and in bf16 on the CPU."""
    def best(dtype: torch.dtype) -> float:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(dtype)
        b = torch.randn(n, n, generator=g).to(dtype)
        a @ b  # first call: allocation, kernel selection
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    return best(torch.float32), best(torch.bfloat16)


#: bf16 is used on a CPU without a known native path only if a matmul in it takes at most this
#: much longer than in fp32 (native bf16 is usually faster; emulated, 10x to 100x slower).
PROBE_TOLERANCE = 1.25


@functools.lru_cache(maxsize=1)
def cpu_bf16() -> tuple[bool, str]:
    """(whether bf16 is native on this CPU, why). x86: AMX or AVX512-BF16 from PyTorch's CPU
    checks. Elsewhere (ARM, or a torch without those checks): a short timed matmul."""
    cap = cpu_capability()
    amx, avx512_bf16 = _cpu_flag("_is_amx_tile_supported"), _cpu_flag("_is_avx512_bf16_supported")
    if amx:
        return True, f"CPU has AMX ({cap})"
    if avx512_bf16:
        return True, f"CPU has AVX512-BF16 ({cap})"
    if platform.machine().lower() in X86 and amx is False and avx512_bf16 is False:
        return False, f"CPU capability {cap}, no AVX512-BF16 or AMX: bf16 would be emulated"
    t32, t16 = matmul_probe()
    ratio = t16 / max(t32, 1e-9)
    return (ratio <= PROBE_TOLERANCE,
            f"CPU capability {cap}: a 512x512 matmul takes {ratio:.2g}x as long in bf16 as in "
            "fp32")


def pick_dtype(device: torch.device | str, requested: str | None = "auto") -> tuple[str, str]:
    """(dtype name, one-line reason). ``requested`` (fp32/bf16/fp16) wins when given."""
    if requested and requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; choose from {', '.join(DTYPES)}")
        return requested, f"dtype {requested}: as requested"
    kind = torch.device(device).type
    if kind in ("cuda", "mps"):
        return "fp16", f"dtype fp16: the default on {kind.upper()} (as the WebUI runs)"
    native, why = cpu_bf16()
    if native:
        return "bf16", f"dtype bf16: {why}"
    return "fp32", f"dtype fp32: {why} (--dtype bf16 to force it)"


def device_name(device: torch.device | str) -> str:
    """The accelerator's or the CPU's name, with what matters for speed."""
    device = torch.device(device)
    if device.type == "cuda":
        i = device.index if device.index is not None else torch.cuda.current_device()
        p = torch.cuda.get_device_properties(i)
        major, minor = torch.cuda.get_device_capability(i)
        runtime = (f"CUDA {torch.version.cuda}" if torch.version.cuda
                   else f"ROCm {getattr(torch.version, 'hip', '?')}")
        return (f"{torch.cuda.get_device_name(i)} (sm_{major}{minor}, "
                f"{p.total_memory / 2**30:.0f} GiB), {runtime}")
    if device.type == "mps":
        return f"Apple GPU (MPS) on {platform.machine()} {platform.platform(terse=True)}"
    return f"{cpu_model()} ({cpu_capability()}), {torch.get_num_threads()} thread(s)"


def cpu_model() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return cpu


def machine(device: torch.device | str = "cpu") -> str:
    """One line for table headers: the device's name, torch version and OS."""
    return f"{device_name(device)}, torch {torch.__version__}, {platform.system()}"
