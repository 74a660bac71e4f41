"""Decode step of an MLA model (DeepSeek-V3's attention shapes) on CPU: HF DynamicCache against
kvcache.PagedCache, with HF's latent expansion and with the absorbed "kvcache" attention.

transformers 5 hands DeepSeek-V2/V3's cache the latents (kv_nope [b, 1, s, kv_lora_rank] as the key, the
rotated k_rot [b, 1, s, qk_rope_head_dim] as the value) and at every step expands the whole history through
kv_b_proj (``DeepseekV3Attention.expand_kv``) before attending. The modes, all on one model:
  1. DynamicCache + "sdpa" (the peer);
  2. PagedCache + "sdpa": the latents in pages, read back and expanded by HF as in 1;
  3. PagedCache + "kvcache": absorbed MLA attention (the query folded through W_UK, attention over the latent
     pages, no expansion). A mode that raises (e.g. a kvcache without it yet) is reported as not available.
2 and 3 run with full-precision (bf16) pages and with int8 latents (``kv_format="int8"``, PagedCache's
default residual window: the newest 128 tokens stay in bf16 beside their int8 pages).

The model: DeepSeek-V3's attention (hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, rope 64,
nope 128, v 128) in 2 dense layers (no MoE), small MLP and vocabulary, random weights (fixed seed), bf16.
Each cache is filled directly with ``cache.update(kv_nope, k_rot, layer)`` with random latents shaped as the
model hands them (kv_nope ~ N(0, 1), it leaves an RMSNorm; k_rot ~ N(0, 1)), the same for every mode: no
prefill through the model (128 heads x 32k^2 would take hours). A decode step is one forward of one token at
position L with the cache holding L tokens, then ``cache.crop(-1)`` (untimed) so every round starts at L.

Once per L, outside the timing, the warm-up step's logits of every mode are compared with DynamicCache's:
the largest difference over the largest difference another history makes (DynamicCache's logits over other
random latents of the same length), within TOLERANCE per format; the bf16 noise of HF's own paths (eager
against sdpa attention over the same cache) is reported beside it. Rounds interleave the modes (the order
rotates each round); step times are medians, speed-ups medians of per-round ratios against DynamicCache.
Gate: absorbed attention with bf16 pages at least 5x faster than DynamicCache at 8k (PASS/FAIL; the
exit status is 0 either way unless --strict). Bytes per token come from the caches: DynamicCache's
tensors, PagedCache.stats()["bytes"] (pages in use, residual pages included) over its tokens.

    python benchmarks/mla.py                     # L = 1k, 8k, 32k (about 8 minutes on 2 cores, 14 GiB peak)
    python benchmarks/mla.py --lengths 1024,8192 --rounds 5
    python benchmarks/mla.py --quick             # tiny shapes, for the test suite

Needs transformers >= 5 (4.x caches DeepSeek's expanded K/V, not the latents). Writes
benchmarks/results/mla.{json,md} (--out-dir elsewhere).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # noqa: E402  (run as a script or imported)
from common import machine, write_results  # noqa: E402

# DeepSeek-V3's attention; 2 dense layers, a small MLP and vocabulary (the attention is what is measured)
FULL_CONFIG = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                   kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                   num_hidden_layers=2, first_k_dense_replace=2, intermediate_size=512, vocab_size=1024,
                   max_position_embeddings=40960)
# weights of std 0.06 rather than 0.02: at hidden 64 the history then moves the logits by ~0.6 rather than ~0.07,
# ~70 bf16 ulps of the logits, so the logits check tells one ulp from a real difference (eager vs sdpa: ~1.5%)
QUICK_CONFIG = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
                    kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                    num_hidden_layers=2, first_k_dense_replace=2, intermediate_size=128, vocab_size=128,
                    max_position_embeddings=512, initializer_range=0.06)
FULL_LENGTHS = (1024, 8192, 32768)
QUICK_LENGTHS = (64, 192)  # inside and beyond int8's default 128-token bf16 window
# interleaved rounds per L: a DynamicCache step at 32k expands 32k latents through kv_b_proj in every layer
ROUNDS = {1024: 7, 8192: 5, 32768: 3}
GATE_LENGTH, GATE_SPEEDUP = 8192, 5.0
# largest logit difference against DynamicCache's, over the largest difference another history of the same
# length makes (eager against sdpa attention, both HF's, differ by ~0.01-0.02 of it in bf16)
TOLERANCE = {"bf16": 0.1, "int8": 0.25}
FILL_CHUNK = 2048
TOKEN = 7


@dataclass(frozen=True)
class Mode:
    name: str
    cache: str           # "dynamic" | "paged"
    attn: str            # transformers attention implementation
    kv_format: str | None  # None: the model's dtype

    @property
    def format(self) -> str:
        return self.kv_format or "bf16"


MODES = (
    Mode("DynamicCache + sdpa", "dynamic", "sdpa", None),
    Mode("PagedCache + sdpa (HF expansion)", "paged", "sdpa", None),
    Mode("PagedCache + sdpa (HF expansion)", "paged", "sdpa", "int8"),
    Mode("PagedCache + kvcache (absorbed)", "paged", "kvcache", None),
    Mode("PagedCache + kvcache (absorbed)", "paged", "kvcache", "int8"),
)
REFERENCE = MODES[0]
ABSORBED_BF16 = MODES[3]


def label(mode: Mode) -> str:
    return f"{mode.name}, {mode.format}"


def build_model(config_kwargs: dict, seed: int = 0):
    import transformers

    config = transformers.DeepseekV3Config(**config_kwargs)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # no fp32 copy of the weights on the way
    try:
        model = transformers.DeepseekV3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(torch.bfloat16).eval()


def random_latents(config, length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: kv_nope [1, 1, L, kv_lora_rank] and k_rot [1, 1, L, qk_rope_head_dim], N(0, 1), bf16."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(config.num_hidden_layers):
        kv_nope = torch.randn(1, 1, length, config.kv_lora_rank, generator=g).to(torch.bfloat16)
        k_rot = torch.randn(1, 1, length, config.qk_rope_head_dim, generator=g).to(torch.bfloat16)
        out.append((kv_nope, k_rot))
    return out


def make_cache(model, mode: Mode, latents, chunk: int = FILL_CHUNK):
    """A cache of ``mode`` holding ``latents`` (written through its own ``update``, in chunks); the model's
    attention implementation is set first (a PagedCache's update depends on it)."""
    import transformers

    import kvcache

    model.set_attn_implementation(mode.attn)
    if mode.cache == "dynamic":
        cache = transformers.DynamicCache(config=model.config)
    else:
        cache = kvcache.PagedCache(config=model.config, kv_format=mode.kv_format)
    length = latents[0][0].shape[2]
    with torch.no_grad():
        for start in range(0, length, chunk):
            for layer, (kv_nope, k_rot) in enumerate(latents):
                cache.update(kv_nope[:, :, start:start + chunk], k_rot[:, :, start:start + chunk], layer)
    assert cache.get_seq_length() == length
    return cache


class Stepper:
    """One decode step of one token at position L, then the cache cropped back to L (untimed)."""

    def __init__(self, model, length: int):
        self.model, self.length = model, length
        self.kwargs = dict(input_ids=torch.tensor([[TOKEN]]), position_ids=torch.tensor([[length]]), use_cache=True)
        if "cache_position" in inspect.signature(model.model.forward).parameters:  # older transformers took it
            self.kwargs["cache_position"] = torch.tensor([length])

    def __call__(self, cache) -> tuple[float, torch.Tensor]:
        with torch.no_grad():
            start = time.perf_counter()
            out = self.model(past_key_values=cache, **self.kwargs)
            elapsed = time.perf_counter() - start
        extra = cache.get_seq_length() - self.length
        assert extra == 1, extra
        cache.crop(-extra)
        assert cache.get_seq_length() == self.length
        return elapsed, out.logits[0, -1].float()


def empty_step(model, step: "Stepper") -> float:
    """Seconds of the same step (one token at position L) over an empty DynamicCache: the weights' and the
    rest of the model's cost, the floor no cache can go below."""
    import transformers

    model.set_attn_implementation("sdpa")
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        start = time.perf_counter()
        model(past_key_values=cache, **step.kwargs)
        return time.perf_counter() - start


def cache_bytes(cache, layers: int) -> dict:
    """Bytes the cache holds for its tokens: total and per layer, per token."""
    if hasattr(cache, "stats"):  # PagedCache: pages in use (with int8: the residual window's bf16 pages too)
        s = cache.stats()
        tokens, total = s["tokens"], s["bytes"]
        store = cache.store
        sealed = store.bytes_per_block() / store.page_size  # all layers, a quantized (sealed) page alone
        extra = {"format_label": s["format"], "pool_bytes": s["pool_bytes"], "residual_blocks": s["residual_blocks"],
                 "sealed_bytes_per_token": sealed, "dynamic_cache_bytes": s["dynamic_cache_bytes"]}
    else:  # DynamicCache: its tensors
        tokens = cache.get_seq_length()
        total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        extra = {"format_label": "bf16"}
    return {"bytes": total, "bytes_per_token": total / tokens, "bytes_per_token_per_layer": total / tokens / layers,
            **extra}


def reset_peak_rss() -> None:
    """Linux: restart the process's peak RSS (VmHWM) from its current RSS, so each L reports its own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_gib() -> float:
    """Peak RSS since the last reset_peak_rss (the process's peak where that is not available)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / (1 << 20)  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB on Linux


def run_length(model, length: int, rounds: int, modes=MODES, seed: int = 1, log=print) -> tuple[list[dict], dict]:
    """Rows (one per mode) and the logits check at one L."""
    config = model.config
    reset_peak_rss()
    latents = random_latents(config, length, seed)
    step = Stepper(model, length)
    caches, warm_logits, unavailable = {}, {}, {}
    for mode in modes:
        try:
            caches[mode] = make_cache(model, mode, latents)
            model.set_attn_implementation(mode.attn)
            _, warm_logits[mode] = step(caches[mode])  # the warm-up step; its logits are checked below
        except Exception as e:  # a mode this kvcache cannot run (yet): a row that says so, with the error
            if mode == REFERENCE:
                raise
            unavailable[mode] = f"{type(e).__name__}: {e}"
            caches.pop(mode, None)
            log(f"  L={length}: {label(mode)}: not available ({unavailable[mode][:160]})")
        gc.collect()
    if REFERENCE not in caches:
        raise RuntimeError(f"the reference mode ({label(REFERENCE)}) did not run: {unavailable.get(REFERENCE)}")
    # what the logits' differences are measured against: how much they move with another history of the same
    # length (DynamicCache over other random latents), and the bf16 noise of two HF paths over the same one
    # (eager against sdpa attention)
    ref = warm_logits[REFERENCE]
    other = make_cache(model, REFERENCE, random_latents(config, length, seed + 1000))
    model.set_attn_implementation(REFERENCE.attn)
    _, other_logits = step(other)
    del other
    eager = make_cache(model, Mode(REFERENCE.name, REFERENCE.cache, "eager", None), latents)
    del latents
    model.set_attn_implementation("eager")
    _, eager_logits = step(eager)
    del eager
    gc.collect()
    history_effect = (ref - other_logits).abs().max().item()
    bf16_noise = (ref - eager_logits).abs().max().item()
    check = {"length": length, "history_effect": history_effect, "eager_vs_sdpa": bf16_noise,
             "eager_vs_sdpa_ratio": bf16_noise / history_effect, "modes": {}}
    log(f"  L={length}: another history moves DynamicCache's logits by up to {history_effect:.3g}; eager vs sdpa "
        f"attention (bf16 noise) {bf16_noise:.3g} = {bf16_noise / history_effect:.3g} x that")
    for mode in caches:
        diff = (warm_logits[mode] - ref).abs().max().item()
        ratio = diff / history_effect if history_effect > 0 else float("inf")
        ok = ratio <= TOLERANCE[mode.format]
        check["modes"][label(mode)] = {"max_abs_diff": diff, "ratio": ratio, "tolerance": TOLERANCE[mode.format],
                                       "pass": ok}
        log(f"  L={length}: {label(mode)}: logits max |diff| {diff:.3g} = {ratio:.3g} x another history's: "
            f"{'ok' if ok else 'MISMATCH'}")
    check["pass"] = all(m["pass"] for m in check["modes"].values())

    order = list(caches)
    times: dict[Mode, list[float]] = {m: [] for m in order}
    floor = []  # the same step over an empty cache: every cost but the history's
    for r in range(rounds):
        k = r % len(order)
        for mode in order[k:] + order[:k]:
            model.set_attn_implementation(mode.attn)
            elapsed, _ = step(caches[mode])
            times[mode].append(elapsed)
        floor.append(empty_step(model, step))
        log(f"  L={length} round {r + 1}/{rounds}: " + ", ".join(f"{label(m)} {times[m][-1] * 1e3:.1f} ms"
                                                                  for m in order) + f"; floor {floor[-1] * 1e3:.1f} ms")
    check["floor_ms"] = statistics.median(floor) * 1e3
    layers = config.num_hidden_layers
    rows = []
    for mode in modes:
        row = {"length": length, "mode": mode.name, "format": mode.format, "cache": mode.cache, "attn": mode.attn,
               "available": mode in caches}
        if mode in caches:
            ratios = [ref_t / t for ref_t, t in zip(times[REFERENCE], times[mode])]
            row |= {"step_ms": statistics.median(times[mode]) * 1e3, "step_ms_all": [t * 1e3 for t in times[mode]],
                    "speedup_vs_dynamic": statistics.median(ratios), "rounds": rounds,
                    "logits": check["modes"][label(mode)]}
            row |= cache_bytes(caches[mode], layers)
        else:
            row["reason"] = unavailable[mode]
        rows.append(row)
    caches.clear()
    gc.collect()
    check["peak_rss_gib"] = peak_rss_gib()
    return rows, check


def gate(rows: list[dict]) -> dict:
    name = f"{label(ABSORBED_BF16)} >= {GATE_SPEEDUP:g}x faster than {label(REFERENCE)} at L={GATE_LENGTH}"
    row = next((r for r in rows if r["length"] == GATE_LENGTH and r["mode"] == ABSORBED_BF16.name
                and r["format"] == ABSORBED_BF16.format), None)
    if row is None:
        return {"gate": name, "result": "NOT MEASURED", "detail": f"L={GATE_LENGTH} was not run"}
    if not row["available"]:
        return {"gate": name, "result": "NOT RUN", "detail": "absorbed attention not available: " + row["reason"]}
    ok = row["speedup_vs_dynamic"] >= GATE_SPEEDUP
    return {"gate": name, "result": "PASS" if ok else "FAIL", "speedup": row["speedup_vs_dynamic"]}


def describe(info: dict) -> str:
    return (f"{info['cpu']} ({' '.join(info['cpu_simd_flags'])}), {info['threads']} threads, torch {info['torch']}, "
            f"transformers {info['transformers']}, kvcache {info['kvcache']} (CPU kernel {info['kvcache_cpu_isa']})")


def markdown(info: dict, setup: dict, rows: list[dict], checks: list[dict], gate_row: dict) -> str:
    c = setup["config"]
    lines = [f"Measured {info['date']} on {describe(info)}.",
             "",
             f"Model: DeepseekV3ForCausalLM, hidden {c['hidden_size']}, {c['num_attention_heads']} heads, q_lora_rank "
             f"{c['q_lora_rank']}, kv_lora_rank {c['kv_lora_rank']}, rope {c['qk_rope_head_dim']}, nope "
             f"{c['qk_nope_head_dim']}, v {c['v_head_dim']}, {c['num_hidden_layers']} dense layers, random weights (std "
             f"{c.get('initializer_range', 0.02)}), "
             f"bf16. Decode step of 1 token with the cache holding L random latents (filled through "
             f"cache.update); median step time over interleaved rounds; speed-up = median of per-round "
             f"DynamicCache / mode ratios. int8: PagedCache's default residual window (newest "
             f"{setup['residual_length']} tokens also in bf16). bytes/token: held by the cache at L, all layers "
             f"(per layer in brackets).",
             "",
             "| L | mode | format | step ms | vs DynamicCache | bytes/token (per layer) | logits vs DynamicCache |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["available"]:
            lines.append(f"| {r['length']} | {r['mode']} | {r['format']} | not available | | | |")
            continue
        lg = r["logits"]
        lines.append(f"| {r['length']} | {r['mode']} | {r['format']} | {r['step_ms']:.1f} | "
                     f"{r['speedup_vs_dynamic']:.2f}x | {r['bytes_per_token']:.0f} ({r['bytes_per_token_per_layer']:.0f}) | "
                     f"{lg['ratio']:.3f} ({'ok' if lg['pass'] else 'MISMATCH'}) |")
    lines += ["", f"Gate: {gate_row['gate']}: **{gate_row['result']}**"
              + (f" ({gate_row['speedup']:.2f}x)" if "speedup" in gate_row else f" ({gate_row.get('detail', '')})")]
    notes = sorted({f"{r['mode']}, {r['format']}: {r['reason']}" for r in rows if not r["available"]})
    if notes:
        lines += ["", "Not available:"] + [f"- {n[:300]}" for n in notes]
    lines += ["", "Logits check: the largest difference of the warm-up step's logits from DynamicCache's, as a share of "
              "the largest difference another history of the same length (other random latents) makes to "
              "DynamicCache's logits; tolerance " + ", ".join(f"{k} {v}" for k, v in TOLERANCE.items())
              + "; HF's eager vs sdpa attention over the same cache shows bf16's own noise on that scale: "
              + "; ".join(f"L={ch['length']}: {'pass' if ch['pass'] else 'FAIL'} (eager vs sdpa "
                          f"{ch['eager_vs_sdpa_ratio']:.3f})" for ch in checks) + ".",
              "Floor (the same step over an empty cache, timed in the same rounds: the weights and the rest of the "
              "model, which no cache removes): " + "; ".join(f"L={ch['length']}: {ch['floor_ms']:.1f} ms" for ch in checks)
              + ".",
              "Peak RSS (the model and every cache and step at that L): "
              + "; ".join(f"L={ch['length']}: {ch['peak_rss_gib']:.1f} GiB" for ch in checks) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, L = 64 and 192, 2 rounds (the test suite)")
    parser.add_argument("--lengths", default=None, help="comma-separated cache lengths (default 1024,8192,32768)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per L (default: 7 at 1k, 5 at "
                                                                 "8k, 3 at 32k and beyond)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--strict", action="store_true", help="exit 1 if the gate fails or the logits disagree")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    import transformers

    import kvcache  # noqa: F401  (registers the "kvcache" attention)
    from kvcache.store import DEFAULT_RESIDUAL_LENGTH

    if int(transformers.__version__.split(".")[0]) < 5 or not hasattr(transformers, "DeepseekV3ForCausalLM"):
        raise SystemExit(f"transformers {transformers.__version__}: needs >= 5 with DeepseekV3 (4.x caches "
                         f"DeepSeek's expanded K/V, not the latents)")
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    config_kwargs = QUICK_CONFIG if args.quick else FULL_CONFIG
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths else
               list(QUICK_LENGTHS if args.quick else FULL_LENGTHS))
    info = machine() | {"transformers": transformers.__version__}
    print(f"Machine: {describe(info)}", flush=True)
    model = build_model(config_kwargs, args.seed)
    too_long = [n for n in lengths if n >= model.config.max_position_embeddings]
    if too_long:
        raise SystemExit(f"lengths {too_long} >= max_position_embeddings={model.config.max_position_embeddings}")
    rows, checks = [], []
    for length in lengths:
        rounds = args.rounds or (2 if args.quick else ROUNDS.get(length, 3 if length > 8192 else 7))
        print(f"L={length}: {rounds} rounds", flush=True)
        got, check = run_length(model, length, rounds, seed=args.seed + 1,
                                log=lambda s: print(s, flush=True))
        rows += got
        checks.append(check)
    gate_row = gate(rows)
    setup = {"config": config_kwargs, "lengths": lengths, "quick": args.quick, "seed": args.seed,
             "fill_chunk": FILL_CHUNK, "residual_length": DEFAULT_RESIDUAL_LENGTH, "tolerance": TOLERANCE,
             "rounds": {str(n): args.rounds or (2 if args.quick else ROUNDS.get(n, 3 if n > 8192 else 7))
                        for n in lengths}}
    table = markdown(info, setup, rows, checks, gate_row)
    print()
    print(table, flush=True)
    payload = {"machine": info, "setup": setup, "rows": rows, "logits_checks": checks, "gate": gate_row}
    write_results("mla", payload, table, args.out_dir)
    print(f"wrote {args.out_dir / 'mla.json'} and {args.out_dir / 'mla.md'}")
    if args.strict and (gate_row["result"] != "PASS" or not all(ch["pass"] for ch in checks)):
        raise SystemExit(1)
    return payload


if __name__ == "__main__":
    main()
