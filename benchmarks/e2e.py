"""End-to-end speed on a real model (SmolLM2-135M on CPU): decode tokens/s per cache, and time to first
token on a shared-prefix workload with and without the prefix cache.

Decode (batch 1, greedy): for each context (1k / 4k / 8k tokens of real text), the prompt's K/V are
computed once (one DynamicCache + SDPA forward) and written into each cache through its own
``update()``; then every cache decodes the same number of steps from the same first token. Only the
decode steps are timed (one ``model(...)`` forward of one token plus the argmax). The caches:
  - PagedCache + "kvcache" attention (the paged_attention kernel reads the pages, no gathered copy),
    in the model's dtype and as int8 / int4 pages;
  - DynamicCache + SDPA (``torch.cat`` of the whole history every step), StaticCache + SDPA;
  - HF QuantizedCache + SDPA with the backends that run here: "fp8" (per-tensor e4m3, in transformers),
    "hqq" (8 and 4 bits, HF's recommended axis 1) and "quanto" (4 bits, axis 0); group 64, a 128-token
    full-precision residual. Every ``update`` dequantizes the whole history; every 128 steps the whole
    history is re-quantized ("flush"). Steady tokens/s is 1 / the median step without a flush;
    amortized tokens/s adds the measured flush cost spread over its 128 steps (the figure a long
    generation sees).
All caches live at once and decode in interleaved rounds (the order rotates each round), next to a
1 GiB streaming-read probe, so a noisy neighbour hits every cache alike; per-step times are kept and
the median is reported.

Time to first token (kvcache.Engine, "kvcache" attention): 16 prompts = one ~1k-token system prompt
(real text) + a distinct ~64-token question each (another real text), 16 new tokens, greedy, run with
and without the prefix cache (cold: nothing cached before; warm: the system prompt was cached by an
earlier request). Reports mean TTFT, tokens actually prefilled, and the fraction the prefix cache cuts
(with its ceiling for this workload: the first request must compute the system prompt once).

    python benchmarks/e2e.py                   # float32, full tables (about 15 minutes)
    python benchmarks/e2e.py --dtypes float32,bfloat16
    python benchmarks/e2e.py --quick           # short contexts, few steps; prints, writes nothing

Requirements beyond requirements/dev.txt (install into your own environment, not the project's):
  - optimum-quanto==0.2.7 (pure Python): ``pip install --no-deps optimum-quanto==0.2.7``
    (its other dependencies, torch/ninja/numpy/safetensors/huggingface_hub, are already there);
  - hqq==0.2.8.post1 (sdist; CUDA kernels skipped): ``pip install wheel setuptools``, then
    ``DISABLE_CUDA=1 pip install --no-deps --no-build-isolation hqq==0.2.8.post1 einops termcolor``.
  Without them their rows are skipped (and said so in the output). The "fp8" backend needs nothing.
  The model and texts: ``python benchmarks/assets.py --text devil`` once (gguf + accelerate needed).

Writes benchmarks/results/e2e.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import kvcache

sys.path.insert(0, str(Path(__file__).resolve().parent))  # noqa: E402  (run as a script or imported)
from common import BandwidthProbe, machine, no_fp8_backend, write_results  # noqa: E402

CONTEXTS = (1024, 4096, 8192)
# Done-when gates of the Hugging Face issue, at the longest context.
GATE_VS_DYNAMIC = 1.5       # PagedCache + "kvcache" (model dtype) / DynamicCache tokens/s
GATE_INT8_VS_HF = 2.0       # PagedCache int8 / HF QuantizedCache 8-bit tokens/s
GATE_PREFILL_CUT = 0.90     # fraction of prefilled tokens the prefix cache saves


# ---- the caches ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheVariant:
    """One row of the decode table: which cache, with which attention implementation."""

    name: str
    kind: str                        # "paged", "dynamic", "static", "quantized"
    attn: str                        # "kvcache" or "sdpa"
    kv_format: str | None = None     # paged: kvcache format (None = the model's dtype)
    backend: str | None = None       # quantized: "fp8", "hqq", "quanto"
    nbits: int | None = None
    bits: int | None = None          # stored bits per K/V element, for matching rows (None = model dtype)

    def missing(self) -> str | None:
        """Why this variant cannot run here, or None."""
        module = {"hqq": "hqq", "quanto": "optimum.quanto"}.get(self.backend or "")
        if module and importlib.util.find_spec(module.split(".")[0]) is None:
            return f"{module} is not installed"
        return no_fp8_backend() if self.backend == "fp8" else None

    def make(self, config, max_len: int):
        from transformers import DynamicCache, QuantizedCache, StaticCache

        if self.kind == "paged":
            return kvcache.PagedCache(config=config, kv_format=self.kv_format)
        if self.kind == "dynamic":
            return DynamicCache(config=config)
        if self.kind == "static":
            return StaticCache(config=config, max_cache_len=max_len)
        if self.backend == "fp8":
            return QuantizedCache("fp8", config=config)
        axis = 1 if self.backend == "hqq" else 0  # the axes HF's docs recommend for each backend
        return QuantizedCache(self.backend, config=config, nbits=self.nbits, axis_key=axis, axis_value=axis)


DECODE_VARIANTS = [
    CacheVariant("PagedCache + kvcache", "paged", "kvcache"),
    CacheVariant("PagedCache int8 + kvcache", "paged", "kvcache", "int8", bits=8),
    CacheVariant("PagedCache int4 + kvcache", "paged", "kvcache", "int4", bits=4),
    CacheVariant("DynamicCache + sdpa", "dynamic", "sdpa"),
    CacheVariant("StaticCache + sdpa", "static", "sdpa"),
    CacheVariant("QuantizedCache fp8 + sdpa", "quantized", "sdpa", backend="fp8", bits=8),
    CacheVariant("QuantizedCache HQQ 8-bit + sdpa", "quantized", "sdpa", backend="hqq", nbits=8, bits=8),
    CacheVariant("QuantizedCache HQQ 4-bit + sdpa", "quantized", "sdpa", backend="hqq", nbits=4, bits=4),
    CacheVariant("QuantizedCache quanto 4-bit + sdpa", "quantized", "sdpa", backend="quanto", nbits=4, bits=4),
]


def _residual_length(cache) -> int | None:
    """Tokens in an HF QuantizedCache's full-precision residual (layer 0), None for other caches."""
    layers = getattr(cache, "layers", None)
    if not layers or not hasattr(layers[0], "residual_length"):
        return None
    keys = layers[0].keys
    return int(keys.shape[-2]) if keys is not None and keys.dim() == 4 else 0


def fill(cache, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Writes a prompt's per-layer K/V ``[1, kv_heads, tokens, head_dim]`` through ``cache.update``
    (what the model's prefill forward would do)."""
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k.clone(), v.clone(), layer)


@dataclass
class DecodeState:
    variant: CacheVariant
    cache: object
    token: torch.Tensor                       # [1, 1] next input
    steps_ms: list[float] = field(default_factory=list)
    flush: list[bool] = field(default_factory=list)


@torch.no_grad()
def decode_steps(model, state: DecodeState, steps: int) -> None:
    """``steps`` greedy decode steps of batch 1, each timed alone (forward + argmax)."""
    model.set_attn_implementation(state.variant.attn)
    token = state.token
    for _ in range(steps):
        before = _residual_length(state.cache)
        start = time.perf_counter()
        logits = model(input_ids=token, past_key_values=state.cache, use_cache=True).logits
        token = logits[:, -1:].argmax(-1)
        state.steps_ms.append((time.perf_counter() - start) * 1e3)
        after = _residual_length(state.cache)
        state.flush.append(before is not None and after < before)
    state.token = token


def summarize_decode(state: DecodeState, context: int, steps_per_flush: int = 128) -> dict:
    steady = [t for t, f in zip(state.steps_ms, state.flush) if not f]
    flushes = [t for t, f in zip(state.steps_ms, state.flush) if f]
    step = statistics.median(steady)
    amortized = step + (statistics.median(flushes) - step) / steps_per_flush if flushes else step
    v = state.variant
    return {
        "variant": v.name, "kind": v.kind, "attn": v.attn, "kv_format": v.kv_format, "backend": v.backend,
        "nbits": v.nbits, "bits": v.bits, "context": context, "steps": len(state.steps_ms),
        "step_ms": step, "step_ms_p25": _quantile(steady, 0.25), "step_ms_p75": _quantile(steady, 0.75),
        "tokens_per_s": 1e3 / step, "flushes": len(flushes),
        "flush_ms": statistics.median(flushes) if flushes else None,
        "amortized_tokens_per_s": 1e3 / amortized,
    }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def decode_benchmark(model, prompt_ids: torch.Tensor, contexts, variants, *, steps: int, rounds: int,
                     warmup: int = 2, probe: BandwidthProbe | None = None,
                     progress: bool = True) -> tuple[list[dict], list[str]]:
    """Decode rows for every (context, variant) that runs here, and notes on those that do not.

    ``prompt_ids`` ``[1, >= max(contexts)]``: the real text; each context uses its first tokens.
    ``steps`` decode steps per round, ``rounds`` interleaved rounds (the order rotates), after ``warmup``
    untimed steps of each cache."""
    from transformers import DynamicCache

    rows, notes = [], []
    runnable = []
    for v in variants:
        why = v.missing()
        if why:
            notes.append(f"{v.name}: skipped ({why})")
        else:
            runnable.append(v)
    dtype = next(model.parameters()).dtype
    bar = tqdm(total=len(contexts) * rounds * len(runnable), desc=f"decode {str(dtype)[6:]}", unit="run",
               disable=not progress)
    for context in contexts:
        ids = prompt_ids[:, :context]
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            ref = DynamicCache(config=model.config)
            first = model(input_ids=ids, past_key_values=ref, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        keys = [layer.keys for layer in ref.layers]
        values = [layer.values for layer in ref.layers]
        states = []
        for v in runnable:
            model.set_attn_implementation(v.attn)  # PagedCache.update only writes under "kvcache" attention
            cache = v.make(model.config, context + rounds * steps + 8)
            with torch.no_grad():
                fill(cache, keys, values)
            states.append(DecodeState(v, cache, first.clone()))
        del ref, keys, values
        gc.collect()
        for state in states:  # first-call costs (lazy imports, allocations) stay out of the timings
            decode_steps(model, state, warmup)
            state.steps_ms.clear()
            state.flush.clear()
        bandwidth = []
        for r in range(rounds):
            if probe is not None:
                bandwidth.append(probe.measure())
            for state in states[r % len(states):] + states[: r % len(states)]:
                decode_steps(model, state, steps)
                bar.update()
        for state in states:
            row = summarize_decode(state, context)
            row["read_GBps"] = statistics.median(bandwidth) / 1e9 if bandwidth else None
            row["kv_bytes"] = _cache_bytes(state.cache)
            rows.append(row)
        del states
        gc.collect()
    bar.close()
    for row in rows:  # ratios against DynamicCache at the same context
        base = next((r for r in rows if r["kind"] == "dynamic" and r["context"] == row["context"]), None)
        row["vs_dynamic"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
    return rows, notes


def _cache_bytes(cache) -> int | None:
    """Bytes of K/V the cache holds (pages in use for PagedCache; tensors for the HF caches)."""
    if isinstance(cache, kvcache.PagedCache):
        return cache.stats()["bytes"]
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += _nbytes(getattr(layer, name, None))
    return total


def _nbytes(obj) -> int:
    if obj is None:
        return 0
    if torch.is_tensor(obj):
        if type(obj) is not torch.Tensor:  # quanto's QTensor subclasses: count their inner tensors
            inner = getattr(obj, "__tensor_flatten__", None)
            if inner is not None:
                names, _ = inner()
                return sum(_nbytes(getattr(obj, n)) for n in names)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(_nbytes(o) for o in obj.values())
    return 0


# ---- time to first token with a shared prefix ------------------------------------------------------
def shared_prefix_prompts(tokenizer, num_prompts: int = 16, system_tokens: int = 1024,
                          question_tokens: int = 64) -> tuple[list[list[int]], list[list[int]], dict]:
    """``num_prompts`` prompts = one system prompt (pydoc text, BOS first) + a distinct question each
    (consecutive slices of the Devil's Dictionary); also ``num_prompts`` more questions for warm-up use."""
    from kvcache.assets import real_token_ids

    system, system_info = real_token_ids(tokenizer, system_tokens, "pydoc")
    text, text_info = real_token_ids(tokenizer, 2 * num_prompts * question_tokens, "devil", bos=False)
    qs = text[0].view(2 * num_prompts, question_tokens).tolist()
    prompts = [system[0].tolist() + q for q in qs[:num_prompts]]
    others = [system[0].tolist() + q for q in qs[num_prompts:]]
    return prompts, others, {"system": system_info.as_dict(), "questions": text_info.as_dict()}


def ttft_benchmark(model, prompts: list[list[int]], warmup_prompts: list[list[int]], *, kv_format=None,
                   max_new_tokens: int = 16, rounds: int = 2, progress: bool = True) -> list[dict]:
    """Mean time to first token and prefilled tokens through kvcache.Engine: without the prefix cache,
    with it (cold), and with it after one earlier request cached the shared prefix (warm)."""
    modes = ("no prefix cache", "prefix cache, cold", "prefix cache, warm")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    tokens: dict[str, list[list[int]]] = {}
    bar = tqdm(total=rounds * len(modes), desc="ttft", unit="run", disable=not progress)
    for r in range(rounds):
        for mode in modes[r % 3:] + modes[: r % 3]:
            engine = kvcache.Engine(model, kv_format=kv_format, prefix_cache=mode != "no prefix cache",
                                    max_batch=len(prompts))
            if mode.endswith("warm"):
                engine.generate(warmup_prompts[:1], max_new_tokens=1)
            results = engine.generate(prompts, max_new_tokens=max_new_tokens, do_sample=False)
            runs[mode].append(engine.stats())
            tokens[mode] = [res.tokens for res in results]
            del engine
            gc.collect()
            bar.update()
    bar.close()
    base = runs["no prefix cache"]
    base_prefill = statistics.median(s["prefill_tokens"] for s in base)
    prompt_tokens = base[0]["prompt_tokens"]
    shared = _shared_prefix_length(prompts)
    rows = []
    for mode in modes:
        stats = runs[mode]
        prefill = statistics.median(s["prefill_tokens"] for s in stats)
        earlier = warmup_prompts[:1] if mode.endswith("warm") else []
        ceiling = 0.0 if mode == modes[0] else reusable_tokens(prompts, earlier) / prompt_tokens
        rows.append({
            "mode": mode, "prompts": len(prompts), "shared_prefix_tokens": shared, "prompt_tokens": prompt_tokens,
            "prefill_tokens": prefill, "prefix_hit_tokens": statistics.median(s["prefix_hit_tokens"] for s in stats),
            "prefix_hit_rate": statistics.median(s["prefix_hit_rate"] for s in stats),
            "prefill_cut": 1 - prefill / base_prefill, "prefill_cut_ceiling": ceiling,
            "ttft_s": statistics.median(s["ttft_s"] for s in stats),
            "ttft_s_runs": [s["ttft_s"] for s in stats],
            "tpot_s": statistics.median(s["tpot_s"] for s in stats),
            "tokens_per_s": statistics.median(s["tokens_per_s"] for s in stats),
            "kv_bytes": stats[-1]["kv_bytes"], "dynamic_cache_bytes": stats[-1]["dynamic_cache_bytes"],
            "same_tokens_as_no_prefix_cache": sum(a == b for a, b in zip(tokens[mode], tokens[modes[0]])),
            "format": stats[-1]["format"],
        })
    base_ttft = rows[0]["ttft_s"]
    for row in rows:
        row["ttft_speedup"] = base_ttft / row["ttft_s"]
    return rows


def reusable_tokens(prompts: list[list[int]], earlier: list[list[int]] = ()) -> int:
    """The most prompt tokens any prefix cache could skip: for each prompt, its longest common prefix with
    a prompt seen before it (``earlier`` ones first), keeping its last token to compute."""
    seen, total = list(earlier), 0
    for p in prompts:
        total += min(len(p) - 1, max((_common_prefix(p, q) for q in seen), default=0))
        seen.append(p)
    return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _shared_prefix_length(prompts: list[list[int]]) -> int:
    return min(_common_prefix(prompts[0], p) for p in prompts)


# ---- gates and output ------------------------------------------------------------------------------
def gates(decode: list[dict], ttft: list[dict]) -> list[dict]:
    """The issue's done-when checks, at the longest context measured, per dtype."""
    out = []
    for dtype in sorted({r["dtype"] for r in decode}):
        rows = [r for r in decode if r["dtype"] == dtype]
        ctx = max(r["context"] for r in rows)
        at = {r["variant"]: r for r in rows if r["context"] == ctx}
        paged, dyn = at.get("PagedCache + kvcache"), at.get("DynamicCache + sdpa")
        if paged and dyn:
            ratio = paged["tokens_per_s"] / dyn["tokens_per_s"]
            out.append({"gate": f"{dtype}, {ctx} tokens: PagedCache + kvcache vs DynamicCache tokens/s",
                        "measured": ratio, "required": GATE_VS_DYNAMIC, "pass": ratio >= GATE_VS_DYNAMIC})
        int8 = at.get("PagedCache int8 + kvcache")
        for r in at.values():
            if int8 and r["kind"] == "quantized" and r["bits"] == 8:
                for metric in ("amortized_tokens_per_s", "tokens_per_s"):
                    ratio = int8[metric] / r[metric]
                    label = "amortized" if metric.startswith("amortized") else "steady, flushes excluded"
                    out.append({"gate": f"{dtype}, {ctx} tokens: PagedCache int8 vs {r['variant']} ({label})",
                                "measured": ratio, "required": GATE_INT8_VS_HF, "pass": ratio >= GATE_INT8_VS_HF})
    for row in ttft:
        if row["mode"] != "no prefix cache":
            out.append({"gate": f"prefilled tokens cut by the prefix cache ({row['mode']}; ceiling "
                                f"{row['prefill_cut_ceiling']:.1%})",
                        "measured": row["prefill_cut"], "required": GATE_PREFILL_CUT,
                        "pass": row["prefill_cut"] >= GATE_PREFILL_CUT})
    return out


def markdown(info: dict, decode: list[dict], ttft: list[dict], gate_rows: list[dict], notes: list[str],
             setup: dict) -> str:
    lines = [f"Measured {info['date']} on {info['cpu']}, {info['threads']} threads, torch {info['torch']}, "
             f"transformers {info['transformers']}, kvcache CPU kernel `{info['kvcache_cpu_isa']}`"
             + "".join(f", {k} {v}" for k, v in info.get("peers", {}).items()) + ". "
             f"Model {setup['model']}, batch 1, greedy; prompt: {setup['text']}. "
             f"{setup['steps']} decode steps per cache and context ({setup['rounds']} interleaved rounds); "
             "tokens/s = 1 / median step; *amortized* adds HF QuantizedCache's re-quantization of the whole "
             "history (every 128 steps) spread over those steps. Read roof: streaming read of 1 GiB, same rounds.",
             ""]
    for dtype in sorted({r["dtype"] for r in decode}):
        rows = [r for r in decode if r["dtype"] == dtype]
        contexts = sorted({r["context"] for r in rows})
        names = list(dict.fromkeys(r["variant"] for r in rows))
        lines += [f"Decode tokens/s, {dtype} model (x = vs DynamicCache at the same context):", "",
                  "| cache | " + " | ".join(f"{c} tokens" for c in contexts) + " | KV bytes at "
                  f"{contexts[-1]} |", "|---|" + "---|" * (len(contexts) + 1)]
        for name in names:
            cells = []
            for c in contexts:
                r = next((x for x in rows if x["variant"] == name and x["context"] == c), None)
                if r is None:
                    cells.append("—")
                    continue
                cell = f"{r['tokens_per_s']:.1f} ({r['vs_dynamic']:.2f}x)"
                if r["flushes"]:
                    cell += f"; amortized {r['amortized_tokens_per_s']:.1f}"
                cells.append(cell)
            last = next((x for x in rows if x["variant"] == name and x["context"] == contexts[-1]), None)
            kv = f"{last['kv_bytes'] / 2**20:.0f} MiB" if last and last["kv_bytes"] is not None else "—"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {kv} |")
        roofs = [f"{c}: {statistics.median(r['read_GBps'] for r in rows if r['context'] == c):.1f} GB/s"
                 for c in contexts if all(r["read_GBps"] for r in rows if r["context"] == c)]
        if roofs:
            lines.append("")
            lines.append("Read roof during the rounds: " + ", ".join(roofs) + ".")
        lines.append("")
    if ttft:
        t0 = ttft[0]
        lines += [f"Time to first token, kvcache.Engine ({t0['format']} pages, \"kvcache\" attention): "
                  f"{t0['prompts']} prompts sharing a {t0['shared_prefix_tokens']}-token system prompt, "
                  f"{t0['prompt_tokens']} prompt tokens in all, {setup['ttft_new_tokens']} new tokens each, "
                  f"median of {setup['ttft_rounds']} runs:", "",
                  "| mode | prefilled tokens | cut (ceiling) | prefix hit rate | mean TTFT s | TTFT speedup | "
                  "decode tok/s (all requests) | same greedy tokens |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in ttft:
            cut = "—" if r["mode"] == "no prefix cache" else f"{r['prefill_cut']:.1%} ({r['prefill_cut_ceiling']:.1%})"
            lines.append(f"| {r['mode']} | {r['prefill_tokens']:.0f} | {cut} | {r['prefix_hit_rate']:.1%} | "
                         f"{r['ttft_s']:.2f} | {r['ttft_speedup']:.1f}x | {r['tokens_per_s']:.1f} | "
                         f"{r['same_tokens_as_no_prefix_cache']}/{r['prompts']} |")
        lines.append("")
    if gate_rows:
        lines += ["| gate | measured | required | |", "|---|---|---|---|"]
        for g in gate_rows:
            fmt = "{:.1%}" if "cut" in g["gate"] else "{:.2f}x"
            req = "{:.0%}" if "cut" in g["gate"] else "{:.1f}x"
            lines.append(f"| {g['gate']} | {fmt.format(g['measured'])} | >= {req.format(g['required'])} | "
                         f"{'pass' if g['pass'] else 'FAIL'} |")
        lines.append("")
    for note in notes:
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


def peer_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("optimum-quanto", "hqq"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short contexts and few steps, for a smoke run")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32", help="model dtypes, e.g. float32,bfloat16")
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths (default 1024,4096,8192)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per cache per round")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds (steps x rounds >= 128 "
                                                                "to see HF QuantizedCache's re-quantization)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the decode variants' names")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--ttft-rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write e2e.{json,md} (default benchmarks/results; --quick writes nothing "
                             "unless given)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    from kvcache.assets import TextSample, load_smollm2, real_token_ids

    if args.quick:
        contexts, steps, rounds = [256, 512], 4, 2
        n_prompts, system_tokens, question_tokens, new_tokens, ttft_rounds = 4, 128, 16, 4, 1
    else:
        contexts, steps, rounds = list(CONTEXTS), args.steps, args.rounds
        n_prompts, system_tokens, question_tokens, new_tokens, ttft_rounds = 16, 1024, 64, 16, args.ttft_rounds
    if args.contexts:
        contexts = [int(c) for c in args.contexts.split(",")]
    variants = DECODE_VARIANTS
    if args.variants:
        wanted = {s.strip() for s in args.variants.split(",")}
        variants = [v for v in DECODE_VARIANTS if v.name in wanted]
    info = machine()
    info["transformers"] = transformers.__version__
    info["peers"] = peer_versions()
    info["load_average_at_start"] = _loadavg()
    probe = BandwidthProbe()
    decode, notes, ttft = [], [], []
    started = time.perf_counter()
    text: TextSample | None = None
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        model, tokenizer = load_smollm2(dtype)
        if not args.skip_decode:
            ids, text = real_token_ids(tokenizer, max(contexts), "pydoc")
            rows, notes = decode_benchmark(model, ids, contexts, variants, steps=steps, rounds=rounds, probe=probe,
                                           progress=not args.no_progress)
            for row in rows:
                row["dtype"] = dtype_name
            decode += rows
        if not args.skip_ttft and dtype_name == args.dtypes.split(",")[0]:
            prompts, others, sources = shared_prefix_prompts(tokenizer, n_prompts, system_tokens, question_tokens)
            ttft = ttft_benchmark(model, prompts, others, max_new_tokens=new_tokens, rounds=ttft_rounds,
                                  progress=not args.no_progress)
            for row in ttft:
                row["dtype"], row["texts"] = dtype_name, sources
        del model
        gc.collect()
    info["load_average_at_end"] = _loadavg()
    setup = {"model": "SmolLM2-135M-Instruct (30 layers, 9 q / 3 kv heads, head_dim 64)",
             "text": text.description if text else "—", "steps": steps * rounds, "rounds": rounds,
             "ttft_new_tokens": new_tokens, "ttft_rounds": ttft_rounds, "wall_s": time.perf_counter() - started}
    gate_rows = gates(decode, ttft)
    table = markdown(info, decode, ttft, gate_rows, notes, setup)
    print(table)
    out = args.out if args.out is not None or args.quick else Path(__file__).parent / "results"
    if out is not None:
        write_results("e2e", {"machine": info, "setup": setup, "decode": decode, "ttft": ttft, "gates": gate_rows,
                              "notes": notes}, table, out)


def _loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


if __name__ == "__main__":
    main()
