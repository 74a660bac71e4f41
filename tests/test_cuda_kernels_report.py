"""The parsers of benchmarks/cuda_kernels.py (the static CUDA kernel report), on real nvcc output and on a
fixed sample. Standard library only: runs under plain `python3 -m pytest --noconftest` as well (the suite's
conftest imports torch)."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("cuda_kernels_report", ROOT / "benchmarks" / "cuda_kernels.py")
report = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = report  # dataclasses look their module up by name
_spec.loader.exec_module(report)

PTXAS_SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_80'
ptxas info    : Function properties for _Z6kernelPf
    480 bytes stack frame, 72 bytes spill stores, 112 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 480 bytes cumulative stack size, 32768 bytes smem, 632 bytes cmem[0]
ptxas info    : Compile time = 10.0 ms
ptxas info    : Function properties for _Z6helperv
    16 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function '_Z4copyPKhPh' for 'sm_80'
ptxas info    : Function properties for _Z4copyPKhPh
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 18 registers, used 0 barriers, 416 bytes cmem[0]
"""

SASS_SAMPLE = """\
	code for sm_80
		Function : _Z6kernelPf
	.headerflags	@"EF_CUDA_SM80 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM80)"
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;     /* 0x00000a00ff017624 */
        /*0010*/                   LDG.E.U16 R2, [R4.64] ;                    /* 0x0000000404027981 */
        /*0020*/                   LDG.E.128 R8, [R4.64+0x10] ;               /* 0x0000100404087981 */
        /*0030*/                   LDG.E.64 R12, [R4.64+0x20] ;               /* 0x0000200404087981 */
        /*0040*/                   FADD R3, R8, R9 ;                          /* 0x0000000908037221 */
        /*0050*/               @P0 BRA 0x10 ;                                 /* 0x0000000000000947 */
        /*0060*/                   LDG.E R6, [R4.64] ;                        /* 0x0000000404067981 */
        /*0070*/                   LDGSTS.E.BYPASS.LTC128B.128 [R7], [R4.64] ; /* 0x0000000004077fae */
        /*0080*/                   STL [R1], R3 ;                             /* 0x0000000301007387 */
        /*0090*/                   LDL R3, [R1] ;                             /* 0x0000000001037983 */
        /*00a0*/                   CALL.REL.NOINC 0x100 ;                     /* 0x0000000000007944 */
        /*00b0*/                   HMMA.16816.F32.BF16 R16, R20, R24, R16 ;   /* 0x000000181410723c */
        /*00c0*/                   HFMA2.MMA R5, -RZ, RZ, 0, 0 ;              /* 0x00000000ff057435 */
        /*00d0*/                   EXIT ;                                     /* 0x000000000000794d */
"""


def test_parse_ptxas_sample():
    kernels = report.parse_ptxas(PTXAS_SAMPLE)
    assert set(kernels) == {"_Z6kernelPf", "_Z4copyPKhPh"}  # the device function _Z6helperv is no kernel
    k = kernels["_Z6kernelPf"]
    assert (k.arch, k.registers, k.stack_bytes, k.spill_store_bytes, k.spill_load_bytes) == ("sm_80", 128, 480, 72, 112)
    assert (k.smem_bytes, k.barriers, k.uses_local_memory) == (32768, 1, True)
    c = kernels["_Z4copyPKhPh"]
    assert (c.registers, c.stack_bytes, c.smem_bytes, c.uses_local_memory) == (18, 0, 0, False)


def test_parse_sass_sample():
    functions = report.parse_sass(SASS_SAMPLE)
    assert list(functions) == ["_Z6kernelPf"]
    counts = report.sass_counts(functions["_Z6kernelPf"], {0x100: "__cuda_sm20_div_s64"})
    assert counts["global_loads"] == {"8": 0, "16": 1, "32": 1, "64": 1, "128": 1}
    assert counts["async_copies"] == {"128": 1}  # LTC128B is a cache hint, not the width
    assert (counts["local_loads"], counts["local_stores"]) == (1, 1)
    assert counts["calls"] == {"__cuda_sm20_div_s64": 1} and counts["div64_calls"] == 1
    assert counts["mma"] == {"HMMA": 1}  # HFMA2.MMA runs on the FMA pipe: no tensor core
    # in the loop 0x10..0x50: 2 + 16 + 8 bytes pending when the FADD reads R8
    assert counts["loads_in_flight"] == {"bytes_per_thread": 26, "loads": 3, "at": "0x0010"}
    # the one loop with global loads: 5 instructions (3 loads, the FADD, the branch) stream 26 bytes per thread
    assert counts["streaming_loop"] == {"instructions": 5, "bytes_per_thread": 26, "loops": ["0x0010-0x0050"]}


def test_streaming_loops_add_up():
    """Two innermost loops with global loads (a K pass and a V pass) make one pass; a loop without loads
    does not count, nor does an outer loop around them."""
    sass = "\n".join(f"        /*{a:04x}*/ {op} ;" for a, op in [
        (0x00, "LDG.E R2, [R4.64]"),                  # outer loop body (set-up load)
        (0x10, "LDG.E.128 R8, [R4.64]"), (0x20, "FFMA R3, R8, R9, R3"), (0x30, "@P0 BRA 0x10"),
        (0x40, "FADD R3, R3, R3"), (0x50, "@P1 BRA 0x40"),          # no load: not streaming
        (0x60, "LDG.E.64 R12, [R4.64]"), (0x70, "@P2 BRA 0x60"),
        (0x80, "@P3 BRA 0x0"), (0x90, "EXIT")])
    functions = report.parse_sass("\t\tFunction : _Z1kv\n" + sass)
    loop = report.streaming_loop(functions["_Z1kv"])
    assert loop == {"instructions": 5, "bytes_per_thread": 24, "loops": ["0x0010-0x0030", "0x0060-0x0070"]}


def test_roofline_bounds():
    """The four bounds of the decode roofline from their inputs, by hand (MODEL_ASSUMPTIONS)."""
    lim = report.SM_LIMITS["sm_80"]
    row = {"name": "attention_kernel<__nv_bfloat16>", "occupancy": {"warps_per_sm": 16},
           "sass": {"loads_in_flight": {"bytes_per_thread": 16}, "mma": {},
                    "streaming_loop": {"instructions": 100, "bytes_per_thread": 32, "loops": []}}}
    m = report.in_flight_model(row, lim, "sm_80")
    per_sm = 16 * 32 * 16  # 8 KB of the 20 KB target
    assert m["bytes_per_sm"] == per_sm
    b = m["bounds_bytes_per_s"]
    assert b["bandwidth"] == lim.dram_bytes_per_s
    assert b["latency"] == pytest.approx(lim.dram_bytes_per_s * per_sm / (20 * 1024))
    assert b["issue"] == pytest.approx(108 * 4 * 1410e6 * 32 * 32 / 100)  # ~6.2 TB/s
    assert b["compute"] == pytest.approx(19.5e12 / 4)  # bf16: 16 flops per 4 bytes of K and V per dim
    assert m["bound"] == "latency" and m["efficiency"] == pytest.approx(per_sm / (20 * 1024))
    # a kernel with an MMA instruction is held to the tensor cores; fewer bytes per instruction: issue-bound
    row["sass"]["mma"] = {"HMMA": 8}
    row["sass"]["loads_in_flight"]["bytes_per_thread"] = 64
    row["sass"]["streaming_loop"]["instructions"] = 2000
    m = report.in_flight_model(row, lim, "sm_80")
    assert m["compute_units"] == "tensor" and m["bounds_bytes_per_s"]["compute"] == pytest.approx(312e12 / 4)
    assert m["bound"] == "issue" and m["attainable_bytes_per_s"] == pytest.approx(108 * 4 * 1410e6 * 32 * 32 / 2000)


def test_async_pipeline_groups_in_flight():
    """A cp.async ring: the wait inside the loop leaves N groups pending (DEPBAR.LE SB0, N) while the thread waits
    for one more, so N + 1 groups are in flight; the wait after the loop (N = 0) does not count, and without
    LDGSTS there is no pipeline. The model turns groups into bytes with the kernel's keys per group."""
    body = [(0x00, "LDGSTS.E.BYPASS.LTC128B.128 [R7], [R4.64]"), (0x10, "LDGDEPBAR"),
            (0x20, "DEPBAR.LE SB0, 0x2"), (0x30, "BAR.SYNC.DEFER_BLOCKING 0x0"),
            (0x40, "LDGSTS.E.BYPASS.LTC128B.128 [R9], [R6.64]"), (0x50, "LDGDEPBAR"),
            (0x60, "LDS.128 R8, [R7]"), (0x70, "@P0 BRA 0x20"), (0x80, "DEPBAR.LE SB0, 0x0"), (0x90, "EXIT")]
    sass = "\t\tFunction : _Z1kv\n" + "\n".join(f"        /*{a:04x}*/ {op} ;" for a, op in body)
    instructions = report.parse_sass(sass)["_Z1kv"]
    assert report.async_groups_in_flight(instructions) == 3
    no_async = [ins for ins in instructions if ins.base != "LDGSTS"]
    assert report.async_groups_in_flight(no_async) == 0
    lim = report.SM_LIMITS["sm_90a"]
    row = {"name": "attention_kernel<signed char, Int4>", "occupancy": {"warps_per_sm": 12, "block": 128},
           "sass": {"loads_in_flight": {"bytes_per_thread": 16}, "mma": {}, "async_groups_in_flight": 3,
                    "streaming_loop": {"instructions": 100, "bytes_per_thread": 32, "loops": []}}}
    budget = report.KERNEL_BUDGETS["attention_kernel"]
    m = report.in_flight_model(row, lim, "sm_90a", budget)
    # 3 groups x 16 keys x (128 int8 + 64 int4 bytes) / 128 threads = 72 B per thread
    assert m["bytes_per_thread"] == pytest.approx(3 * budget.async_group_keys * (128 + 64) / 128)
    assert m["bytes_per_sm"] == pytest.approx(12 * 32 * m["bytes_per_thread"])
    # without the kernel's group size the LDG estimate stands
    assert report.in_flight_model(row, lim, "sm_90a")["bytes_per_thread"] == 16


def test_mla_async_group_bytes_from_the_instance_shape():
    """An MLA instance's stage is its MlaShape's keys x (latent + rope row), each side at its type's bytes (a
    Coded side at 1 byte per value); an attention instance's, its budget's keys x K + V rows at head_dim 128."""
    mla = report.KERNEL_BUDGETS["mla_attention_kernel"]
    narrow = "mla_attention_kernel<__nv_bfloat16, __nv_bfloat16, MlaShape<512, 64, 8, 2> >"
    assert report.async_group_bytes(narrow, mla) == 8 * (512 * 2 + 64 * 2)
    assert report.async_group_bytes("mla_attention_kernel<Coded, float, MlaShape<1024, 256, 4, 1> >", mla) == \
        4 * (1024 * 1 + 256 * 4)
    attn = report.KERNEL_BUDGETS["attention_kernel"]
    assert report.async_group_bytes("attention_kernel<float, Int4>", attn) == 16 * 128 * (4 + 0.5)


def test_demangled_short_names():
    assert report.short_name("void kvcache::cuda::(anonymous namespace)::append_kernel<unsigned short>"
                             "(kvcache::AppendArgs)") == "append_kernel<unsigned short>"
    name = "kvcache::cuda::(anonymous namespace)::mla_attention_kernel(kvcache::MlaArgs)"
    assert report.base_name(report.short_name(name)) == "mla_attention_kernel"


def test_occupancy_of_the_documented_limits():
    sm80, sm90 = report.SM_LIMITS["sm_80"], report.SM_LIMITS["sm_90a"]
    k = report.KernelResources("k", "sm_80", registers=128, smem_bytes=32768)
    # 128 regs: 4096 per warp, 4 warps per sub-partition -> 16 warps; smem: 33 KB per CTA -> 4 (164 KB) / 6 (228 KB)
    assert report.occupancy(k, 128, sm80)["warps_per_sm"] == 16
    assert report.occupancy(k, 128, sm90)["limits"]["shared memory"] == 6
    small = report.KernelResources("k", "sm_80", registers=32)
    assert report.occupancy(small, 256, sm80)["warps_per_sm"] == 64


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_real_file_every_kernel_parsed(tmp_path):
    """cache_kernels.cu (the quickest .cu file to compile: ~2 s) for sm_80: every __global__ it declares has a
    parsed row with registers > 0."""
    source = ROOT / "csrc" / "cache" / "cache_kernels.cu"
    flags = report.cmake_build_flags((ROOT / "CMakeLists.txt").read_text())
    assert "sm_80" in flags.archs
    cubin, text = report.compile_cubin(shutil.which("nvcc"), source, "sm_80", flags, tmp_path)
    assert cubin.stat().st_size > 0
    kernels = report.parse_ptxas(text)
    names = report.demangle(list(kernels))
    registers_by_kernel: dict[str, list[int]] = {}
    for mangled, res in kernels.items():
        assert res.arch == "sm_80"
        registers_by_kernel.setdefault(report.base_name(report.short_name(names[mangled])), []).append(res.registers)
    declared = report.declared_kernels(source.read_text())
    assert len(declared) >= 8
    for kernel in declared:
        assert kernel in registers_by_kernel, f"{kernel} missing from the parsed ptxas output"
        assert all(r > 0 for r in registers_by_kernel[kernel])
    assert set(registers_by_kernel) <= set(report.KERNEL_BUDGETS)  # every kernel has a budget


def test_mma_loop_takes_the_loop_holding_every_mma_and_weights_its_inner_loops():
    # an outer loop 0x00-0x90 (a tile) holding a staging loop 0x10-0x30 and both MMAs; a rotated loop
    # 0x40-0x60 holds only one MMA and must not be taken
    ops = ["NOP", "LDG.E.128", "STS.128", "BRA", "HMMA.16816.F32.BF16", "FADD", "BRA", "HMMA.16816.F32.BF16",
           "FMUL", "BRA"]
    targets = {3: 0x10, 6: 0x40, 9: 0x00}
    ins = [report.Instruction(16 * i, op, f"0x{targets[i]:x}" if i in targets else "R0")
           for i, op in enumerate(ops)]
    loop = report.mma_loop(ins, inner_trips=4)
    assert (loop["loop"], loop["mma"], loop["inner_loops"]) == ("0x0000-0x0090", 2, 2)
    # 10 instructions, of which the inner loops' 3 + 3 run 4 times: 4 + 4 x 6 = 28
    assert loop["instructions"] == 4 + 4 * 6
    assert report.mma_loop(ins[:3])["mma"] == 0  # no MMA: no loop


def _tree(root: Path) -> Path:
    """a.cu includes "core/b.h" (found under the include dir) and "c.h" (beside it); b.h includes d.h."""
    (root / "src" / "core").mkdir(parents=True)
    (root / "src" / "a.cu").write_text('#include "core/b.h"\n#include "c.h"\n#include <cstdint>\n')
    (root / "src" / "c.h").write_text("int c;\n")
    (root / "src" / "core" / "b.h").write_text('  #  include "d.h"\n#if 0\n#include "core/missing.h"\n#endif\n')
    (root / "src" / "core" / "d.h").write_text("int d;\n")
    (root / "src" / "unrelated.h").write_text("int u;\n")
    return root / "src" / "a.cu"


def test_quoted_includes_are_followed_transitively(tmp_path):
    source = _tree(tmp_path)
    found = report.quoted_includes(source, [tmp_path / "src"])
    src = (tmp_path / "src").resolve()
    assert found == sorted([src / "a.cu", src / "c.h", src / "core" / "b.h", src / "core" / "d.h"])


def test_cubin_cache_reuses_a_compile_until_a_header_it_includes_changes(tmp_path):
    source = _tree(tmp_path)
    calls = tmp_path / "calls"
    nvcc = tmp_path / "nvcc"  # a stand-in: counts its calls, writes the cubin named by -o, prints a report
    nvcc.write_text('#!/bin/sh\necho x >> "%s"\nwhile [ "$1" != "-o" ]; do shift; done\n'
                    'echo "cubin $(cat %s | wc -l)" > "$2"\necho "ptxas info : Used 8 registers"\n'
                    % (calls, calls))
    nvcc.chmod(0o755)
    flags = report.BuildFlags(["sm_80"], [f"-I{tmp_path / 'src'}", "-O3"])
    cache, work = tmp_path / "cache", tmp_path / "work"
    work.mkdir()

    def compile_once():
        cubin, text = report.compile_cubin(str(nvcc), source, "sm_80", flags, work, cache, "nvcc 13.0")
        return cubin.read_text(), text

    first = compile_once()
    assert first == ("cubin 1\n", "ptxas info : Used 8 registers\n")
    assert compile_once() == first                     # from the cache: nvcc not run again
    (tmp_path / "src" / "unrelated.h").write_text("int u2;\n")
    assert compile_once() == first                     # a header it does not include changes nothing
    assert calls.read_text().count("x") == 1
    (tmp_path / "src" / "core" / "d.h").write_text("int d2;\n")
    assert compile_once() == ("cubin 2\n", first[1])   # a header two includes deep: compiled again
    report.compile_cubin(str(nvcc), source, "sm_80", flags, work, cache, "nvcc 13.1")
    report.compile_cubin(str(nvcc), source, "sm_90a", flags, work, cache, "nvcc 13.1")
    assert calls.read_text().count("x") == 4           # another compiler, another arch: compiled again
    report.compile_cubin(str(nvcc), source, "sm_80", flags, work, None, "nvcc 13.1")
    assert calls.read_text().count("x") == 5           # no cache: always compiled
    assert not list(cache.glob("*.part"))


def test_cubin_cache_keeps_the_most_recently_used_entries(tmp_path):
    import os
    for i in range(5):
        (tmp_path / f"{i}.cubin").write_bytes(b"c")
        (tmp_path / f"{i}.txt").write_text("t")
        os.utime(tmp_path / f"{i}.cubin", (1000 + i, 1000 + i))  # entry 4 the newest
    os.utime(tmp_path / "0.cubin", (2000, 2000))                 # then entry 0 was used again
    assert report.prune_cubin_cache(tmp_path, keep=3) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.cubin", "0.txt", "3.cubin", "3.txt", "4.cubin", "4.txt"]
    assert report.prune_cubin_cache(tmp_path, keep=3) == 0
