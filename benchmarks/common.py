"""Shared pieces of the benchmarks: machine description, a read-bandwidth probe, timing, and output.

Every figure a benchmark reports is a ratio measured in the same run (ours vs a peer vs the probe),
never a bare time from another day: this machine's bandwidth moves with its neighbours.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

import kvcache
from kvcache.layout import pool_tensor

GiB = 1 << 30


def machine() -> dict:
    """What the numbers were measured on."""
    model = platform.processor() or "unknown"
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    model = fields.get("model name", model)
    if "cpu family" in fields:  # "AMD EPYC" alone does not say which generation
        model += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    flags = set(fields.get("flags", "").split())
    simd = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16")
            if f in flags]
    return {
        "date": _dt.date.today().isoformat(),
        "cpu": model,
        "cpu_simd_flags": simd,
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "kvcache": kvcache.__version__,
        "kvcache_cpu_isa": kvcache._C.cpu_isa(),
        # the avx512bf16 build's own choices (attention_cpu_gemm.h): bf16 / fp8 pages on vdpbf16ps or fp32 FMAs,
        # bf16 prefill on MKL's bf16 GEMM or the register kernel
        "kvcache_cpu_paths": _cpu_paths(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def _cpu_paths() -> str:
    """" (...)" naming the avx512bf16 build's path choices, "" for the other builds."""
    if kvcache._C.cpu_isa() != "avx512bf16":
        return ""
    dot = "bf16 dot products" if kvcache._C.cpu_bf16_dot() else "fp32 FMAs"
    gemm = "MKL bf16 GEMM" if kvcache._C.cpu_bf16_gemm() else "register kernel"
    return f" (bf16 and fp8 pages: {dot}; bf16 chunked prefill: {gemm})"


class BandwidthProbe:
    """Streaming read of a 1 GiB buffer (torch's vectorized, multi-threaded sum): the machine's read roof.

    The buffer is allocated as the pools are (``kvcache.layout.pool_tensor``: transparent huge pages on the
    CPU), so the roof is the read rate of the memory the kernel reads. (On 4 KiB pages, as torch.rand allocates,
    the same sum read ~22.5 GB/s in a fresh process where huge pages gave ~29, Xeon family 6 model 167, 2
    threads; inside this benchmark's process it had read ~28-29 either way there, by luck of the allocation.)"""

    def __init__(self, nbytes: int = GiB):
        self.buffer = pool_tensor((nbytes // 4,), torch.float32).uniform_()

    def measure(self) -> float:
        """Bytes per second of one pass."""
        start = time.perf_counter()
        self.buffer.sum()
        return self.buffer.nbytes / (time.perf_counter() - start)


class ComputeProbe:
    """A matrix product (torch, all threads) in `dtype`: the machine's compute roof in that arithmetic,
    in FLOP/s. fp32 is the FMA roof; bf16 is the roof of a CPU with bf16 dot products (AVX-512 BF16),
    which the attention kernel uses for bf16 pages there."""

    def __init__(self, n: int = 1024, dtype: torch.dtype = torch.float32):
        self.a, self.b = torch.rand(n, n).to(dtype), torch.rand(n, n).to(dtype)
        self.out = torch.empty(n, n, dtype=dtype)
        self.flops = 2 * n ** 3

    def measure(self) -> float:
        """FLOP per second of one product."""
        start = time.perf_counter()
        torch.mm(self.a, self.b, out=self.out)
        return self.flops / (time.perf_counter() - start)


def time_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (a count of 0 ended the scripts in a ZeroDivisionError or IndexError)."""
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def best(samples: list[float]) -> float:
    return min(samples)


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def write_results(name: str, payload: dict, markdown: str, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown)


def no_fp8_backend() -> str | None:
    """Why HF's "fp8" QuantizedCache backend cannot run here (it came with transformers 5), or None."""
    from transformers import cache_utils

    if hasattr(cache_utils, "Fp8QuantizedLayer"):
        return None
    return "this transformers has no fp8 QuantizedCache backend"
