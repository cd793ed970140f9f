"""The benchmark's plumbing on tiny real UNets: settings, device and dtype choice, the ceiling,
the run loop, tables (the real measurements are in docs/speed.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest
import torch

import tome
from tome.config import ToMeConfig
from tome_lab import bench, device, models, report, run, timing
from tome_lab import settings as lab_settings
from tome_lab.matching import run_matching
from tome_lab.settings import Setting

torch.set_num_threads(1)


# ----------------------------------------------------------------------------- settings


def test_setting_parsing_labels_and_round_trip():
    s = Setting.parse("merge:0.5:matching=local,max_downsample=2")
    assert (s.method, s.impl, s.value) == ("merge", "tome", 0.5)
    assert s.config == ToMeConfig(ratio=0.5, matching="local", max_downsample=2)
    assert s.label == "merge local 0.5 max_downsample=2"
    assert s.group == "merge local max_downsample=2"
    d = Setting.parse("downsample:4")
    assert d.config.method == "downsample" and d.config.downsample_factor == 4
    assert d.label == "downsample x4" and d.reduction == pytest.approx(1 - 1 / 16)
    assert Setting.parse("baseline") == Setting.parse("unmerged") == Setting()
    assert Setting().label == "unmerged" and Setting().unmerged
    t = Setting.parse("tomesd:0.5:max_downsample=2")
    assert (t.impl, t.label) == ("tomesd", "tomesd 0.5 max_downsample=2")
    # any ToMeConfig field works by name, including ones added later (share, policy)
    p = Setting.parse("merge:0.5:share=block,policy=auto")
    assert (p.config.share, p.config.policy) == ("block", "auto")
    for spec in ("merge:0.5", "merge:0.75:end=0.5", "downsample:2:max_downsample=2", "ceiling",
                 "ceiling:max_downsample=2", "match-only", "match-only:tomesd", "tomesd:0.3",
                 "merge:0.5:use_rand=False,matching=local"):
        s = Setting.parse(spec)
        assert Setting.parse(s.spec) == s, spec
    for bad in ("fast:0.5", "merge:0.9", "merge:0.5:nope=1", "tomesd:0.5:matching=local",
                "ceiling:0.5", "match-only:theirs", "baseline:0.5", "merge:0.5:0.6",
                "merge:0.5:method=downsample"):
        with pytest.raises(ValueError):
            Setting.parse(bad)


def test_ceiling_and_match_only_settings():
    c = Setting.parse("ceiling")
    assert (c.method, c.label, c.reduction, c.value) == ("ceiling", "ceiling", 1.0, 0.0)
    assert Setting.parse("ceiling:max_downsample=2").config.max_downsample == 2
    ours, theirs = Setting.parse("match-only"), Setting.parse("match-only:tomesd")
    assert ours.config.ratio == theirs.config.ratio == lab_settings.MATCH_ONLY_RATIO
    assert (ours.impl, theirs.impl) == ("tome", "tomesd")
    assert (ours.label, theirs.label) == ("match-only", "match-only tomesd")
    names = [s.label for s in lab_settings.default_settings(
        ["ceiling", "tomesd", "merge", "merge-local", "downsample", "match-only"], [0.3, 0.5], [2])]
    assert names == ["unmerged", "ceiling", "tomesd 0.3", "tomesd 0.5", "merge 0.3", "merge 0.5",
                     "merge local 0.3", "merge local 0.5", "downsample x2", "match-only",
                     "match-only tomesd"]
    with pytest.raises(ValueError):
        lab_settings.default_settings(["fastest"])


# ----------------------------------------------------------------------------- device, dtype


def test_device_selection(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device, "mps_available", lambda: False)
    assert device.pick_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA"):
        device.pick_device("cuda")
    with pytest.raises(ValueError, match="no MPS"):
        device.pick_device("mps")
    with pytest.raises(ValueError):
        device.pick_device("tpu")
    monkeypatch.setattr(device, "mps_available", lambda: True)
    assert device.pick_device("auto") == torch.device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device.pick_device("auto") == torch.device("cuda")  # CUDA before MPS
    assert device.pick_device("cpu") == torch.device("cpu")
    assert device.pick_device("mps") == torch.device("mps")


def _cpu(monkeypatch, arch="x86_64", amx=False, avx512_bf16=False, probe=None):
    device.cpu_bf16.cache_clear()
    monkeypatch.setattr(device.platform, "machine", lambda: arch)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16,
                        raising=False)

    def no_probe(*a, **k):
        if probe is None:
            raise AssertionError("the matmul probe ran although the CPU flags decide")
        return probe

    monkeypatch.setattr(device, "matmul_probe", no_probe)


def test_dtype_choice(monkeypatch):
    try:
        for kind in ("cuda", "mps"):
            assert device.pick_dtype(kind)[0] == "fp16"
        assert device.pick_dtype("cuda", "bf16") == ("bf16", "dtype bf16: as requested")
        with pytest.raises(ValueError):
            device.pick_dtype("cpu", "int8")
        _cpu(monkeypatch)  # AVX2 only: bf16 would be emulated
        name, why = device.pick_dtype("cpu")
        assert name == "fp32" and "emulated" in why and "\n" not in why
        assert device.pick_dtype("cpu", "bf16")[0] == "bf16"  # an explicit dtype wins
        _cpu(monkeypatch, amx=True)
        assert device.pick_dtype("cpu") == ("bf16", "dtype bf16: CPU has AMX ("
                                            f"{device.cpu_capability()})")
        _cpu(monkeypatch, avx512_bf16=True)
        assert "AVX512-BF16" in device.pick_dtype("cpu")[1]
        # no x86 flags to go by (ARM): a timed matmul decides
        _cpu(monkeypatch, arch="aarch64", probe=(1.0, 0.6))
        assert device.pick_dtype("cpu")[0] == "bf16"
        _cpu(monkeypatch, arch="aarch64", probe=(1.0, 12.0))
        name, why = device.pick_dtype("cpu")
        assert name == "fp32" and "12x as long" in why
    finally:
        device.cpu_bf16.cache_clear()


def test_matmul_probe_and_machine_line():
    t32, t16 = device.matmul_probe(n=32, repeats=1)
    assert t32 > 0 and t16 > 0
    line = device.machine("cpu")
    assert "torch" in line and device.cpu_capability() in line


def test_gpu_name_in_the_header(monkeypatch):
    class Props:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: Props())
    name = device.device_name("cuda")
    assert name.startswith("NVIDIA H100 80GB HBM3 (sm_90, 80 GiB), ")
    assert device.machine("cuda").startswith(name + ", torch ")
    assert device.device_name("mps").startswith("Apple GPU (MPS)")


def test_timer_and_memory_on_cpu():
    timer = timing.Timer("cpu")
    dt, out = timer(lambda: torch.ones(3).sum())
    assert dt >= 0 and out.item() == 3
    with pytest.raises(ValueError):
        timing.Timer("cuda", clock="cpu")
    mem: dict = {}
    with timing.peak_memory(mem, "cpu"):
        torch.zeros(1 << 20)
    assert mem["peak"] >= 4 << 20
    mps: dict = {}
    with timing.peak_memory(mps, "mps"):  # no counter there: reported as unknown
        pass
    assert mps["peak"] is None


def test_gpu_timing_and_memory_paths_with_fakes(monkeypatch):
    """The CUDA path (events between synchronizes, max_memory_allocated after a reset) and the
    MPS path (synchronize around a wall clock), with torch's device calls faked."""
    calls = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t = None

        def record(self):
            calls.append("record")
            self.t = len(calls)

        def elapsed_time(self, end):
            return 1000.0 * (end.t - self.t)  # milliseconds

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    dt, out = timing.Timer("cuda")(lambda: calls.append("work") or 7)
    assert out == 7 and calls == ["sync", "record", "work", "record", "sync"]
    assert dt == pytest.approx(2.0)  # seconds between the two records (fake clock)
    stats = {"allocated": 100}
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: stats.update(peak=stats["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: stats["peak"])
    mem: dict = {}
    with timing.peak_memory(mem, "cuda"):
        stats["peak"] = 100 + 4096
    assert mem["peak"] == 4096
    calls.clear()
    monkeypatch.setattr(torch.mps, "synchronize", lambda: calls.append("mps sync"))
    dt, _ = timing.Timer("mps")(lambda: calls.append("work"))
    assert calls == ["mps sync", "work", "mps sync"] and dt >= 0


def test_cli_rejects_a_missing_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        bench.main(["--device", "cuda", "--no-progress"])
    assert "no CUDA" in capsys.readouterr().err


def test_gpu_defaults_without_a_gpu(monkeypatch):
    """On a GPU the benchmark runs SD1.5 and SDXL with every method, in fp16; checked by
    recording the cases and settings instead of running them."""
    seen = {}
    monkeypatch.setattr(bench, "pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(bench, "machine", lambda dev: "GPU 0")
    monkeypatch.setattr(bench, "device_name", lambda dev: "GPU 0")

    def fake_case(name, size, dtype, batch, model=None, device=None):
        return models.Case(name, size, dtype, batch, model=torch.nn.Identity(), device=device)

    def fake_run(cases, settings, repeats, measure, progress, **kw):
        seen.setdefault("cases", []).extend((c.model_name, c.size, c.dtype) for c in cases)
        seen["settings"] = [s.label for s in settings]
        seen["repeats"] = repeats
        rows = [{"model": c.model_name, "size": c.size, "dtype": c.dtype, "batch": c.batch,
                 "device": "cuda", "setting": s.label, "method": s.method, "impl": s.impl,
                 "value": s.value, "options": dict(s.options), "times": [1.0], "median": 1.0,
                 "min": 1.0, "max": 1.0, "flops": None, "peak": None, "patched": "",
                 "deviation": 0.0, "reduction": s.reduction} for c in cases for s in settings]
        run.derive(rows)
        return rows

    monkeypatch.setattr(bench, "build_case", fake_case)
    monkeypatch.setattr(bench, "run_benchmark", fake_run)
    monkeypatch.setattr(bench, "same_bits_twice", lambda case, s: seen.setdefault(
        "bits", []).append(s.label) or True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    assert bench.main(["--sizes", "512,1024", "--no-progress"]) == 0
    assert seen["cases"] == [("sd15", 512, "fp16"), ("sd15", 1024, "fp16"),
                             ("sdxl", 512, "fp16"), ("sdxl", 1024, "fp16")]
    assert seen["settings"] == ["unmerged", "ceiling", "tomesd 0.5", "merge 0.5",
                                "merge local 0.5", "downsample x2", "merge 0.5 policy=auto",
                                "match-only", "match-only tomesd"]
    assert seen["repeats"] == 10
    assert seen["bits"] == ["merge 0.5"] * 4  # the GPU run settles "same seed, same bits"


# ----------------------------------------------------------------------------- on tiny UNets


def test_sdpa_forward_matches_ldm_attention():
    pytest.importorskip("ldm")
    from ldm.modules.attention import CrossAttention
    torch.manual_seed(0)
    attn = CrossAttention(32, context_dim=16, heads=4, dim_head=8).eval()
    x, ctx = torch.randn(2, 10, 32), torch.randn(2, 7, 16)
    with torch.no_grad():
        ref = attn(x, context=ctx)
        with models.ldm_sdpa():
            out = attn(x, context=ctx)
        assert CrossAttention.forward is not models.sdpa_forward
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_case():
    pytest.importorskip("ldm")
    pytest.importorskip("tomesd")
    from models import ldm_unet
    return models.build_case("sd15", 128, "fp32", batch=2, model=ldm_unet(), context_dim=32)


@pytest.mark.parametrize("family", ["ldm", "diffusers-sdxl"])
def test_ceiling_removes_attention_at_merged_levels_and_restores_bit_exactly(family, tiny_case):
    from models import diffusers_unet, ldm_inputs
    if family == "ldm":
        case = tiny_case
        model, call = case.model, case.forward
        expect = 5  # SD1.5 layout: 2 down + 3 up blocks at full resolution
    else:
        model = diffusers_unet("sdxl")
        x, t, ctx = ldm_inputs(context_dim=32)

        def call():
            return model(x, t, encoder_hidden_states=ctx).sample
        expect = (2 + 3) * 2  # SDXL layout: no attention at full resolution, depth 2 at ds2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attns = [m for m in model.modules() if hasattr(m, "to_out")]
    with torch.no_grad():
        ref = call()
        ceiling = Setting.parse("ceiling")
        ceiling.apply(model)
        try:
            assert ceiling.patched_blocks(model).startswith(f"{expect}/")
            changed = call()
        finally:
            ceiling.remove(model)
        assert not torch.equal(changed, ref)
        assert torch.equal(call(), ref)
    assert all("forward" not in vars(a) for a in attns)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_run_benchmark_rows_table_and_plot(tiny_case, tmp_path):
    settings = lab_settings.parse_settings(["ceiling", "tomesd:0.5", "merge:0.5",
                                        "merge:0.5:matching=local", "downsample:2",
                                        "match-only", "match-only:tomesd"])
    rows = run.run_benchmark([tiny_case], settings, repeats=1, progress=False)
    assert [r["setting"] for r in rows] == [s.label for s in settings]
    by = {r["setting"]: r for r in rows}
    base = by["unmerged"]
    assert base["deviation"] == 0 and base["speedup"] == pytest.approx(1.0)
    for r in rows:
        assert len(r["times"]) == 1 and r["min"] == r["median"] == r["max"] > 0
        assert r["flops"] > 0 and r["peak"] > 0 and r["device"] == "cpu"
    for r in rows[1:]:
        assert 0 < r["deviation"] and math.isfinite(r["vs_tomesd"])
    # Merging removes attention work; the FLOP counter sees it, the ceiling most.
    assert by["ceiling"]["flops"] < by["merge 0.5"]["flops"] < base["flops"]
    assert by["downsample x2"]["flops"] < base["flops"]
    assert by["merge 0.5"]["patched"] == by["tomesd 0.5"]["patched"] == "5/16"
    assert by["ceiling"]["patched"] == "5/16"
    # match-only merges 1%: close to the unmerged output; compared with tomesd's match-only
    assert by["match-only"]["deviation"] < by["merge 0.5"]["deviation"]
    mo = by["match-only"]
    assert mo["vs_tomesd"] == pytest.approx(by["match-only tomesd"]["median"] / mo["median"])
    text = report.markdown_table(rows)
    assert "| unmerged |" in text and "| ceiling |" in text and "deviation" in text
    summary = report.summary_table(rows)
    assert "match-only ours / tomesd" in summary and "| sd15 | 128 | fp32 |" in summary
    pytest.importorskip("matplotlib")
    path = report.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000 and path.endswith("p.png")
    out = tmp_path / "rows.json"
    report.save_json(str(out), {"unet": rows})
    again = report.load_rows(str(out))
    assert [r["speedup"] for r in again] == pytest.approx([r["speedup"] for r in rows])


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, t, context=None):
        return self.lin(x)


def _double(module, args):
    return (args[0] * 2,)


def _double_with_break(module, args):
    torch._dynamo.graph_break()
    return (args[0] * 2,)


_CALLS = [0]


def _drifting(module, args):
    _CALLS[0] += 1  # a Python number that changes every call: its guard fails, dynamo recompiles
    return (args[0] * (2 + _CALLS[0]),)


class _Hooked:
    """A Setting-like patch: a forward pre-hook on the toy's layer."""

    method, impl, value, options, reduction, unmerged = "merge", "tome", 0.5, (), 0.5, False
    config = None

    def __init__(self, label, hook):
        self.label = self.group = self.spec = label
        self.hook = hook

    def apply(self, model, seed=None):
        self.handle = model.lin.register_forward_pre_hook(self.hook)

    def remove(self, model):
        self.handle.remove()

    def patched_blocks(self, model):
        return "1/1"


def test_run_loop_on_a_faked_cuda_device(tiny_case, monkeypatch):
    """The run loop's GPU branch (three warm-up rounds, CUDA timing and memory), with the
    model left on the CPU and torch.cuda's calls faked."""
    clock = [0.0]

    class Event:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            clock[0] += 0.5
            self.t = clock[0]

        def elapsed_time(self, end):
            return 1000.0 * (end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 2**20 + 10)
    case = models.Case(tiny_case.model_name, tiny_case.size, "fp16", tiny_case.batch,
                       model=tiny_case.model, inputs=tiny_case.inputs,
                       device=torch.device("cuda"))
    assert run.default_warmup(case.device) == 3
    settings = lab_settings.parse_settings(["merge:0.5", "ceiling"])
    seen = []
    rows = run.run_benchmark([case], settings, repeats=2, progress=False,
                             on_row=lambda r: seen.append(r["setting"]))
    assert seen == ["unmerged", "merge 0.5", "ceiling"]
    for r in rows:
        assert r["device"] == "cuda" and r["times"] == [0.5, 0.5] and r["peak"] == 2**20
    assert rows[1]["patched"] == rows[2]["patched"] == "5/16"


def test_compile_reports_graphs_breaks_and_recompiles():
    """Compiled runs (dynamo with its eager backend here, to stay fast): every patch state
    gets its own graphs instead of silently reusing the unpatched one, and graph breaks and
    recompilations are counted per setting."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    case = models.Case("sd15", 64, "fp32", 2, model=_Toy().eval(),
                       inputs={"x": torch.randn(2, 8, generator=g), "t": torch.zeros(2),
                               "ctx": None})
    settings = [Setting(), _Hooked("double", _double), _Hooked("break", _double_with_break),
                _Hooked("drift", _drifting)]
    rows = run.run_benchmark([case], settings, repeats=3, measure=False, progress=False,
                             compile=True, compile_backend="eager")
    by = {r["setting"]: r for r in rows}
    assert all(r["deviation"] > 0 for r in rows[1:])  # the hooks ran inside the compiled model
    assert by["unmerged"]["compile"]["graphs"] >= 1
    assert by["unmerged"]["compile"]["recompiles"] == 0
    assert by["double"]["compile"]["breaks"] == 0 and by["break"]["compile"]["breaks"] >= 1
    # a guard that fails on every call: a recompilation per call (5 calls: 2 warm-up, 3 timed)
    assert by["drift"]["compile"]["recompiles"] >= 3 > by["double"]["compile"]["recompiles"]
    text = report.markdown_table(rows)
    assert "graphs / breaks / recompiles" in text and "graph break in break" in text


def test_matching_suite_small():
    pytest.importorskip("tomesd")
    rows = run_matching(tokens=1024, channels=16, repeats=1, progress=False)
    assert [r["impl"] for r in rows] == ["tomesd", "global", "local"]
    assert all(r["peak"] > 0 and r["median"] > 0 for r in rows)
    assert "| ours, local" in report.matching_table(rows)


def test_cli_matching(capsys):
    pytest.importorskip("tomesd")
    assert bench.main(["--suite", "matching", "--tokens", "256", "--channels", "8",
                       "--no-progress", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "faster than tomesd" in out and "Device: " in out and "dtype " in out


def test_profiler_says_nothing_on_stderr():
    """torch 2.13's CPU profiler prints USDT profiler_start/stop lines from C++ (fd 2)."""
    code = ("import torch\nfrom tome_lab.timing import peak_memory\nr = {}\n"
            "with peak_memory(r, 'cpu'):\n    torch.ones(64, 64) @ torch.ones(64, 64)\n"
            "print(r['peak'] > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "True" and "USDT" not in out.stderr and "profiler" not in \
        out.stderr


def test_sweep_compares_measured_decisions_with_unet_calls(tmp_path, capsys):
    from models import TINY_SD15, ldm_unet

    from tome_lab import sweep
    from tome_lab.models import Case

    unet = ldm_unet(TINY_SD15)
    g = torch.Generator().manual_seed(0)
    case = Case("sd15", 128, model=unet, inputs={
        "x": torch.randn(2, 4, 16, 16, generator=g), "t": torch.full((2,), 500.0),
        "ctx": torch.randn(2, 7, 32, generator=g)})
    rows = sweep.sweep_case(case, ToMeConfig(max_downsample=2), repeats=1, rounds=1,
                            timer=timing.Timer("cpu"))
    assert [r["level"] for r in rows] == [1, 2, "auto"]
    for r in rows[:2]:
        assert r["actual"] > 0 and r["measured"] > 0 and r["in_call"] > 0
        assert 0 < r["level_share"] < 1 and r["agrees"] == (r["decision"] == (r["in_call"] > 1))
        lo, hi = r["actual_range"]
        assert lo <= r["actual"] <= hi
    assert rows[-1]["overhead"] > 0 and set(rows[-1]["merged"]) <= {1, 2}
    summary = sweep.summarise(rows)
    assert summary["cases"] == 2 and 0 <= summary["agreement"] <= 1
    assert "| sd15 | 128 | ds1 | 256 |" in sweep.table(rows)
    assert "agreement" in sweep.report(summary)
    # Runs split over cores are summarised as one (--combine).
    sweep.write(str(tmp_path / "a"), rows, {"device": "cpu", "dtype": "fp32"})
    assert sweep.combine([str(tmp_path / "a")] * 2, str(tmp_path / "both")) == 0
    both = json.loads((tmp_path / "both" / "sweep.json").read_text())
    assert both["summary"]["cases"] == 4 and "agreement" in capsys.readouterr().out
    assert not tome.is_patched(unet)
    # The level clock: time inside each level's blocks, less than the call, hooks gone after.
    clock = sweep.LevelClock(unet, torch.device("cpu"))
    with torch.no_grad(), clock.record() as spent:
        t0 = time.perf_counter()
        case.forward()
        total = time.perf_counter() - t0
    assert set(spent) == {1, 2, 4, 8} and 0 < sum(spent.values()) < total
    assert not any(b._forward_pre_hooks or b._forward_hooks for b in clock.levels)


def test_sweep_decides_as_the_library_does(monkeypatch):
    """A level measured 1.3x whose rounds disagree (0.9x to 1.4x) is uncertain: the library
    does not merge it, so neither does the sweep's decision nor its auto setting."""
    from models import TINY_SD15, ldm_unet

    from tome import measure as M
    from tome_lab import sweep
    from tome_lab.models import Case

    unet = ldm_unet(TINY_SD15)
    g = torch.Generator().manual_seed(0)
    case = Case("sd15", 128, model=unet, inputs={
        "x": torch.randn(2, 4, 16, 16, generator=g), "t": torch.full((2,), 500.0),
        "ctx": torch.randn(2, 7, 32, generator=g)})
    rows = (M.LevelTiming(1, 256, 2, 1, 1.3, 1.0, 0.9, 1.4),
            M.LevelTiming(2, 64, 2, 1, 1.3, 1.0, 1.2, 1.4))
    monkeypatch.setattr(sweep, "measure", lambda *a, **k: M.Measurement(
        "cpu", "float32", (16, 16), 2, "merge", rows))
    out = sweep.sweep_case(case, ToMeConfig(max_downsample=2), repeats=1, rounds=1,
                           timer=timing.Timer("cpu"))
    assert [(r["decision"], r["uncertain"]) for r in out[:2]] == [(False, True), (True, False)]
    assert out[-1]["merged"] == [2] and "| ds1 | 256 | 1.30x | uncertain |" in sweep.table(out)


def test_same_bits_twice_on_this_cpu():
    from models import TINY_SD15, ldm_unet

    g = torch.Generator().manual_seed(0)
    case = models.Case("sd15", 128, model=ldm_unet(TINY_SD15), inputs={
        "x": torch.randn(2, 4, 16, 16, generator=g), "t": torch.full((2,), 500.0),
        "ctx": torch.randn(2, 7, 32, generator=g)})
    assert run.same_bits_twice(case, Setting.parse("merge:0.5"))
    assert not tome.is_patched(case.model)
