"""``scripts/compile_ahead.py``: the sparse-tensor-core variants a GPU run asks for, compiled before it asks, into the
cubin cache the runtime's own compiles read (``cuda_rtc.cached_cubin``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shuffleprune.kernels import cuda_rtc, nm_sparse_gemm as sg, nm_sparse_mma as sm, sparse_mma_tiles as tiles

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("compile_ahead_under_test", SCRIPTS / "compile_ahead.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)   # its workers' function is pickled by module name
    spec.loader.exec_module(module)
    return module


def _runtime_sources(monkeypatch) -> list[str]:
    """What the runtime's launches compile, recorded instead of compiled: an H100/H200's 132 SMs, CUDA ≥ 12.5."""
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(multi_processor_count=132))
    for module in (sm, sg):
        monkeypatch.setattr(module, "compile_cuda", lambda text, name, index, key=None, arch_specific=False:
                            asked.append((text, arch_specific)) or object())
        monkeypatch.setattr(module, "ordered_metadata", lambda: True)
        monkeypatch.setattr(module, "allow_dynamic_shared", lambda kernel, nbytes: None)
        monkeypatch.setattr(module, "driver", lambda: (_ for _ in ()).throw(OSError("no driver here")))
        module._compiled.cache_clear()
        module._launch.cache_clear()
    monkeypatch.setattr(sm, "resident_ctas", lambda kernel, threads, dynamic=0: None)
    monkeypatch.setattr(sg, "smem_per_block_optin", lambda device: 232448)
    return asked


def test_the_variants_compiled_ahead_are_the_ones_the_runtime_launches(monkeypatch, ahead):
    """For issue 24's shapes and token counts, every decode (plain, through a map, tall, inline, as a dependent, both
    layouts; through a map without its L2 prefetch too) and prompt GEMM (mma.sp, and wgmma from one token) the runtime launches on Hopper has its exact source in
    the compile-ahead list, for the target it is compiled for; a changed kernel text would miss it."""
    asked = _runtime_sources(monkeypatch)
    ahead_list = ahead.ahead_sources((9, 0), 132)
    for (rows, cols), tokens, tiled in [((4096, 4096), 1, True), ((11008, 4096), 16, False), ((4096, 14336), 64, True),
                                        ((1024, 4096), 4, True), ((22016, 4096), 2, False)]:
        for mapped, pdl, tall, override in [(False, False, False, ()), (True, False, False, ()),
                                            (True, False, False, (("inline_map", True),)), (False, True, False, ()),
                                            (True, False, False, (("prefetch", False),)),
                                            (True, False, True, ())]:
            if mapped and tokens > tiles.MAPPED_MAX_TOKENS:
                continue
            if tall and not tiles.tall_worth_weighing(tokens, rows, cols, 132, mapped):
                continue
            sm._launch(tokens, rows, cols, torch.bfloat16, tiled, False, mapped, 0, override, pdl, tall)
        for wgmma in (False, True):
            sg._launch(tokens, rows, cols, torch.bfloat16, tiled, False, 0, (), wgmma)
    for tokens in (64, 512, 2048):
        sg._launch(tokens, 4096, 4096, torch.bfloat16, True, False, 0, (), False)
        sg._launch(tokens, 14336, 4096, torch.bfloat16, True, False, 0, (), True)
    known = {(s.text, s.arch_specific) for s in ahead_list}
    assert len(asked) > 20 and all(arch_specific == ("#define WGMMA 1\n" in text) for text, arch_specific in asked
                                   if "#define WGMMA " in text) and any(arch_specific for _, arch_specific in asked)
    missing = [text.split("\n", 14)[:14] for text, arch_specific in asked if (text, arch_specific) not in known]
    assert not missing
    assert len(ahead_list) == len({(s.text, s.name) for s in ahead_list})   # each once
    assert ahead.ahead_sources((7, 5), 80) == [] and not any(s.arch_specific for s in ahead.ahead_sources((8, 0), 108))


def test_compile_ahead_fills_the_cache_the_runtime_loads_from(monkeypatch, tmp_path, ahead, capsys):
    """The compile-ahead keeps each variant's cubin where ``compile_own`` looks (a later call loads it, NVRTC not
    asked again); a second run finds them all kept; a variant NVRTC refuses is counted and named, not fatal."""
    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(tmp_path))
    compiled = []

    class FakeNvrtc:
        def version(self):
            return "13.0"

        def compile(self, source, arch, report=False):
            compiled.append(arch)
            if "refuse me" in source:
                return False, "error: refused", b""
            return True, "", b"\x7fELF" + arch.encode()

    monkeypatch.setattr(cuda_rtc, "own_nvrtc", lambda: FakeNvrtc())
    sources = [cuda_rtc.CudaSource("text a", "k"), cuda_rtc.CudaSource("text b", "k", True),
               cuda_rtc.CudaSource("refuse me", "k")]
    monkeypatch.setattr(ahead, "ahead_sources", lambda capability, sms: sources)
    monkeypatch.setattr(sys, "argv", ["compile_ahead.py", "--capability", "9.0", "--jobs", "2"])
    ahead.main()
    out = capsys.readouterr().out
    assert "3 variants for sm_90, sm_90a, 132 SMs: 2 compiled" in out and "1 failed" in out and "refused" in out
    monkeypatch.setattr(cuda_rtc, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(cuda_rtc, "load_cubin", lambda cubin, name, index: cubin)
    compiled.clear()   # the workers' compiles happened in their own processes: none here from now on
    assert cuda_rtc.compile_own("text b", "k", 0, arch_specific=True) == b"\x7fELFsm_90a" and compiled == []
    ahead.main()
    assert "2 kept already, 1 failed" in capsys.readouterr().out


def test_compile_ahead_refuses_a_capability_it_cannot_read(monkeypatch, ahead):
    monkeypatch.setattr(sys, "argv", ["compile_ahead.py", "--capability", "hopper"])
    with pytest.raises(SystemExit, match="give major.minor"):
        ahead.main()


def test_compile_ahead_asks_the_driver_for_the_gpu_it_compiles_for(monkeypatch, ahead, capsys):
    """Without ``--capability`` the target and SM count are GPU 0's, asked of the CUDA driver (``cuInit`` and
    attributes: no context); without a driver, a one-line exit naming the options to give."""
    import ctypes

    class Driver:
        def cuInit(self, flags):
            return 0

        def cuDeviceGet(self, ref, index):
            ref._obj.value = index
            return 0

        def cuDeviceGetAttribute(self, ref, attribute, device):
            ref._obj.value = {75: 9, 76: 0, 16: 114}[attribute]   # an H100 PCIe: 114 SMs
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Driver())
    assert ahead.driver_gpu() == ((9, 0), 114)
    monkeypatch.setattr(sys, "argv", ["compile_ahead.py", "--list"])
    ahead.main()
    assert "for sm_90, sm_90a, 114 SMs (listed" in capsys.readouterr().out

    def no_driver(name):
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    with pytest.raises(SystemExit, match="no CUDA driver here: give --capability"):
        ahead.main()
