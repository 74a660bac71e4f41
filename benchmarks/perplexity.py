"""End-to-end perplexity and mean KL divergence of every KV format on real text, through the caches a
transformers user would pass as ``past_key_values`` (SmolLM2-135M-Instruct on CPU).

Each text (2048 tokens of the pydoc and Devil's Dictionary texts by default) is evaluated chunk-wise
through the cache: one ``model(...)`` forward of a first chunk (128 tokens), then the rest in chunks of
64 tokens, each forward attending to everything the cache holds, so later tokens attend to quantized
history, as in generation. Every position's next-token log-probabilities are scored:
  - perplexity = exp(mean negative log-likelihood of the actual next token), over all 2047 predictions;
  - mean KL divergence KL(P_ref || P) per position, against the full-precision reference;
  - top-1 agreement with the reference's argmax.
The reference is PagedCache in the model's dtype with the "kvcache" attention (the issue's "full
precision cache"); DynamicCache + SDPA is scored too, to show the two agree.

The caches:
  - PagedCache + "kvcache" attention for every kvcache format: bf16, int8, fp8_e4m3, int4, k=int8,v=int4
    quantized as they are written (the kernel reads the codes: a chunk's own tokens are already
    quantized when it attends to them); then int8, fp8_e4m3, int4 and KIVI (kivi4, kivi2) with
    ``residual_length=128``, HF's default: the newest 128 tokens (and the forward's own) stay in the
    model's dtype, older pages are quantized as they age out (kvcache.residual).
  - HF QuantizedCache + SDPA (transformers' defaults: group 64, a 128-token full-precision residual, the
    whole history re-quantized every 128 tokens; the first chunk attends to itself unquantized): "fp8"
    (per-tensor e4m3), HQQ 8/4/2-bit (axis 1) and quanto 4/2-bit (axis 0), the axes HF's docs recommend.

Gates (perplexity increase over the full-precision cache; the Hugging Face issue): int8 <= 0.5%,
fp8 e4m3 <= 2%, int4 <= 5%, KIVI 2-bit (128-token full-precision window) <= 20%; and each at least as
good as HF's QuantizedCache at the same number of bits (int8 / fp8 vs every 8-bit HF backend, int4 vs
the 4-bit ones, kivi2 vs the 2-bit ones), on each text.

    python benchmarks/perplexity.py              # 2 texts x 2048 tokens, every format (about 10 minutes)
    python benchmarks/perplexity.py --quick      # one text, 256 tokens, a few formats; prints, writes nothing

As a module (for benchmarks/quality.py): ``perplexity.perplexity_rows(model, {"pydoc": ids}, VARIANTS)``
returns the rows, ``perplexity.markdown(...)`` the table.

Requirements beyond requirements/dev.txt: optimum-quanto==0.2.7 and hqq==0.2.8.post1 for their rows (see
benchmarks/e2e.py for how to install them without their heavy extras); rows whose backend is missing are
skipped and said so. Writes benchmarks/results/perplexity.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

import kvcache

sys.path.insert(0, str(Path(__file__).resolve().parent))  # noqa: E402  (run as a script or imported)
from common import machine, no_fp8_backend, write_results  # noqa: E402

PREFILL, CHUNK = 128, 64


@dataclass(frozen=True)
class Variant:
    """One row: a cache (PagedCache format, DynamicCache, or HF QuantizedCache backend)."""

    name: str
    kind: str                         # "paged", "dynamic", "quantized"
    kv_format: str | None = None      # paged: kvcache format, None = the model's dtype
    residual: int = 0                 # paged: residual_length (newest tokens kept in the model's dtype)
    backend: str | None = None        # quantized: "fp8", "hqq", "quanto"
    nbits: int | None = None
    bits: int | None = None           # stored bits per element (for "same number of bits"); None = model dtype
    gate: float | None = None         # allowed perplexity increase over the reference

    paged_attn: str = field(default="kvcache", compare=False)  # PagedCache rows' attention (--attn)

    @property
    def attn(self) -> str:
        return self.paged_attn if self.kind == "paged" else "sdpa"

    def missing(self) -> str | None:
        """Why this variant cannot run here, or None."""
        module = {"hqq": "hqq", "quanto": "optimum"}.get(self.backend or "")
        if module and importlib.util.find_spec(module) is None:
            return f"{'optimum-quanto' if module == 'optimum' else module} is not installed"
        if self.backend == "fp8":
            return no_fp8_backend()
        if self.kind == "paged" and self.kv_format is not None:
            try:
                kvcache.KVPool.allocate(1, 16, 1, 64, self.kv_format)
            except NotImplementedError as e:
                return str(e)
        return None

    def make(self, config):
        from transformers import DynamicCache, QuantizedCache

        if self.kind == "paged":
            return kvcache.PagedCache(config=config, kv_format=self.kv_format, residual_length=self.residual)
        if self.kind == "dynamic":
            return DynamicCache(config=config)
        if self.backend == "fp8":
            return QuantizedCache("fp8", config=config)
        axis = 1 if self.backend == "hqq" else 0
        return QuantizedCache(self.backend, config=config, nbits=self.nbits, axis_key=axis, axis_value=axis)


REFERENCE = Variant("PagedCache (model dtype)", "paged")
VARIANTS = [
    REFERENCE,
    Variant("DynamicCache", "dynamic"),
    Variant("PagedCache bf16", "paged", "bf16", bits=16),
    Variant("PagedCache int8", "paged", "int8", bits=8, gate=0.005),
    Variant("PagedCache fp8_e4m3", "paged", "fp8_e4m3", bits=8, gate=0.02),
    Variant("PagedCache int4", "paged", "int4", bits=4, gate=0.05),
    Variant("PagedCache k=int8,v=int4", "paged", "k=int8,v=int4", bits=6),
    Variant("PagedCache int8 + 128 residual", "paged", "int8", 128, bits=8, gate=0.005),
    Variant("PagedCache fp8_e4m3 + 128 residual", "paged", "fp8_e4m3", 128, bits=8, gate=0.02),
    Variant("PagedCache int4 + 128 residual", "paged", "int4", 128, bits=4, gate=0.05),
    Variant("PagedCache kivi4 + 128 residual", "paged", "kivi4", 128, bits=4, gate=0.05),
    Variant("PagedCache kivi2 + 128 residual", "paged", "kivi2", 128, bits=2, gate=0.20),
    Variant("QuantizedCache fp8", "quantized", backend="fp8", bits=8),
    Variant("QuantizedCache HQQ 8-bit", "quantized", backend="hqq", nbits=8, bits=8),
    Variant("QuantizedCache HQQ 4-bit", "quantized", backend="hqq", nbits=4, bits=4),
    Variant("QuantizedCache HQQ 2-bit", "quantized", backend="hqq", nbits=2, bits=2),
    Variant("QuantizedCache quanto 4-bit", "quantized", backend="quanto", nbits=4, bits=4),
    Variant("QuantizedCache quanto 2-bit", "quantized", backend="quanto", nbits=2, bits=2),
]
QUICK_VARIANTS = ("PagedCache (model dtype)", "DynamicCache", "PagedCache int8", "PagedCache int4",
                  "PagedCache int4 + 128 residual", "PagedCache kivi2 + 128 residual", "QuantizedCache fp8",
                  "QuantizedCache quanto 4-bit")


# ---- evaluation ------------------------------------------------------------------------------------
def chunks(num_tokens: int, prefill: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of the forwards: one prefill of ``prefill`` tokens, then ``chunk`` at a time."""
    bounds = [(0, min(prefill, num_tokens))]
    while bounds[-1][1] < num_tokens:
        start = bounds[-1][1]
        bounds.append((start, min(start + chunk, num_tokens)))
    return bounds


@torch.no_grad()
def chunked_logprobs(model, ids: torch.Tensor, variant: Variant, prefill: int = PREFILL, chunk: int = CHUNK):
    """Yields ``(start, logprobs)`` per forward: float32 log-probabilities ``[n, vocab]`` of the tokens after
    positions ``start .. start + n - 1`` (the last position of the text predicts nothing and is dropped)."""
    before = model.config._attn_implementation
    model.set_attn_implementation(variant.attn)
    cache = variant.make(model.config)
    try:
        total = ids.shape[1]
        for start, end in chunks(total, prefill, chunk):
            logits = model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits[0]
            n = min(end, total - 1) - start
            if n > 0:
                yield start, torch.log_softmax(logits[:n].float(), dim=-1)
    finally:
        model.set_attn_implementation(before)
        if hasattr(cache, "free"):
            cache.free()


def evaluate(model, ids: torch.Tensor, variant: Variant, reference: torch.Tensor | None = None, *,
             prefill: int = PREFILL, chunk: int = CHUNK, keep: bool = False) -> dict:
    """Perplexity of ``ids`` ``[1, tokens]`` through ``variant``'s cache, and against ``reference`` log-probs
    ``[tokens - 1, vocab]`` the mean KL divergence and top-1 agreement. ``keep`` returns the log-probs."""
    targets = ids[0, 1:]
    nll = kl = agree = 0.0
    kept, token_nll = [], []
    start_time = time.perf_counter()
    for start, logp in chunked_logprobs(model, ids, variant, prefill, chunk):
        n = logp.shape[0]
        per_token = -logp.gather(1, targets[start:start + n, None])[:, 0]
        nll += per_token.sum().item()
        token_nll.append(per_token.double())
        if reference is not None:
            ref = reference[start:start + n]
            kl += (ref.exp() * (ref - logp)).sum().item()
            agree += (ref.argmax(-1) == logp.argmax(-1)).sum().item()
        if keep:
            kept.append(logp)
    count = targets.numel()
    out = {"variant": variant.name, "kind": variant.kind, "kv_format": variant.kv_format, "backend": variant.backend,
           "nbits": variant.nbits, "bits": variant.bits, "tokens": ids.shape[1], "predictions": count,
           "nll": nll / count, "perplexity": math.exp(nll / count), "seconds": time.perf_counter() - start_time}
    if reference is not None:
        out["kl"] = kl / count
        out["top1_agreement"] = agree / count
    if keep:
        out["logprobs"] = torch.cat(kept)
    out["token_nll"] = torch.cat(token_nll)  # for paired standard errors; not written out
    return out


def paired_se(a: torch.Tensor, b: torch.Tensor) -> float:
    """Standard error of mean(a - b) over tokens: the noise of a log-perplexity difference between two
    caches scored on the same tokens (exp of it is the perplexity ratio; for small values, +-SE ~ +-SE%)."""
    d = a - b
    return float(d.std(unbiased=True) / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")


def perplexity_rows(model, texts: dict[str, torch.Tensor], variants=VARIANTS, *, prefill: int = PREFILL,
                    chunk: int = CHUNK, progress: bool = True) -> tuple[list[dict], list[str]]:
    """Rows for every (text, variant) that runs here, and notes on the variants that do not.

    ``texts``: name -> token ids ``[1, tokens]``. The first variant is the reference (the perplexity
    increase and the KL divergence are measured against it)."""
    notes, runnable = [], []
    for v in variants:
        why = v.missing()
        if why:
            notes.append(f"{v.name}: not run ({why})")
        else:
            runnable.append(v)
    reference, others = runnable[0], runnable[1:]
    rows = []
    bar = tqdm(total=len(texts) * len(runnable), desc="perplexity", unit="run", disable=not progress)
    for text, ids in texts.items():
        ref = evaluate(model, ids, reference, prefill=prefill, chunk=chunk, keep=True)
        logprobs = ref.pop("logprobs")
        ref.update(kl=0.0, top1_agreement=1.0)
        rows.append(ref)
        bar.update()
        for v in others:
            rows.append(evaluate(model, ids, v, logprobs, prefill=prefill, chunk=chunk))
            bar.update()
        for row in rows:
            if "text" not in row:
                row["text"] = text
                row["increase"] = row["perplexity"] / ref["perplexity"] - 1
                row["increase_se"] = paired_se(row["token_nll"], ref["token_nll"])
        del logprobs
    bar.close()
    return rows, notes


# ---- gates and output ------------------------------------------------------------------------------
def gates(rows: list[dict], variants=VARIANTS) -> list[dict]:
    """Per text: each gated format's perplexity increase, and its comparison with every HF
    QuantizedCache row of the same number of bits (int8/fp8 both against the 8-bit ones)."""
    by_name = {v.name: v for v in variants}
    out = []
    for text in dict.fromkeys(r["text"] for r in rows):
        at = [r for r in rows if r["text"] == text]
        for r in at:
            v = by_name.get(r["variant"])
            if v is None or v.gate is None:
                continue
            out.append({"text": text, "gate": f"{v.name}: perplexity increase", "measured": r["increase"],
                        "required": v.gate, "pass": r["increase"] <= v.gate})
            for hf in at:
                if hf["kind"] == "quantized" and hf["bits"] == v.bits:
                    # the difference's own noise: both caches scored on the same tokens (paired)
                    se = paired_se(r["token_nll"], hf["token_nll"]) if "token_nll" in r and "token_nll" in hf else None
                    out.append({"text": text, "gate": f"{v.name} vs {hf['variant']}: perplexity increase",
                                "measured": r["increase"], "required": hf["increase"],
                                "pass": r["increase"] <= hf["increase"], "difference_se": se})
    return out


def markdown(info: dict, rows: list[dict], gate_rows: list[dict], notes: list[str], setup: dict) -> str:
    texts = list(dict.fromkeys(r["text"] for r in rows))
    names = list(dict.fromkeys(r["variant"] for r in rows))
    lines = [f"Measured {info['date']} on {info['cpu']}, {info['threads']} threads, torch {info['torch']}, "
             f"transformers {info['transformers']}, kvcache CPU kernel `{info['kvcache_cpu_isa']}`"
             + "".join(f", {k} {v}" for k, v in info.get("peers", {}).items()) + ". "
             f"{setup['model']}, {setup['dtype']}; each text: {setup['tokens']} tokens, a {setup['prefill']}-token "
             f"first forward, then {setup['chunk']}-token forwards through the cache. Increase and KL "
             f"(nats/token) are against {REFERENCE.name}; PagedCache rows use \"{setup.get('paged_attn', 'kvcache')}\" "
             "attention, the others SDPA.", "",
             "| cache | " + " | ".join(f"{t}: ppl | increase | KL | top-1" for t in texts) + " |",
             "|---|" + "---|---|---|---|" * len(texts)]
    for name in names:
        cells = []
        for t in texts:
            r = next((x for x in rows if x["variant"] == name and x["text"] == t), None)
            if r is None:
                cells.append("— | — | — | —")
                continue
            se = r.get("increase_se")
            spread = f" ± {se:.2%}" if se is not None and se > 0 else ""
            cells.append(f"{r['perplexity']:.3f} | {r['increase']:+.2%}{spread} | {r['kl']:.2e} | {r['top1_agreement']:.1%}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("")
    for t, sample in setup.get("texts", {}).items():
        lines.append(f"- {t}: {sample['description']} ({sample['num_tokens']} tokens, sha256 "
                     f"{sample['text_sha256'][:12]}...).")
    for note in notes:
        lines.append(f"- {note}")
    if any(r.get("increase_se") for r in rows):
        lines.append("- ± is one standard error of the increase, from the per-token log-likelihood differences "
                     "against the reference (paired: same tokens). Against an HF row, *difference* is ours minus "
                     "theirs with its own paired standard error; within ±2 SE the two are not told apart.")
    if gate_rows:
        lines += ["", "| text | gate | measured | required | difference (SE) | |", "|---|---|---|---|---|---|"]
        for g in gate_rows:
            se = g.get("difference_se")
            diff = f"{g['measured'] - g['required']:+.2%} ({se:.2%})" if se is not None else ""
            lines.append(f"| {g['text']} | {g['gate']} | {g['measured']:+.2%} | <= {g['required']:+.2%} | {diff} | "
                         f"{'pass' if g['pass'] else 'FAIL'} |")
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
    parser.add_argument("--quick", action="store_true", help="one text, 256 tokens, a few formats")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--texts", default="pydoc,devil")
    parser.add_argument("--prefill", type=int, default=PREFILL)
    parser.add_argument("--chunk", type=int, default=CHUNK)
    parser.add_argument("--dtype", default="float32", help="the model's dtype (the reference cache's too)")
    parser.add_argument("--variants", default=None, help="comma-separated subset of the rows' names "
                                                         "(the first is the reference)")
    parser.add_argument("--attn", default="kvcache", choices=("kvcache", "sdpa"),
                        help="attention of the PagedCache rows: the kernel over the pages, or SDPA over "
                             "paged_gather's copy (the same stored values; for machines where the kernel is slow)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write perplexity.{json,md} (default benchmarks/results; --quick writes "
                             "nothing unless given)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers
    from kvcache.assets import load_smollm2, real_token_ids

    tokens, text_names, prefill, chunk = args.tokens, args.texts.split(","), args.prefill, args.chunk
    variants = VARIANTS
    if args.quick:
        tokens, text_names, prefill, chunk = 256, text_names[:1], 64, 32
        variants = [v for v in VARIANTS if v.name in QUICK_VARIANTS]
    if args.variants:
        wanted = [s.strip() for s in args.variants.split(",")]
        variants = [next(v for v in VARIANTS if v.name == w) for w in wanted]
    variants = [replace(v, paged_attn=args.attn) for v in variants]
    started = time.perf_counter()
    model, tokenizer = load_smollm2(getattr(torch, args.dtype))
    texts, samples = {}, {}
    for name in text_names:
        texts[name], sample = real_token_ids(tokenizer, tokens, name)
        samples[name] = sample.as_dict()
    info = machine()
    info["transformers"] = transformers.__version__
    info["peers"] = peer_versions()
    rows, notes = perplexity_rows(model, texts, variants, prefill=prefill, chunk=chunk,
                                  progress=not args.no_progress)
    gate_rows = gates(rows, variants)
    for row in rows:
        row.pop("token_nll", None)
    setup = {"model": "SmolLM2-135M-Instruct", "dtype": args.dtype, "tokens": tokens, "prefill": prefill,
             "chunk": chunk, "texts": samples, "paged_attn": args.attn, "wall_s": time.perf_counter() - started}
    table = markdown(info, rows, gate_rows, notes, setup)
    print(table)
    out = args.out if args.out is not None or args.quick else Path(__file__).parent / "results"
    if out is not None:
        write_results("perplexity", {"machine": info, "setup": setup, "rows": rows, "gates": gate_rows,
                                     "notes": notes}, table, out)


if __name__ == "__main__":
    main()
