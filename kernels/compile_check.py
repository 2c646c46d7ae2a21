"""Compile the Triton kernels for a GPU that is not here and report what the compiler made of them.

Triton's own compiler and ``ptxas`` (both ship in the triton wheel) build the real sm_90a binary on a
machine without a GPU. :func:`compile_only` runs the ordinary host functions (``nm_decode``,
``nm_gemm``, …) with every kernel launch replaced by a compile for the target — same arguments,
same specialisation (alignment, divisibility by 16) as on the GPU — and :func:`report` reads each
binary: registers, spills, shared memory, resident programs per SM, waves, the widest global load of
the weight and whether ``tl.dot`` became tensor-core instructions. This is where a kernel that only
ever ran under ``TRITON_INTERPRET=1`` shows whether it compiles at all, and whether the 16-byte
streaming loads and tensor-core tiles it was written for are really there. It measures no time.

Kernels decorated while ``TRITON_INTERPRET=1`` is set are interpreted, not compiled: run this in a
process without it (``python scripts/check_kernels_compile.py``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.errors import OutOfResources
from triton.runtime.jit import JITFunction


@dataclasses.dataclass(frozen=True)
class GPUSpec:
    """What the occupancy estimate needs of a GPU (defaults: H100 SXM, sm_90)."""

    name: str = "H100 (sm_90a)"
    arch: int = 90
    sms: int = 132
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024          # usable shared memory per SM
    smem_per_block: int = 227 * 1024       # most one program may use
    max_warps_per_sm: int = 64
    max_blocks_per_sm: int = 32
    issue_per_cycle: int = 4               # warp instructions one SM issues per cycle (one per scheduler)
    smem_bytes_per_cycle: int = 128        # shared memory bandwidth per SM (32 banks of 4 bytes)
    clock_ghz: float = 1.755               # sustained SM clock under load
    dram_tbs: float = 3.35                 # HBM3 bandwidth


H100 = GPUSpec()
# the other NVIDIA data-centre GPUs users serve on (NVIDIA's published figures): the Ampere A100 (SXM, 80 GB)
# and the Ada L40S, whose 100 KB of shared memory per SM is what a Hopper-sized tile can outgrow
A100 = GPUSpec(name="A100 (sm_80)", arch=80, sms=108, smem_per_sm=164 * 1024, smem_per_block=163 * 1024,
               clock_ghz=1.41, dram_tbs=2.04)
L40S = GPUSpec(name="L40S (sm_89)", arch=89, sms=142, smem_per_sm=100 * 1024, smem_per_block=99 * 1024,
               max_warps_per_sm=48, max_blocks_per_sm=24, clock_ghz=2.52, dram_tbs=0.864)
SPECS = {"h100": H100, "a100": A100, "l40s": L40S}


def ptxas_arch(arch: int) -> str:
    """``ptxas``' name of ``arch``: Hopper's architecture-specific sm_90a (wgmma, TMA, griddepcontrol),
    the plain name below it."""
    return f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"


@dataclasses.dataclass
class Launch:
    """One launch that was compiled instead of run."""

    kernel: str
    grid: tuple[int, ...]
    compiled: object  # triton CompiledKernel

    @property
    def constexprs(self) -> dict:
        """The launch's compile-time constants by parameter name (tile sizes, flags)."""
        src = self.compiled.src
        return {src.fn.arg_names[path[0]]: value for path, value in src.constants.items() if len(path) == 1}

    @property
    def programs(self) -> int:
        out = 1
        for g in self.grid:
            out *= g
        return out


class _CompileOnlyDriver:
    """The part of Triton's driver interface the JIT uses to pick a target (no device behind it)."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


@contextlib.contextmanager
def _planned_as_on(spec: GPUSpec) -> Iterator[None]:
    """Triton's driver answering for ``spec`` (target, device 0, stream 0; nothing behind it) and the
    host functions planning as on that GPU (its SM count, shared memory, no interpreter upcasts)."""
    if not isinstance(_a_kernel(), JITFunction):
        raise RuntimeError("the kernels were decorated under TRITON_INTERPRET=1; compile in a process without it")
    from shuffleprune.kernels import gpu

    held = "_active" if "_active" in vars(driver) else "active"   # Triton 3.5+ holds it privately, behind a property
    active = vars(driver)[held]   # as held: reading the property would make the CUDA driver, which needs a GPU
    saved = gpu.upcast, gpu.sm_count, gpu.smem_per_sm, gpu.native, gpu.pdl, gpu.tma
    driver.set_active(_CompileOnlyDriver(GPUTarget("cuda", spec.arch, 32)))
    gpu.upcast, gpu.sm_count, gpu.native = (lambda x: False), (lambda device: spec.sms), (lambda x: True)
    gpu.smem_per_sm = lambda device: spec.smem_per_sm
    gpu.pdl = gpu.tma = lambda x: spec.arch >= 90   # Hopper's grid dependency control and tensor descriptors
    try:
        yield
    finally:
        setattr(driver, held, active)
        gpu.upcast, gpu.sm_count, gpu.smem_per_sm, gpu.native, gpu.pdl, gpu.tma = saved


@contextlib.contextmanager
def compile_only(spec: GPUSpec = H100) -> Iterator[list[Launch]]:
    """Inside, every ``kernel[grid](…)`` compiles for ``spec`` and returns without running (outputs stay
    uninitialised), or raises Triton's ``OutOfResources`` where the kernel needs more shared memory than
    ``spec`` gives a program, as loading it there would; the host functions plan as on that GPU (its
    SM count, no interpreter upcasts).
    Yields the list of :class:`Launch` records, filled as launches happen."""
    from shuffleprune.kernels import launch

    launches: list[Launch] = []
    run = JITFunction.run

    def compile_launch(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel.metadata.shared > spec.smem_per_block:   # what Triton's loader raises on that GPU, before any run
            raise OutOfResources(kernel.metadata.shared, spec.smem_per_block, "shared memory")
        launches.append(Launch(self.fn.__name__, tuple(grid), kernel))
        return kernel

    with _planned_as_on(spec):
        JITFunction.run = compile_launch
        try:
            with launch.enabled(False):   # every launch through the JIT's run, which compiles and records it
                yield launches
        finally:
            JITFunction.run = run


@contextlib.contextmanager
def recorded_launches(spec: GPUSpec = H100) -> Iterator[list[tuple]]:
    """Inside, Triton's dispatch runs as on ``spec`` (compiling each kernel for it) up to the launch,
    and every launch — by Triton's dispatch or by :mod:`.launch`'s fast path — appends what it passed
    the compiled kernel's launcher (grid, stream, function, metadata, hooks, arguments) to the yielded
    list instead of running: how ``scripts/check_fast_launch.py`` compares the two on a machine
    without a GPU. Each compiled kernel's ``function`` is a placeholder object of its own."""
    from triton.compiler.compiler import CompiledKernel

    calls: list[tuple] = []
    init = CompiledKernel._init_handles

    def recorded(self) -> None:
        if self.module is None:
            self.module, self.function = "recorded", object()
            self._run = lambda *args: calls.append(args)

    with _planned_as_on(spec):
        CompiledKernel._init_handles = recorded
        try:
            yield calls
        finally:
            CompiledKernel._init_handles = init


def _a_kernel():
    from shuffleprune.kernels import nm_gemm

    return nm_gemm._nm_gemm_kernel


def _ptxas(arch: int) -> str:
    """The path of the ``ptxas`` Triton ships for ``arch`` (its lookup's signature and answer changed over
    3.3–3.5: ``(path, version)``, then an object with ``.path``; 3.4 takes no architecture)."""
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        found = get_ptxas(arch)
    except TypeError:   # Triton 3.4: one ptxas for every architecture
        found = get_ptxas()
    return found[0] if isinstance(found, tuple) else found.path


def ptxas_report(text: str) -> tuple[int | None, int]:
    """``(registers per thread, spill bytes stored and loaded)`` from ptxas's report (``ptxas -v``, or NVRTC's log
    with ``--ptxas-options=-v``); registers None where the text holds no report."""
    regs = re.search(r"Used (\d+) registers", text)
    spills = sum(int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", text))
    return (int(regs.group(1)) if regs else None), spills


def _ptxas_usage(ptx: str, arch: int) -> tuple[int, int]:
    """``(registers per thread, spill bytes)`` from ``ptxas -v`` on the kernel's PTX."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([_ptxas(arch), f"-arch={ptxas_arch(arch)}", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True)
    return ptxas_report(out.stdout + out.stderr)


_LOAD = re.compile(r"\b(ld\.global[\w:.]*|cp\.async\.(?:ca|cg)\.shared\.global[\w:.]*|cp\.async\.bulk\.tensor[\w:.]*)")


def _load_bytes(op: str) -> int:
    """Bytes one thread moves with one global load instruction (cp.async copies 16 bytes with .cg)."""
    if op.startswith("cp.async.bulk"):
        return 128  # TMA: a whole tile per instruction
    if op.startswith("cp.async"):
        return 16 if ".cg." in op else 4
    vec = re.search(r"\.v(\d)", op)
    width = re.search(r"\.[bsuf](\d+)$", op)
    return (int(vec.group(1)) if vec else 1) * (int(width.group(1)) // 8 if width else 4)


def disassemble(cubin: bytes, arch: int) -> str:
    """The machine code of ``cubin`` as text (``nvdisasm``, the one beside Triton's ``ptxas``)."""
    nvdisasm = str(Path(_ptxas(arch)).with_name("nvdisasm"))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def main_loop(sass: str, holding: str | None = None) -> list[str]:
    """The machine instructions of the longest loop body (label … backward branch to it, with no
    ``EXIT`` between), of those holding an instruction that contains ``holding`` if given (``HMMA``: the
    loop of the MMAs, not a longer epilogue's): what one warp issues per iteration of the kernel's main loop;
    empty when the kernel has no such loop. (A barrier wait's retry placed after the kernel's exits branches back into
    the loop: that span is no loop body.)"""
    body, seen, instructions, exits = (0, 0), {}, [], []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            seen[label.group(1)] = len(instructions)
            continue
        ins = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?);", line)
        if not ins:
            continue
        instructions.append(ins.group(1))
        if re.search(r"\bEXIT\b", ins.group(1)):
            exits.append(len(instructions) - 1)
        target = re.search(r"\bBRA\b.*?(\.L_x_\d+)", ins.group(1))
        if target and target.group(1) in seen and len(instructions) - seen[target.group(1)] > body[1] - body[0] \
                and not any(seen[target.group(1)] <= e for e in exits) \
                and (holding is None or any(holding in i for i in instructions[seen[target.group(1)]:])):
            body = (seen[target.group(1)], len(instructions))
    return instructions[body[0]:body[1]]


def sync_loads(loop: list[str]) -> int:
    """Synchronous global loads (``LDG``) among ``loop``'s instructions: loads the software pipeline
    did not turn into asynchronous copies (``LDGSTS``), which the loop waits for in registers."""
    return sum(bool(re.search(r"\bLDG\.", ins)) for ins in loop)


def published_sum(sass: str) -> bool | None:
    """Whether a kernel's in-kernel split-K sum (an arrival counter's ``ATOMG.E.ADD``) is fenced as a
    release-acquire: a GPU-scope ``MEMBAR`` before the atomic (the partial sums reach L2 first) and
    ``CCTL.IVALL`` after it (the last split reads them past its L1). ``None``: no such atomic."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    at = [i for i, ln in enumerate(lines) if "ATOMG.E.ADD" in ln]
    if not at:
        return None
    i = at[0]
    return any("MEMBAR" in ln and "GPU" in ln for ln in lines[max(0, i - 8):i]) and \
        any("CCTL.IVALL" in ln for ln in lines[i + 1:i + 4])


def grid_dependency(ptx: str) -> dict | None:
    """Where a programmatic dependent's instructions sit in ``ptx`` (:mod:`.overlap`): whether it waits
    (``griddepcontrol.wait``) and releases the next kernel (``.launch_dependents``), its L2 prefetches
    and whether all come before the wait, and the global loads issued before the wait (all a kernel
    may read then is what no kernel writes: its weight, an index map). ``None``: neither instruction."""
    lines = ptx.splitlines()
    wait = next((i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln), None)
    release = any("griddepcontrol.launch_dependents" in ln for ln in lines)
    if wait is None and not release:
        return None
    prefetches = [i for i, ln in enumerate(lines) if "prefetch.global.L2" in ln]
    early = [m.group(1) for ln in lines[:wait or 0] for m in [_LOAD.search(ln)] if m]
    return {"wait": wait is not None, "release": release, "prefetches": len(prefetches),
            "prefetch_before_wait": wait is not None and all(i < wait for i in prefetches),
            "loads_before_wait": early}


_SMEM_ACCESS = re.compile(r"^(LDS|STS|LDSM|LDGSTS)((?:\.\w+)*)\s")
_HGMMA = re.compile(r"^HGMMA\.(\d+)x(\d+)x(\d+)\.\w+\.(\w+)\s+R\d+,\s*(\S+)")
_ACCESS_BYTES = {"64": 8, "128": 16, "U8": 1, "S8": 1, "U16": 2, "S16": 2}   # per thread; 4 without a width
_ELEMENT_BYTES = {"BF16": 2, "F16": 2, "TF32": 4, "E4M3": 1, "E5M2": 1, "S8": 1, "U8": 1}


def loop_shared_bytes(loop: list[str]) -> int:
    """Bytes one warp moves through shared memory per iteration of ``loop`` (SASS instructions): its
    loads and stores (``LDS``, ``STS``, ``LDSM``: a layout conversion's round trip shows here), the
    asynchronous copies' writes (``LDGSTS``), and its share (a quarter) of the shared operands each
    warpgroup MMA (``HGMMA``) reads (B, and A where A is not in registers). Not counted: the Tensor
    Memory Accelerator's writes (``UTMALDG``: their size is not in the instruction) and instructions
    under the never-true predicate ``@!PT`` (the compiler's placeholders)."""
    total = 0.0
    for ins in loop:
        if ins.startswith("@!PT "):
            continue
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
        access = _SMEM_ACCESS.match(ins + " ")
        if access:
            op, mods = access.group(1), access.group(2).split(".")
            if op == "LDSM":   # .16.M88.N: N 8×8 matrices of 16-bit values, 4 bytes of each per thread
                count = next((int(mod) for mod in mods[3:] if mod.isdigit()), 1)
                total += 32 * 4 * count
            else:
                total += 32 * next((_ACCESS_BYTES[mod] for mod in mods if mod in _ACCESS_BYTES), 4)
            continue
        mma = _HGMMA.match(ins)
        if mma:
            m, n, k = (int(mma.group(i)) for i in (1, 2, 3))
            elt = _ELEMENT_BYTES.get(mma.group(4), 2)
            a_in_registers = re.fullmatch(r"R\d+,?", mma.group(5)) is not None
            total += ((0 if a_in_registers else m * k) + n * k) * elt / 4
    return int(total)


def shared_ceiling_tbs(bytes_per_iteration: float, shared_bytes_per_warp: int, num_warps: int,
                       spec: GPUSpec = H100) -> float | None:
    """The memory rate (TB/s) at which a streaming loop's shared-memory traffic alone would take all of
    every SM's shared-memory bandwidth: ``bytes`` read from memory per iteration by a program of
    ``num_warps`` warps, each moving ``shared_bytes_per_warp`` (:func:`loop_shared_bytes`) through shared
    memory. Below the DRAM rate the loop cannot stream at it, however few instructions it issues."""
    if not shared_bytes_per_warp:
        return None
    per_cycle = spec.smem_bytes_per_cycle * bytes_per_iteration / (shared_bytes_per_warp * num_warps)
    return per_cycle * spec.clock_ghz * 1e9 * spec.sms / 1e12


def issue_ceiling_tbs(bytes_per_iteration: float, loop_insts: int, num_warps: int,
                      spec: GPUSpec = H100) -> float | None:
    """The memory rate (TB/s) at which a streaming loop's instructions alone would take all of every
    SM's issue slots: ``bytes`` read per iteration by a program of ``num_warps`` warps issuing
    ``loop_insts`` instructions each. Below ``spec.dram_tbs`` the kernel cannot be memory-bound."""
    if not loop_insts:
        return None  # the loop was unrolled away (a single iteration): nothing to count
    per_cycle = spec.issue_per_cycle * bytes_per_iteration / (loop_insts * num_warps)
    return per_cycle * spec.clock_ghz * 1e9 * spec.sms / 1e12


def resident_programs(spec: GPUSpec, registers: int, warps: int, shared: int) -> int:
    """Programs (CTAs) of ``warps`` warps, ``registers`` per thread and ``shared`` bytes of shared memory that
    one SM of ``spec`` holds: registers are allocated per warp in units of 256, and the driver reserves 1 KB
    of shared memory per program."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_regs = spec.regs_per_sm // (regs_per_warp * warps)
    by_smem = spec.smem_per_sm // (shared + 1024) if shared else spec.max_blocks_per_sm
    return min(by_regs, by_smem, spec.max_warps_per_sm // warps, spec.max_blocks_per_sm)


def report(launch: Launch, spec: GPUSpec = H100) -> dict:
    """Resource use and instruction mix of one compiled launch, and its occupancy on ``spec``."""
    k = launch.compiled
    md, ptx = k.metadata, k.asm["ptx"]
    regs, spills = _ptxas_usage(ptx, spec.arch)
    warps = md.num_warps
    per_sm = resident_programs(spec, regs, warps, md.shared)
    loads = _LOAD.findall(ptx)
    sass = disassemble(k.asm["cubin"], spec.arch)
    loop = main_loop(sass)
    return {
        "kernel": launch.kernel, "grid": list(launch.grid), "programs": launch.programs,
        "num_warps": warps, "num_stages": md.num_stages, "registers": regs, "spill_bytes": spills,
        "shared_bytes": md.shared, "fits": md.shared <= spec.smem_per_block and per_sm >= 1,
        "programs_per_sm": per_sm, "waves": round(launch.programs / max(1, per_sm * spec.sms), 2),
        "widest_load_bytes": max((_load_bytes(op) for op in loads), default=0),
        "evict_first": "evict_first" in ptx,
        "async_copies": bool(re.search(r"\bcp\.async\.", ptx)),   # a software-pipelined loop's loads
        "bulk_copies": "cp.async.bulk.tensor" in ptx,   # tiles copied by the Tensor Memory Accelerator
        "tensor_core": bool(re.search(r"\b(wgmma|mma)\.", ptx)),
        "wgmma": "wgmma." in ptx,
        "loop_instructions": len(loop),
        "loop_shared_bytes": loop_shared_bytes(loop),
        "loop_sync_loads": sync_loads(loop),
        "split_sum_fenced": published_sum(sass),
        "launch_pdl": bool(getattr(md, "launch_pdl", False)),
        "grid_dependency": grid_dependency(ptx),
        "constexprs": {k_: v for k_, v in launch.constexprs.items() if isinstance(v, (int, str, bool))},
    }
