"""Static report of the CUDA kernels (issue #23): resources, SASS, occupancy, a bytes-in-flight model, checks.

There is no GPU where kvcache is developed, so nothing here runs a kernel. Every .cu file is compiled by nvcc
to a cubin per architecture (the flags of CMakeLists.txt) and read three ways:

1. ptxas's resource usage (--resource-usage): registers, stack frame, spills, shared memory per kernel;
2. the SASS (cuobjdump -sass), when a cuobjdump is found: global loads by width, local-memory
   instructions, calls (the 64-bit integer division helpers), tensor-core instructions;
3. a model: occupancy from the documented per-SM limits, and bytes in flight per SM by Little's law.

Everything GPU-related is modelled, not measured. Only the standard library is used (no torch).

    python3 benchmarks/cuda_kernels.py            # writes benchmarks/results/cuda_kernels.{md,json}
    python3 benchmarks/cuda_kernels.py --check    # exit code 1 when any check fails

cuobjdump is looked for in $KVCACHE_CUOBJDUMP, on PATH, then in a triton or nvidia-* wheel (the project's
venvs under ~/.cache/kvcache ship triton's); without one the SASS checks say "not run (no cuobjdump)".

nvcc's output (cubin + resource report) is kept in ~/.cache/kvcache/cubins (or $KVCACHE_CUBIN_CACHE), keyed by
the compilers' versions, the command and the bytes of the .cu file and of every header it includes in quotes
(transitively): a CI that runs again on the same sources skips the compile (ccache does not take -cubin).
Only the 36 most recently used compiles are kept. `--no-cache` compiles anyway.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime as _dt
import glob
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CU_FILES = ("csrc/attention/attention_kernels.cu", "csrc/cache/cache_kernels.cu", "csrc/mla/mla_kernels.cu")


# ---- per-kernel budgets (the targets of issue #23 made concrete) ---------------------------------------
@dataclasses.dataclass(frozen=True)
class KernelBudget:
    block: int | str            # threads per CTA at launch: a number, or a constexpr int of the kernel's .cu file
    max_registers: int          # registers per thread the kernel may use
    why: str                    # why that budget
    decode: bool = False        # reads KV pages in a decode step: 128-bit loads and the bytes-in-flight target apply
    prefill: bool = False       # serves prefill tasks: tensor-core instructions (HMMA / HGMMA) are expected
    block_note: str = ""        # where the block size comes from, when the launcher picks it at run time
    async_group_keys: int = 0   # keys whose K and V rows one cp.async group copies (a pipeline stage), if any


KERNEL_BUDGETS: dict[str, KernelBudget] = {
    # attention_kernel serves decode (split-K tasks), and the prefill tasks prefill_mma_kernel does not take
    # (attention_kernels.cu: mma_prefill): fp32 queries, head_dim > 128 or not a multiple of 16, Hadamard-
    # rotated pages, an fp16 query over quantized pages.
    "attention_kernel": KernelBudget(
        "kThreads", 168, decode=True, async_group_keys=16,
        why="__launch_bounds__(128, 3): 168 regs keeps 3 CTAs (12 warps) per SM. The cp.async ring, not the "
            "registers, holds the bytes in flight: 12-16 KB per CTA, 36-48 KB per SM at 3 CTAs, over the 32 KB "
            "sm_90 target. (At 128, ptxas spilled the int4 / KIVI instances on sm_90a.)"),
    # prefill_mma_kernel: prefill tasks of bf16 / fp16 queries on tensor cores (FlashAttention-2's scheme).
    "prefill_mma_kernel": KernelBudget(
        "kThreads", 255, prefill=True,
        why="FlashAttention-2's register tiles at head_dim 128: O (64 fp32), Q's A fragments (32) and a 16 x 64 "
            "S block (32) per lane; 2 CTAs (8 warps) per SM, as FlashAttention-2 runs. It must not spill"),
    "merge_partials_kernel": KernelBudget(
        "kThreads", 64, why="streams partial states once: 64 regs keeps 32 warps/SM for latency hiding"),
    "merge_states_kernel": KernelBudget(
        "kMergeThreads", 32, why="one CTA per row: 32 regs is full occupancy (64 warps/SM)"),
    # mla_attention_kernel<latent, rope, MlaShape<...>>: the MLA calls mla_mma_kernel does not take (mla_kernels.cu:
    # mla_mma): fp32 or quantized pools, a query of another dtype than the pools', widths off its grid. Its
    # cp.async stages copy the shape's keys (8 at DeepSeek-V3's 512 / 64, 4 up to 1024 / 256) of latent + rope
    # rows; async_group_bytes reads the instance's.
    "mla_attention_kernel": KernelBudget(
        "kThreads", 168, decode=True, async_group_keys=8,
        why="__launch_bounds__(128, 3): 168 regs keeps 3 CTAs (12 warps) per SM, with 2 query heads per warp "
            "(latent and rope dims in pairs per lane: 74 floats). The cp.async ring holds the bytes in flight: "
            "16-18 KB per CTA at 512 / 64, about 50 KB per SM"),
    # mla_mma_kernel<T>: MLA decode and prefill over bf16 / fp16 pools on tensor cores, 16 query heads as mma's M
    # (as FlashMLA); stages of 16 keys' latent + rope rows, double-buffered.
    "mla_mma_kernel": KernelBudget(
        "kThreads", 168, decode=True, prefill=True, async_group_keys=16,
        why="__launch_bounds__(128, 3): 168 regs keeps 3 CTAs per SM. Per lane: a quarter of O at 512 latent dims "
            "(64 fp32), Q's A fragments (36), S (8). Two 18.5 KB stages per CTA: one in flight while the other "
            "is read, 55 KB per SM at 3 CTAs"),
    "append_kernel": KernelBudget("kThreads", 32, why="a copy: full occupancy (64 warps/SM) needs <= 32 regs"),
    "gather_padded_kernel": KernelBudget(
        128, 32, why="a copy: full occupancy needs <= 32 regs",
        block_note="min(max(head_dim, v_head_dim), 256): 128 for head_dim 128"),
    "gather_ragged_kernel": KernelBudget(
        128, 32, why="a copy: full occupancy needs <= 32 regs",
        block_note="min(max(head_dim, v_head_dim), 256): 128 for head_dim 128"),
    "copy_blocks_kernel": KernelBudget("kThreads", 32, why="a copy: full occupancy needs <= 32 regs"),
    "append_quantized_kernel": KernelBudget(
        "kThreads", 64, why="a row per warp with a warp reduction: 64 regs keeps 32 warps/SM"),
    "append_kivi_key_kernel": KernelBudget(
        "kThreads", 64, why="a page per warp with warp reductions: 64 regs keeps 32 warps/SM"),
    "gather_dequantized_kernel": KernelBudget(
        "kThreads", 64, why="element-wise dequantization: 64 regs keeps 32 warps/SM"),
    "gather_rotated_kernel": KernelBudget(
        "kThreads", 96, why="holds a 256-dim row in registers (8 floats per lane) for the inverse Hadamard "
                            "transform: 96 regs still keeps 20 warps/SM"),
}

# Bytes-in-flight targets per SM from issue #23 (modelled): enough outstanding loads to cover DRAM latency.
IN_FLIGHT_TARGET_BYTES = {"sm_80": 20 * 1024, "sm_90a": 32 * 1024}


# ---- documented per-SM limits -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SmLimits:
    registers_per_sm: int
    register_alloc_unit: int     # registers per warp are rounded up to this
    sub_partitions: int          # registers are allocated per SM sub-partition (4 per SM)
    max_registers_per_thread: int
    max_warps_per_sm: int
    max_ctas_per_sm: int
    smem_per_sm: int             # the largest shared-memory carveout, bytes
    smem_alloc_unit: int
    smem_reserved_per_cta: int   # shared memory the driver reserves per CTA
    dram_bytes_per_s: float      # datasheet peak, for the roofline (modelled)
    fp32_flops: float            # datasheet peak of the CUDA cores (non-tensor) FP32
    sm_count: int
    part: str
    clock_hz: float              # datasheet boost clock, for the issue bound
    tensor_flops: float          # datasheet peak of the tensor cores, dense bf16 / fp16 with fp32 accumulation
    issue_per_cycle: int = 4     # warp instructions an SM issues per cycle (one per sub-partition scheduler)


# CUDA C++ Programming Guide, "Compute Capabilities" / "Technical Specifications per Compute Capability":
# 64K 32-bit registers per SM, 255 registers per thread, 64 resident warps and 32 resident CTAs per SM for
# both 8.0 and 9.0; at most 164 KB shared memory per SM on 8.0 and 228 KB on 9.0 (1 KB of it reserved per
# CTA). The allocation granularities (256 registers per warp, 4 sub-partitions, 128 B of shared memory)
# are those of the CUDA occupancy calculator, include/cuda_occupancy.h of the toolkit (cases 8 and 9).
# Peak DRAM bandwidth, FP32 and dense bf16 tensor rates, SM count and boost clock are the A100 SXM4 80GB
# and H100 SXM5 datasheet figures; one warp instruction per cycle per SM sub-partition is the issue rate of
# both architectures' schedulers (the A100 / H100 architecture whitepapers).
SM_LIMITS = {
    "sm_80": SmLimits(65536, 256, 4, 255, 64, 32, 164 * 1024, 128, 1024,
                      2039e9, 19.5e12, 108, "A100 SXM4 80GB", 1410e6, 312e12),
    "sm_90a": SmLimits(65536, 256, 4, 255, 64, 32, 228 * 1024, 128, 1024,
                       3352e9, 66.9e12, 132, "H100 SXM5", 1980e6, 989e12),
}

SASS_NOT_RUN = "not run (no cuobjdump)"


# ---- the build flags of CMakeLists.txt --------------------------------------------------------------------
@dataclasses.dataclass
class BuildFlags:
    archs: list[str]
    args: list[str]       # everything but the architecture and the file


def cmake_build_flags(cmakelists: str) -> BuildFlags:
    """The nvcc flags CMakeLists.txt gives the _C target's CUDA sources (Release build)."""
    archs = re.search(r'set\(KVCACHE_CUDA_ARCHS "([^"]+)"\)', cmakelists).group(1).split(";")
    std = re.search(r"set\(CMAKE_CUDA_STANDARD (\d+)\)", cmakelists).group(1)
    cuda_options = re.search(r"\$<\$<COMPILE_LANGUAGE:CUDA>:([^>]+)>", cmakelists).group(1).split()
    includes = re.search(r"target_include_directories\(_C PRIVATE (\S+)\)", cmakelists).group(1).split()
    defines = re.findall(r"target_compile_definitions\(_C PRIVATE (KVCACHE_WITH_CUDA=\d)\)", cmakelists)
    args = [f"-std=c++{std}", "-O3", "-DNDEBUG", "-Xcompiler=-fPIC"]  # CMake's Release flags, a module's PIC
    args += [f"-I{d}" for d in includes] + [f"-D{d}" for d in defines]  # -I relative: nvcc runs in the repo root
    args += [f'-DKVCACHE_CUDA_ARCHS="{",".join(archs)}"'] + cuda_options
    return BuildFlags([f"sm_{a}" for a in archs], args)


def gencode(arch: str) -> str:
    number = arch.removeprefix("sm_")
    return f"arch=compute_{number},code={arch}"


# ---- ptxas --resource-usage ---------------------------------------------------------------------------
@dataclasses.dataclass
class KernelResources:
    mangled: str
    arch: str
    registers: int = 0
    stack_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    smem_bytes: int = 0
    lmem_bytes: int = 0       # older ptxas report "N bytes lmem"; kept when present
    barriers: int = 0

    @property
    def uses_local_memory(self) -> bool:
        return self.stack_bytes > 0 or self.spill_store_bytes > 0 or self.spill_load_bytes > 0 or self.lmem_bytes > 0


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(\w+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SIZES = {"smem_bytes": re.compile(r"(\d+) bytes smem"), "lmem_bytes": re.compile(r"(\d+) bytes lmem"),
          "barriers": re.compile(r"used (\d+) barriers")}


def parse_ptxas(text: str) -> dict[str, KernelResources]:
    """Kernels (entry functions) of ptxas -v output, by mangled name. Non-entry functions are skipped."""
    kernels: dict[str, KernelResources] = {}
    current: KernelResources | None = None
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            current = kernels.setdefault(m.group(1), KernelResources(m.group(1), m.group(2)))
        elif m := _PROPERTIES.search(line):
            current = kernels.get(m.group(1))  # a device function's properties belong to no kernel
        elif current is None:
            continue
        elif m := _FRAME.search(line):
            current.stack_bytes, current.spill_store_bytes, current.spill_load_bytes = map(int, m.groups())
        elif m := _USED.search(line):
            current.registers = int(m.group(1))
            for field, pattern in _SIZES.items():
                if s := pattern.search(line):
                    setattr(current, field, int(s.group(1)))
    return kernels


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> readable names through c++filt (one process for all); names stay mangled without it."""
    if not names or shutil.which("c++filt") is None:
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def short_name(demangled: str) -> str:
    """'kvcache::cuda::(anonymous namespace)::attention_kernel<float, float>(args...)' -> 'attention_kernel<float, float>'."""
    name = re.sub(r"kvcache::(cuda::)?(\(anonymous namespace\)::)?", "", demangled)
    name = name.removeprefix("void ")  # template instances carry their return type
    depth = 0
    for i, ch in enumerate(name):  # cut the parameter list: the first '(' outside template brackets
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0:
            return name[:i]
    return name


def base_name(name: str) -> str:
    return re.split(r"[<(]", name, maxsplit=1)[0]


# ---- SASS ---------------------------------------------------------------------------------------------
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_FUNCTION = re.compile(r"^\s*Function : (\S+)")
_REGISTER = re.compile(r"(?<![A-Z0-9_])R(\d+)(\.64)?")
LOAD_WIDTH_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
WIDTH_LABEL = {1: "8", 2: "16", 4: "32", 8: "64", 16: "128"}
MMA_OPCODES = ("HMMA", "HGMMA", "IMMA", "IGMMA", "QGMMA", "BMMA")
DIV64_HELPER = re.compile(r"(div|rem)_[su]64")


@dataclasses.dataclass
class Instruction:
    address: int
    opcode: str        # with modifiers, e.g. LDG.E.U16
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def parse_sass(text: str) -> dict[str, list[Instruction]]:
    """cuobjdump -sass output: each function's instructions, by mangled name."""
    functions: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in text.splitlines():
        if m := _FUNCTION.match(line):
            current = functions.setdefault(m.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current.append(Instruction(int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return functions


def load_bytes(opcode: str) -> int:
    """Bytes per thread of a load from its modifiers (no width modifier: 32 bits)."""
    for modifier in opcode.split(".")[1:]:
        if modifier in LOAD_WIDTH_BYTES:
            return LOAD_WIDTH_BYTES[modifier]
    return 4


def elf_call_targets(cubin: bytes) -> dict[str, dict[int, str]]:
    """Named subroutines of each kernel: {mangled kernel: {offset in its .text section: name}} from the
    cubin's symbol table (cuobjdump prints calls as bare offsets; the helpers are local function symbols)."""
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]

    def string(table: int, offset: int) -> str:
        start = sections[table][4] + offset
        return cubin[start:cubin.index(b"\0", start)].decode()

    section_names = [string(shstrndx, s[0]) for s in sections]
    targets: dict[str, dict[int, str]] = {}
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        for offset in range(sh[4], sh[4] + sh[5], 24):
            name_at, info, _other, shndx, value, _size = struct.unpack_from("<IBBHQQ", cubin, offset)
            name = string(sh[6], name_at)
            if info & 0xF == 2 and name.startswith("$") and shndx < shnum:  # STT_FUNC, a compiler helper
                kernel = section_names[shndx].removeprefix(".text.")
                targets.setdefault(kernel, {})[value] = re.sub(r"^\$__internal_\d+_\$", "", name)
    return targets


def sass_counts(instructions: list[Instruction], call_names: dict[int, str]) -> dict:
    """What the checks read from one kernel's SASS."""
    global_loads = {label: 0 for label in WIDTH_LABEL.values()}
    async_copies: dict[str, int] = {}
    calls: dict[str, int] = {}
    counts = {"generic_loads": 0, "local_loads": 0, "local_stores": 0, "mma": {}, "tma": 0}
    for ins in instructions:
        if ins.base == "LDG":
            global_loads[WIDTH_LABEL[load_bytes(ins.opcode)]] += 1
        elif ins.base == "LDGSTS":
            label = WIDTH_LABEL[load_bytes(ins.opcode)]
            async_copies[label] = async_copies.get(label, 0) + 1
        elif ins.base == "LD":
            counts["generic_loads"] += 1
        elif ins.base == "LDL":
            counts["local_loads"] += 1
        elif ins.base == "STL":
            counts["local_stores"] += 1
        elif ins.base in MMA_OPCODES:
            counts["mma"][ins.base] = counts["mma"].get(ins.base, 0) + 1
        elif ins.base in ("UTMALDG", "UBLKCP"):
            counts["tma"] += 1
        elif ins.base == "CALL":
            target = re.search(r"0x([0-9a-f]+)", ins.operands)
            # an unnamed target is a block of the kernel itself (ptxas calls an EXIT to leave under a predicate)
            name = call_names.get(int(target.group(1), 16), "(own block)") if target else ins.operands
            calls[name] = calls.get(name, 0) + 1
    counts.update(global_loads=global_loads, async_copies=async_copies, calls=calls,
                  div64_calls=sum(n for name, n in calls.items() if DIV64_HELPER.search(name)),
                  async_groups_in_flight=async_groups_in_flight(instructions),
                  loads_in_flight=loads_in_flight(instructions), streaming_loop=streaming_loop(instructions))
    return counts


def loop_ranges(instructions: list[Instruction]) -> dict[int, int]:
    """Every loop of the SASS: its head (a backward branch's target) -> the address of its last backward branch."""
    loop_ends: dict[int, int] = {}
    for ins in instructions:
        if ins.base == "BRA" and (t := re.search(r"0x([0-9a-f]+)", ins.operands)) and int(t.group(1), 16) < ins.address:
            head = int(t.group(1), 16)
            loop_ends[head] = max(loop_ends.get(head, 0), ins.address)
    return loop_ends


def innermost_loops(instructions: list[Instruction]) -> list[tuple[int, int]]:
    """(first, last) addresses of the innermost loops: a backward branch's range that holds no other."""
    loop_ends = loop_ranges(instructions)
    return [(s, e) for s, e in loop_ends.items() if not any(s < s2 <= e and e2 <= e for s2, e2 in loop_ends.items()
                                                           if (s2, e2) != (s, e))]


def streaming_loop(instructions: list[Instruction]) -> dict:
    """The innermost loops that load from global memory (a decode kernel's passes over its keys: K, V, their
    scales), taken together as one pass: their instructions (every instruction of each body once: a branch
    inside makes this an upper bound) and the bytes their global loads fetch per thread. The issue bound of
    the roofline reads it: a warp issues `instructions` to stream 32 x `bytes_per_thread` bytes."""
    loops = []
    for start, end in sorted(innermost_loops(instructions)):
        body = [ins for ins in instructions if start <= ins.address <= end]
        loaded = sum(load_bytes(ins.opcode) for ins in body if ins.base in ("LDG", "LDGSTS"))
        if loaded:
            loops.append((start, end, len(body), loaded))
    return {"instructions": sum(n for _, _, n, _ in loops), "bytes_per_thread": sum(b for *_, b in loops),
            "loops": [f"0x{s:04x}-0x{e:04x}" for s, e, _, _ in loops]}


def mma_loop(instructions: list[Instruction], inner_trips: float = 1.0) -> dict:
    """The smallest loop that holds every MMA instruction of the kernel (a prefill kernel's pass over a tile
    of keys; ptxas may rotate a loop so that a smaller one holds only some of them): its instructions per
    pass, each loop inside it (staging the tile) counted `inner_trips` times, and its MMAs. Empty when no
    loop holds them all."""
    total_mma = sum(1 for ins in instructions if ins.base in MMA_OPCODES)
    loop_ends = loop_ranges(instructions)
    for start, end in sorted(loop_ends.items(), key=lambda se: se[1] - se[0]):
        body = [ins for ins in instructions if start <= ins.address <= end]
        mma = sum(1 for ins in body if ins.base in MMA_OPCODES)
        if not mma or mma < total_mma:
            continue
        inner = [(s2, e2) for s2, e2 in loop_ends.items() if start <= s2 and e2 <= end and (s2, e2) != (start, end)]
        inner = [(s2, e2) for s2, e2 in inner if not any(s3 <= s2 and e2 <= e3 and (s3, e3) != (s2, e2) for s3, e3 in inner)]
        in_inner = sum(1 for ins in body if any(s2 <= ins.address <= e2 for s2, e2 in inner))
        return {"instructions": round(len(body) - in_inner + inner_trips * in_inner), "mma": mma,
                "loop": f"0x{start:04x}-0x{end:04x}", "inner_loops": len(inner), "inner_trips": inner_trips}
    return {"instructions": 0, "mma": 0, "loop": "", "inner_loops": 0, "inner_trips": inner_trips}


def async_groups_in_flight(instructions: list[Instruction]) -> int:
    """cp.async groups a thread keeps in flight in its streaming loop: N + 1 for the largest
    `DEPBAR.LE SB0, N` (cp.async.wait_group N) inside a loop of a kernel that has LDGSTS; 0 without LDGSTS."""
    if not any(ins.base == "LDGSTS" for ins in instructions):
        return 0
    loop_ends = loop_ranges(instructions)
    best = 0
    for ins in instructions:
        m = re.match(r"SB0,\s*0x([0-9a-f]+)", ins.operands) if ins.opcode.startswith("DEPBAR.LE") else None
        if m and any(s <= ins.address <= e for s, e in loop_ends.items()):
            best = max(best, int(m.group(1), 16) + 1)
    return best


def loads_in_flight(instructions: list[Instruction]) -> dict:
    """Static estimate of one thread's outstanding global-load bytes inside loops.

    Within a straight-line run of a loop body (a backward branch's range), global loads are counted from
    one to the next until an instruction reads a register one of them writes: the bytes pending at that
    first use are what the thread has in flight while it waits. The largest such group over the innermost
    loops (the streaming loops; an outer loop's set-up loads are not counted)."""
    # innermost loops only: an outer loop's per-pass set-up (task fields, lengths) is not the streaming loop
    loops = innermost_loops(instructions)
    targets = {start for start, _ in loops} | {int(t.group(1), 16) for ins in instructions if ins.base == "BRA"
                                               and (t := re.search(r"0x([0-9a-f]+)", ins.operands))}
    best = {"bytes_per_thread": 0, "loads": 0, "at": None}
    pending: dict[int, int] = {}   # register -> bytes of the load writing it
    group_loads, group_start = 0, None

    def close() -> None:
        nonlocal group_loads, group_start
        total = sum(pending.values())
        if total > best["bytes_per_thread"] and any(s <= group_start <= e for s, e in loops):
            best.update(bytes_per_thread=total, loads=group_loads, at=f"0x{group_start:04x}")
        pending.clear()
        group_loads, group_start = 0, None

    for ins in instructions:
        if ins.base in ("BRA", "EXIT", "RET", "CALL", "BAR", "BSYNC", "WARPSYNC"):
            close()
            continue
        if ins.address in targets:  # another path joins here: a new group
            close()
        registers = [(int(r), wide) for r, wide in _REGISTER.findall(ins.operands)]
        writes_first = not ins.base.startswith(("ST", "RED"))  # stores only read their operands
        sources = registers[1:] if writes_first else registers
        read = {r + k for r, wide in sources for k in range(2 if wide else 1)}
        if pending and read & pending.keys():
            close()
        if ins.base == "LDG" and registers:
            size = load_bytes(ins.opcode)
            first = registers[0][0]
            words = max(1, size // 4)
            for k in range(words):
                pending[first + k] = size / words
            group_start = ins.address if group_start is None else group_start
            group_loads += 1
    close()
    return best


# ---- occupancy and the bytes-in-flight model (modelled, not measured) --------------------------------------
def round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def occupancy(res: KernelResources, block: int, lim: SmLimits) -> dict:
    """CTAs and warps per SM as the CUDA occupancy calculator computes them (cuda_occupancy.h)."""
    warps_per_cta = -(-block // 32)
    limits = {"warps": lim.max_warps_per_sm // warps_per_cta, "ctas": lim.max_ctas_per_sm}
    regs_per_warp = round_up(max(res.registers, 1) * 32, lim.register_alloc_unit)
    if regs_per_warp * round_up(warps_per_cta, lim.sub_partitions) > lim.registers_per_sm:
        limits["registers"] = 0
    else:
        warps_per_partition = (lim.registers_per_sm // lim.sub_partitions) // regs_per_warp
        limits["registers"] = warps_per_partition * lim.sub_partitions // warps_per_cta
    smem_per_cta = round_up(res.smem_bytes + lim.smem_reserved_per_cta, lim.smem_alloc_unit)
    limits["shared memory"] = lim.smem_per_sm // smem_per_cta
    ctas = min(limits.values())
    return {"block": block, "ctas_per_sm": ctas, "warps_per_sm": ctas * warps_per_cta,
            "occupancy": ctas * warps_per_cta / lim.max_warps_per_sm,
            "limited_by": [k for k, v in limits.items() if v == ctas], "limits": limits}


MODEL_ASSUMPTIONS = [
    "Occupancy: the CUDA occupancy calculator's rules (cuda_occupancy.h) with the documented per-SM limits, the "
    "largest shared-memory carveout, no dynamic shared memory (every launch passes 0), block sizes of the "
    "launchers (head_dim 128 where the launcher derives it from head_dim).",
    "Bytes in flight per SM (Little's law) = resident warps/SM x 32 lanes x outstanding global-load bytes per "
    "thread. Outstanding bytes per thread: the largest group of global loads a thread issues inside an "
    "innermost loop of the kernel's SASS before it first reads one of their results (a static estimate: every resident warp "
    "is assumed to sit in that loop with the group in flight at once, all lanes active).",
    "Kernels that stream KV through a cp.async ring (LDGSTS; attention_kernel's decode pipeline): each thread "
    "also has in flight the groups its wait leaves pending plus the one it is waiting for (cp.async.wait_group N, "
    "SASS DEPBAR.LE SB0, N inside a loop: N + 1 groups) x the bytes of one group per thread (the kernel's keys "
    "per group x K and V row bytes at head_dim 128 / threads per CTA); the larger of that and the LDG estimate.",
    "Targets: 20 KB/SM on sm_80 and 32 KB/SM on sm_90 (issue #23), the bytes needed in flight to cover "
    "DRAM latency at full bandwidth. Modelled attainable bandwidth = peak x min(1, in flight / target).",
    "Roofline of a decode step (a GQA group of 4 query heads per KV head, at the kernel's KV element size: "
    "4 x 4 x head_dim flops per key over its K and V bytes), in KV bytes per second for the whole GPU, the "
    "least of four bounds: bandwidth = the datasheet DRAM peak; latency = bytes in flight per SM x SMs / the "
    "DRAM latency the issue's targets imply (target x SMs / peak: 1.08 us on A100, 1.29 us on H100), i.e. "
    "peak x in flight / target; issue = SMs x 4 warp instructions per cycle x boost clock x the bytes a warp's "
    "streaming loops load per pass (32 lanes, all active) / their instructions per pass (the innermost loops "
    "with global loads, taken as one pass over a chunk of keys; every instruction of a body counted once, so an "
    "upper bound on the instructions and a lower bound on this rate, and the loops' own work only: set-up and "
    "reductions outside them are not counted); compute = the peak of the units the SASS uses (tensor cores when it has an MMA "
    "instruction, else the FP32 CUDA cores) / flops per byte. Efficiency = the least bound / the DRAM peak.",
    "Prefill: prefill_mma_kernel takes the prefill tasks of bf16 / fp16 queries on tensor cores (its compute "
    "roof: the dense bf16 / fp16 tensor-core peak, 312 TFLOP/s A100, 989 H100), and mla_mma_kernel MLA decode "
    "and prefill over bf16 / fp16 pools of the query's dtype (16 query heads as mma's M). The shapes they do not "
    "take (attention_kernel: fp32 queries, head_dim > 128 or not a multiple of 16, rotated pages, an fp16 query "
    "over quantized pages; mla_attention_kernel: fp32 or quantized MLA pools, other widths) run on the FP32 CUDA "
    "cores, whose roof is 19.5 / 312 = 6.3% (A100) and 66.9 / 989 = 6.8% (H100) of the tensor cores'.",
]

KV_ELEMENT_BYTES = {"float": 4, "__half": 2, "__nv_bfloat16": 2, "signed char": 1, "Fp8E4M3": 1, "Fp8E5M2": 1,
                    "Coded": 1,
                    "Int4": 0.5, "Kivi<4, true>": 0.5, "Kivi<4, false>": 0.5, "Kivi<2, true>": 0.25,
                    "Kivi<2, false>": 0.25}
GQA_GROUP = 4


def kv_element_bytes(name: str) -> float:
    """KV bytes per element of a kernel instance, from its template arguments (2, bf16, otherwise)."""
    m = re.search(r"<(.*)>$", name)
    if not m:
        return 2.0
    args = [a.strip() for a in re.split(r",\s*(?![^<]*>)", m.group(1))]
    sizes = [KV_ELEMENT_BYTES[a] for a in args if a in KV_ELEMENT_BYTES]
    return sum(sizes) / len(sizes) if sizes else 2.0


MLA_MMA_MAX_WIDTHS = (512, 64)  # mla_kernels.cu: kMmaMaxLatent, kMmaMaxRope


def async_group_bytes(name: str, budget: KernelBudget) -> float:
    """Bytes one cp.async group (a pipeline stage) of a kernel instance copies: keys x (K row + V row). An MLA
    instance (MlaShape<latent, rope, keys, rows>) copies `keys` latent + rope rows at the shape's widths (a
    Coded side at 1 byte per value: int8 / fp8, the widest code); attention_kernel its budget's keys x K + V rows
    at head_dim 128; mla_mma_kernel the budget's keys x its widest latent + rope rows."""
    if name.startswith("mla_mma_kernel<"):  # a stage of the budget's keys at the kernel's widest rows
        return budget.async_group_keys * sum(MLA_MMA_MAX_WIDTHS) * kv_element_bytes(name)
    shape = re.search(r"MlaShape<(\d+), (\d+), (\d+), \d+>", name)
    if shape:
        latent, rope, keys = (int(x) for x in shape.groups())
        args = [a.strip() for a in re.split(r",\s*(?![^<]*>)", re.search(r"<(.*)>$", name).group(1))][:2]
        sizes = [KV_ELEMENT_BYTES.get(a, 4.0) for a in args]
        return keys * (latent * sizes[0] + rope * sizes[1])
    return budget.async_group_keys * kv_row_bytes(name)


def kv_row_bytes(name: str, head_dim: int = 128) -> float:
    """Bytes of one K row plus one V row of a kernel instance at head_dim, from its first two template arguments."""
    m = re.search(r"<(.*)>$", name)
    args = [a.strip() for a in re.split(r",\s*(?![^<]*>)", m.group(1))][:2] if m else []
    sizes = [KV_ELEMENT_BYTES[a] for a in args if a in KV_ELEMENT_BYTES]
    return head_dim * (sum(sizes) if len(sizes) == 2 else 4.0)


def in_flight_model(row: dict, lim: SmLimits, arch: str, budget: KernelBudget | None = None) -> dict:
    """Little's-law bytes in flight per SM and the roofline of a decode kernel (see MODEL_ASSUMPTIONS)."""
    sass = row["sass"]
    per_thread = sass["loads_in_flight"]["bytes_per_thread"]
    groups = sass.get("async_groups_in_flight", 0)
    async_per_thread = 0.0
    if groups and budget and budget.async_group_keys:
        async_per_thread = groups * async_group_bytes(row["name"], budget) / row["occupancy"]["block"]
    per_thread = max(per_thread, async_per_thread)
    warps = row["occupancy"]["warps_per_sm"]
    per_sm = warps * 32 * per_thread
    target = IN_FLIGHT_TARGET_BYTES[arch]
    fraction = min(1.0, per_sm / target)
    kv_bytes = kv_element_bytes(row["name"])
    intensity = GQA_GROUP * 4 / (2 * kv_bytes)  # flops per byte: 4 x 4 x D flops over 2 x D x bytes
    loop = sass["streaming_loop"]
    tensor = bool(sass["mma"])
    compute_peak = lim.tensor_flops if tensor else lim.fp32_flops
    latency_s = target * lim.sm_count / lim.dram_bytes_per_s
    bounds = {
        "bandwidth": lim.dram_bytes_per_s,
        "latency": per_sm * lim.sm_count / latency_s,
        "issue": (lim.sm_count * lim.issue_per_cycle * lim.clock_hz * 32 * loop["bytes_per_thread"] / loop["instructions"]
                  if loop["instructions"] else 0.0),
        "compute": compute_peak / intensity,
    }
    bound = min(bounds, key=bounds.get)
    attainable = bounds[bound]
    return {"bytes_per_thread": per_thread, "async_groups": groups, "async_bytes_per_thread": async_per_thread,
            "warps_per_sm": warps, "bytes_per_sm": per_sm, "target_bytes": target,
            "bandwidth_fraction": fraction, "attainable_bytes_per_s": attainable,
            "arithmetic_intensity": intensity, "attainable_flops": attainable * intensity,
            "bound": bound, "bounds_bytes_per_s": bounds, "dram_latency_s": latency_s,
            "compute_units": "tensor" if tensor else "fp32", "streaming_loop": loop,
            "efficiency": attainable / lim.dram_bytes_per_s}


# Cycles a sub-partition's tensor core takes per mma.m16n8k16 (2,048 FMAs) at the datasheet dense rate:
# A100 312 TFLOP/s / (108 SMs x 4 x 1.41 GHz) = 512 FLOP per cycle -> 8; H100 989 / (132 x 4 x 1.98 GHz) = 946
# FLOP per cycle -> 4.3 (mma.sync is not H100's full-rate path, wgmma is: an upper bound there).
MMA_CYCLES = {"sm_80": 4096 / (312e12 / (108 * 4 * 1410e6)), "sm_90a": 4096 / (989e12 / (132 * 4 * 1980e6))}


def prefill_model(row: dict, instructions: list[Instruction], lim: SmLimits, arch: str) -> dict:
    """Modelled prefill efficiency (fraction of the dense tensor-core peak): with MMA instructions, the
    tensor cores are busy at most MMA_CYCLES x MMAs per instruction issued in the loop that holds them (one
    warp instruction per cycle per sub-partition; the loop's other instructions share the issue slots); without
    them, the FP32 cores' share of the tensor peak (a bound the kernel cannot exceed)."""
    # the tile's staging loops run (64 keys x 128 dims x the KV element size / 16 B per unit) / 128 threads
    # times per pass at head_dim 128: 4 x the element size
    kv_args = re.search(r"<(.*)>$", row["name"])
    kv = [KV_ELEMENT_BYTES[a.strip()] for a in re.split(r",\s*(?![^<]*>)", kv_args.group(1))[:2]] if kv_args else [2]
    loop = mma_loop(instructions, inner_trips=4 * sum(kv) / len(kv))
    if loop["mma"]:
        fraction = min(1.0, MMA_CYCLES[arch] * loop["mma"] / loop["instructions"])
        return {"units": "tensor", "mma_loop": loop, "mma_cycles": MMA_CYCLES[arch], "efficiency": fraction,
                "bound": "tensor peak" if fraction >= 1.0 else "issue"}
    return {"units": "fp32", "mma_loop": loop, "mma_cycles": MMA_CYCLES[arch],
            "efficiency": lim.fp32_flops / lim.tensor_flops, "bound": "fp32 cores"}


# ---- checks -----------------------------------------------------------------------------------------------
def run_checks(row: dict, budget: KernelBudget | None) -> dict[str, str]:
    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    sass = row["sass"]
    checks = {"no stack frame": verdict(row["stack_bytes"] == 0),
              "no spills": verdict(row["spill_store_bytes"] == 0 and row["spill_load_bytes"] == 0),
              "registers within budget": verdict(row["registers"] <= budget.max_registers) if budget else "n/a"}
    if sass is None:  # ptxas alone can still show local memory, never its absence from the SASS
        checks["no local memory"] = "FAIL" if row["local_memory"] else SASS_NOT_RUN
        checks["no 64-bit division calls"] = SASS_NOT_RUN
        decode, prefill = (budget.decode, budget.prefill) if budget else (False, False)
        checks["128-bit KV loads"] = SASS_NOT_RUN if decode else "n/a"
        checks["prefill has MMA"] = SASS_NOT_RUN if prefill else "n/a"
        checks["bytes in flight"] = SASS_NOT_RUN if decode else "n/a"
        checks["roofline modelled"] = SASS_NOT_RUN if decode else "n/a"
        return checks
    checks["no local memory"] = verdict(not row["local_memory"] and sass["local_loads"] + sass["local_stores"] == 0)
    checks["no 64-bit division calls"] = verdict(sass["div64_calls"] == 0)
    wide = sass["global_loads"]["128"] + sass["async_copies"].get("128", 0) + sass["tma"]
    checks["128-bit KV loads"] = verdict(wide > 0) if budget and budget.decode else "n/a"
    checks["prefill has MMA"] = verdict(bool(sass["mma"])) if budget and budget.prefill else "n/a"
    model = row.get("in_flight")
    checks["bytes in flight"] = verdict(model["bytes_per_sm"] >= model["target_bytes"]) if model else "n/a"
    # check 6: every decode kernel has its roofline, each of the four bounds a positive rate
    checks["roofline modelled"] = (verdict(model is not None and all(v > 0 for v in model["bounds_bytes_per_s"].values()))
                                   if budget and budget.decode else "n/a")
    return checks


# ---- tools ------------------------------------------------------------------------------------------------
def find_cuobjdump() -> str | None:
    """$KVCACHE_CUOBJDUMP, PATH, then a triton or nvidia-* wheel of this interpreter or of the project's venvs."""
    env = os.environ.get("KVCACHE_CUOBJDUMP")
    if env:
        return env if os.access(env, os.X_OK) else None
    if found := shutil.which("cuobjdump"):
        return found
    site_dirs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    site_dirs |= set(glob.glob(str(Path.home() / ".cache/kvcache/venv-*/lib/python3*/site-packages")))
    for site in sorted(site_dirs):
        for pattern in ("triton/backends/nvidia/bin/cuobjdump", "nvidia/*/bin/cuobjdump", "nvidia/cu*/bin/cuobjdump"):
            for candidate in sorted(glob.glob(os.path.join(site, pattern))):
                if os.access(candidate, os.X_OK):
                    return candidate
    return None


def tool_version(tool: str) -> str:
    out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if "release" in line]
    return lines[-1].strip() if lines else out.strip().splitlines()[-1]


_QUOTED_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.M)


def quoted_includes(source: Path, include_dirs: list[Path]) -> list[Path]:
    """source and every header it includes in quotes, transitively, each found beside its includer or under an
    include dir (as the preprocessor looks). Every quoted include counts, inside #if or not: a superset is safe
    for a cache key. Angle-bracket headers (CUDA's, the C++ library's) are covered by the compilers' versions."""
    seen: set[Path] = set()
    todo = [source.resolve()]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for name in _QUOTED_INCLUDE.findall(f.read_text()):
            found = next((d / name for d in (f.parent, *include_dirs) if (d / name).is_file()), None)
            if found is not None:
                todo.append(found.resolve())
    return sorted(seen)


def cubin_cache_key(compilers: str, args: list[str], sources: list[Path]) -> str:
    """What determines nvcc's output: the compilers' versions, the arguments, each source's path and bytes."""
    h = hashlib.sha256()
    for part in (compilers, *args):
        h.update(part.encode() + b"\0")
    for f in sources:
        h.update(str(f.relative_to(ROOT) if f.is_relative_to(ROOT) else f).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def default_cubin_cache() -> Path:
    return Path(os.environ.get("KVCACHE_CUBIN_CACHE") or Path.home() / ".cache" / "kvcache" / "cubins")


CUBIN_CACHE_ENTRIES = 36  # 6 compiles (3 files x 2 archs) per run: the last 6 runs' worth


def prune_cubin_cache(cache: Path, keep: int = CUBIN_CACHE_ENTRIES) -> int:
    """Deletes all but the `keep` most recently used entries (each a cubin and its report); returns how many
    went. Every source change adds entries, so without this the cache would only grow."""
    entries = sorted(cache.glob("*.cubin"), key=lambda p: p.stat().st_mtime, reverse=True)
    for cubin in entries[keep:]:
        cubin.with_suffix(".txt").unlink(missing_ok=True)
        cubin.unlink(missing_ok=True)
    return max(0, len(entries) - keep)


def compile_cubin(nvcc: str, source: Path, arch: str, flags: BuildFlags, out_dir: Path,
                  cache: Path | None = None, compilers: str = "") -> tuple[Path, str]:
    """Compiles one .cu file to a cubin; returns it and ptxas's resource report. With a cache directory, a
    compile of the same sources, arguments and compilers is read from it instead (and a new one is stored)."""
    args = ["-cubin", "-gencode", gencode(arch), "--resource-usage", *flags.args]
    if cache is not None:
        include_dirs = [ROOT / a.removeprefix("-I") for a in flags.args if a.startswith("-I")]
        key = cubin_cache_key(compilers, args, quoted_includes(source, include_dirs))
        cached, text = cache / f"{key}.cubin", cache / f"{key}.txt"
        if cached.is_file() and text.is_file():
            os.utime(cached)  # used: pruned last
            return cached, text.read_text()
    cubin = out_dir / f"{source.stem}.{arch}.cubin"
    cmd = [nvcc, "-o", str(cubin), *args, str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed for {source} ({arch}):\n{proc.stdout}{proc.stderr}")
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        for dst, data in ((text, (proc.stdout + proc.stderr).encode()), (cached, cubin.read_bytes())):
            part = dst.with_suffix(f".{os.getpid()}.part")  # written whole, then renamed: no half entry is read
            part.write_bytes(data)
            os.replace(part, dst)
    return cubin, proc.stdout + proc.stderr


def constexpr_ints(source: str) -> dict[str, int]:
    """`constexpr int kName = <integer expression>;` of a .cu file, evaluated in order (block sizes)."""
    values: dict[str, int] = {}
    for name, expr in re.findall(r"constexpr int (\w+) = ([^;]+);", source):
        expr = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: str(values.get(m.group(0), m.group(0))), expr)
        if re.fullmatch(r"[\d\s*+/()-]+", expr):
            values[name] = int(eval(expr, {"__builtins__": {}}))  # digits and operators only
    return values


def declared_kernels(source: str) -> list[str]:
    """Names of the __global__ functions a .cu file declares."""
    return re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", source)


# ---- the report ---------------------------------------------------------------------------------------------
def analyse_file(nvcc: str, cuobjdump: str | None, source: Path, arch: str, flags: BuildFlags,
                 work: Path, cache: Path | None = None, compilers: str = "") -> list[dict]:
    cubin, ptxas_text = compile_cubin(nvcc, source, arch, flags, work, cache, compilers)
    resources = parse_ptxas(ptxas_text)
    names = demangle(list(resources))
    functions, call_names = {}, {}
    if cuobjdump:
        sass_text = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                                   check=True).stdout
        functions = parse_sass(sass_text)
        call_names = elf_call_targets(cubin.read_bytes())
    constants = constexpr_ints(source.read_text())
    rows = []
    for mangled, res in resources.items():
        name = short_name(names[mangled])
        budget = KERNEL_BUDGETS.get(base_name(name))
        block = budget.block if budget else 128
        block = constants[block] if isinstance(block, str) else block
        lim = SM_LIMITS[arch]
        row = {"file": str(source.relative_to(ROOT)), "arch": arch, "name": name, "kernel": base_name(name),
               "mangled": mangled, "registers": res.registers, "stack_bytes": res.stack_bytes,
               "spill_store_bytes": res.spill_store_bytes, "spill_load_bytes": res.spill_load_bytes,
               "smem_bytes": res.smem_bytes, "barriers": res.barriers, "local_memory": res.uses_local_memory,
               "budget_registers": budget.max_registers if budget else None,
               "occupancy": occupancy(res, block, lim),
               "sass": sass_counts(functions[mangled], call_names.get(mangled, {})) if mangled in functions else None}
        if row["sass"] and budget and budget.decode:
            row["in_flight"] = in_flight_model(row, lim, arch, budget)
        if row["sass"] and budget and budget.prefill:
            row["prefill"] = prefill_model(row, functions[mangled], lim, arch)
        row["checks"] = run_checks(row, budget)
        rows.append(row)
    return rows


def kib(n: float) -> str:
    return f"{n / 1024:.1f} KB"


def loads_text(sass: dict | None) -> str:
    if sass is None:
        return "-"
    widths = " ".join(f"{w}:{n}" for w, n in sass["global_loads"].items() if n)
    copies = " ".join(f"ldgsts{w}:{n}" for w, n in sass["async_copies"].items())
    return " ".join(filter(None, [widths, copies])) or "none"


def calls_text(sass: dict | None) -> str:
    if sass is None:
        return "-"
    return ", ".join(f"{name.lstrip('_')} x{n}" for name, n in sorted(sass["calls"].items())) or "none"


def markdown(report: dict) -> str:
    rows = report["kernels"]
    out = [
        "# CUDA kernels: resources, SASS, occupancy (issue #23)",
        "",
        f"Generated by `python3 benchmarks/cuda_kernels.py` on {report['date']} in {report['seconds']:.0f} s. "
        "No GPU: every GPU figure below (occupancy, bytes in flight, bandwidth, flops) is **modelled, not "
        "measured**; registers, stack, spills and SASS counts are read from the compiler's output.",
        "",
    ]
    if report.get("updated_files"):
        out += [f"Updated (`--update`): only {', '.join(f'`{f}`' for f in report['updated_files'])} re-analysed; "
                f"the other files' rows are those of the run of {report['kept_from']}.", ""]
    out += [
        f"- nvcc: {report['toolchain']['nvcc']}; flags: `{' '.join(report['toolchain']['flags'])}`",
        f"- cuobjdump: {report['toolchain']['cuobjdump'] or SASS_NOT_RUN}",
        "",
        "## Modelled per-SM limits",
        "",
        "| arch | part | regs/SM | alloc unit | warps/SM | CTAs/SM | smem/SM | DRAM | FP32 | tensor (bf16) | "
        "boost clock | issue |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arch, lim in SM_LIMITS.items():
        out.append(f"| {arch} | {lim.part} | {lim.registers_per_sm} | {lim.register_alloc_unit}/warp | "
                   f"{lim.max_warps_per_sm} | {lim.max_ctas_per_sm} | {lim.smem_per_sm // 1024} KB | "
                   f"{lim.dram_bytes_per_s / 1e9:.0f} GB/s | {lim.fp32_flops / 1e12:.1f} TFLOP/s | "
                   f"{lim.tensor_flops / 1e12:.0f} TFLOP/s | {lim.clock_hz / 1e6:.0f} MHz | "
                   f"{lim.issue_per_cycle} warp instr./cycle |")
    out += ["", "Assumptions of the model:", ""] + [f"- {a}" for a in MODEL_ASSUMPTIONS]

    out += ["", "## Summary per kernel (worst template instance)", "",
            "| kernel | arch | inst. | regs (budget) | stack B | spill st/ld B | smem B | local mem | "
            "warps/SM (limit) | checks failed |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["arch"]), []).append(r)
    for (kernel, arch), group in groups.items():
        regs = sorted({r["registers"] for r in group})
        worst_occ = min(group, key=lambda r: r["occupancy"]["warps_per_sm"])["occupancy"]
        failed = sorted({c for r in group for c, v in r["checks"].items() if v == "FAIL"})
        regs_text = f"{regs[0]}" if len(regs) == 1 else f"{regs[0]}-{regs[-1]}"
        out.append(f"| {kernel} | {arch} | {len(group)} | {regs_text} ({group[0]['budget_registers']}) | "
                   f"{max(r['stack_bytes'] for r in group)} | {max(r['spill_store_bytes'] for r in group)}/"
                   f"{max(r['spill_load_bytes'] for r in group)} | {max(r['smem_bytes'] for r in group)} | "
                   f"{'yes' if any(r['local_memory'] for r in group) else 'no'} | {worst_occ['warps_per_sm']} "
                   f"({', '.join(worst_occ['limited_by'])}) | {', '.join(failed) or 'none'} |")

    out += ["", "## Bytes in flight and roofline of the decode kernels (modelled, not measured)", "",
            "Bounds in GB/s of KV read for the whole GPU (see the assumptions above); the least one binds. "
            "Streaming loops: their instructions per pass / the bytes each thread loads in it (innermost loops with "
            "global loads).", "",
            "| kernel | arch | B/thread in flight | warps/SM | in flight/SM | target | streaming loops | flop/B | "
            "bandwidth | latency | issue | compute | bound | modelled efficiency |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if m := r.get("in_flight"):
            b = {k: v / 1e9 for k, v in m["bounds_bytes_per_s"].items()}
            loop = m["streaming_loop"]
            out.append(f"| {r['name']} | {r['arch']} | {m['bytes_per_thread']:g} | {m['warps_per_sm']} | "
                       f"{kib(m['bytes_per_sm'])} | {kib(m['target_bytes'])} | {loop['instructions']} / "
                       f"{loop['bytes_per_thread']:g} B | {m['arithmetic_intensity']:g} | {b['bandwidth']:.0f} | "
                       f"{b['latency']:.0f} | {b['issue']:.0f} | {b['compute']:.0f} ({m['compute_units']}) | "
                       f"{m['bound']} | {m['efficiency']:.0%} |")
    if not any("in_flight" in r for r in rows):
        out.append(f"| - | - | {SASS_NOT_RUN} |" + " |" * 11)

    out += ["", "## Prefill (modelled, not measured)", "",
            "Share of the dense tensor-core peak a prefill kernel can reach: with MMA instructions, at most the "
            "tensor cores' cycles per mma.m16n8k16 (A100: 8, H100: 4.3) x the MMAs per instruction of the loop "
            "that holds them (one warp instruction issued per cycle per sub-partition); without, the FP32 cores' "
            "share of the tensor peak.", "",
            "| kernel | arch | units | loop | instructions | MMAs | bound | modelled efficiency |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if m := r.get("prefill"):
            loop = m["mma_loop"]
            out.append(f"| {r['name']} | {r['arch']} | {m['units']} | {loop['loop'] or '-'} | "
                       f"{loop['instructions'] or '-'} | {loop['mma'] or '-'} | {m['bound']} | {m['efficiency']:.1%} |")

    check_names = list(rows[0]["checks"]) if rows else []
    out += ["", "## Every instance", "",
            "Loads: global loads (LDG) by width in bits, LDGSTS async copies; calls: named SASS subroutines "
            "(the 64-bit integer division helpers are `cuda_sm20_div_s64` / `rem_s64` / `div_u64` / `rem_u64`).",
            "", "| kernel | arch | regs | stack | spill st/ld | smem | block | warps/SM | loads | LDL/STL | calls | "
            "MMA | " + " | ".join(check_names) + " |",
            "|" + "---|" * (12 + len(check_names))]
    for r in rows:
        s = r["sass"]
        local = "-" if s is None else f"{s['local_loads']}/{s['local_stores']}"
        mma = "-" if s is None else (" ".join(f"{k}:{v}" for k, v in s["mma"].items()) or "none")
        out.append(f"| {r['name']} | {r['arch']} | {r['registers']} | {r['stack_bytes']} | {r['spill_store_bytes']}/"
                   f"{r['spill_load_bytes']} | {r['smem_bytes']} | {r['occupancy']['block']} | "
                   f"{r['occupancy']['warps_per_sm']} | {loads_text(s)} | {local} | {calls_text(s)} | {mma} | "
                   + " | ".join(r["checks"][c] for c in check_names) + " |")

    out += ["", "## Register budgets", "", "| kernel | block | budget | why |", "|---|---|---|---|"]
    for kernel, b in KERNEL_BUDGETS.items():
        block = f"{b.block}" + (f" ({b.block_note})" if b.block_note else "")
        out.append(f"| {kernel} | {block} | {b.max_registers} | {b.why} |")
    totals = report["check_totals"]
    out += ["", f"Checks: {totals['PASS']} pass, {totals['FAIL']} fail, {totals['other']} not applicable or not run.",
            ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="output directory")
    parser.add_argument("--check", action="store_true", help="exit 1 if any check fails")
    parser.add_argument("--jobs", type=int, default=2, help="nvcc processes at once")
    parser.add_argument("--arch", action="append", help="only these architectures (default: CMakeLists.txt's)")
    parser.add_argument("--file", action="append", choices=CU_FILES, help="only these .cu files (default: all)")
    parser.add_argument("--no-cache", action="store_true",
                        help="compile every file, even when the cubin cache holds the same compile")
    parser.add_argument("--update", action="store_true",
                        help="with --file: re-analyse only those files and keep every other file's rows from the "
                             "stored cuda_kernels.json (the attention file alone takes most of an hour on 2 cores)")
    args = parser.parse_args(argv)
    if args.update and not args.file:
        parser.error("--update needs --file")

    start = time.perf_counter()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("nvcc not found on PATH", file=sys.stderr)
        return 2
    flags = cmake_build_flags((ROOT / "CMakeLists.txt").read_text())
    archs = args.arch or flags.archs
    cuobjdump = find_cuobjdump()
    cache = None if args.no_cache else default_cubin_cache()
    # nvcc's device compile runs the host compiler's preprocessor too: both versions, and the environment
    # variables nvcc reads, are in the cache key
    compilers = "\n".join([os.path.realpath(nvcc)] + [
        subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
        for tool in (nvcc, os.environ.get("NVCC_CCBIN") or "g++")] + [
        f"{v}={os.environ.get(v, '')}" for v in ("NVCC_CCBIN", "NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS")])
    with tempfile.TemporaryDirectory(prefix="kvcache-cubins-") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            # the attention file takes most of the time: start it first
            jobs = [pool.submit(analyse_file, nvcc, cuobjdump, ROOT / f, arch, flags, Path(tmp), cache, compilers)
                    for f in args.file or CU_FILES for arch in archs]
            rows = [row for job in jobs for row in job.result()]
    if cache is not None and cache.is_dir():
        prune_cubin_cache(cache)
    kept_from = None
    if args.update:
        stored = json.loads((args.out / "cuda_kernels.json").read_text())
        rows += [r for r in stored["kernels"] if r["file"] not in args.file]
        kept_from = stored.get("kept_from") or stored["date"]
    rows.sort(key=lambda r: (CU_FILES.index(r["file"]), r["kernel"], r["name"], r["arch"]))
    verdicts = [v for r in rows for v in r["checks"].values()]
    report = {
        "note": "modelled, not measured: no GPU ran these kernels",
        "date": _dt.date.today().isoformat(),
        "seconds": time.perf_counter() - start,
        "updated_files": args.file if args.update else None,
        "kept_from": kept_from,
        "toolchain": {"nvcc": tool_version(nvcc), "flags": flags.args,
                      "cuobjdump": f"{cuobjdump} ({tool_version(cuobjdump)})" if cuobjdump else None},
        "limits": {arch: dataclasses.asdict(lim) for arch, lim in SM_LIMITS.items()},
        "in_flight_targets": IN_FLIGHT_TARGET_BYTES,
        "assumptions": MODEL_ASSUMPTIONS,
        "budgets": {k: dataclasses.asdict(b) for k, b in KERNEL_BUDGETS.items()},
        "check_totals": {"PASS": verdicts.count("PASS"), "FAIL": verdicts.count("FAIL"),
                         "other": len(verdicts) - verdicts.count("PASS") - verdicts.count("FAIL")},
        "kernels": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cuda_kernels.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "cuda_kernels.md").write_text(markdown(report))
    totals = report["check_totals"]
    print(f"{len(rows)} kernel instances, checks: {totals['PASS']} pass, {totals['FAIL']} fail; "
          f"{report['seconds']:.0f} s; wrote {args.out / 'cuda_kernels.md'}")
    return 1 if args.check and totals["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
