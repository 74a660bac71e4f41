"""Plumbing of benchmarks/e2e.py and benchmarks/perplexity.py (not their speed): a tiny random Llama runs
every step of both in a few seconds; one test builds the real-text TTFT workload with SmolLM2's tokenizer
when it is cached."""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
import torch

from conftest import asset_missing

transformers = pytest.importorskip("transformers")
pytest.importorskip("tqdm")


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import e2e  # noqa: E402
import perplexity  # noqa: E402
from common import machine, write_results  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config).eval()


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))


# the HF fp8 backend needs no peer package (but transformers 5: 4.57 reports it missing)
DECODE = [v for v in e2e.DECODE_VARIANTS if v.backend in (None, "fp8") and not v.missing()]


def test_decode_rows_and_tables(tiny_model, tmp_path):
    rows, notes = e2e.decode_benchmark(tiny_model, _ids(48), [32, 48], DECODE, steps=2, rounds=2, warmup=1,
                                       progress=False)
    assert notes == []
    assert len(rows) == 2 * len(DECODE)
    for row in rows:
        row["dtype"] = "float32"
        assert row["steps"] == 4 and row["tokens_per_s"] > 0 and row["flushes"] == 0
        assert row["amortized_tokens_per_s"] == row["tokens_per_s"]
        assert row["kv_bytes"] > 0
    assert all(r["vs_dynamic"] == 1.0 for r in rows if r["kind"] == "dynamic")
    paged = {r["context"]: r for r in rows if r["variant"] == "PagedCache + kvcache"}
    int8 = {r["context"]: r for r in rows if r["variant"] == "PagedCache int8 + kvcache"}
    # the default 128-token window holds all 48 tokens in the model's dtype too, beside their int8 pages
    assert paged[48]["kv_bytes"] < int8[48]["kv_bytes"] < 1.5 * paged[48]["kv_bytes"]
    gate_rows = e2e.gates(rows, [])
    assert {g["gate"].split(": ")[1] for g in gate_rows} >= {"PagedCache + kvcache vs DynamicCache tokens/s"}
    info = machine() | {"transformers": transformers.__version__}
    setup = {"model": "tiny", "text": "random", "steps": 4, "rounds": 2, "ttft_new_tokens": 2, "ttft_rounds": 1}
    table = e2e.markdown(info, rows, [], gate_rows, notes, setup)
    assert "| PagedCache int8 + kvcache |" in table and "48 tokens" in table
    write_results("e2e", {"decode": rows, "gates": gate_rows}, table, tmp_path)
    assert json.loads((tmp_path / "e2e.json").read_text())["decode"][0]["variant"] == DECODE[0].name


def test_quantized_cache_flush_is_seen(tiny_model):
    """HF QuantizedCache re-quantizes its history every `residual_length` tokens: the step that does it
    is flagged and priced into the amortized figure."""
    variant = next(v for v in e2e.DECODE_VARIANTS if v.backend == "hqq" and v.nbits == 8)
    if variant.missing():
        pytest.skip(variant.missing())
    cache = transformers.QuantizedCache("hqq", config=tiny_model.config, nbits=8, axis_key=1, axis_value=1,
                                        residual_length=4)
    e2e.fill(cache, *_prompt_kv(tiny_model, 16))
    state = e2e.DecodeState(variant, cache, torch.tensor([[5]]))
    e2e.decode_steps(tiny_model, state, 9)
    assert sum(state.flush) == 2
    row = e2e.summarize_decode(state, 16, steps_per_flush=4)
    assert row["flushes"] == 2 and row["flush_ms"] > 0 and row["steps"] == 9


def _prompt_kv(model, n):
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=_ids(n), past_key_values=cache, use_cache=True)
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def test_ttft_rows(tiny_model):
    system = _ids(40, seed=2)[0].tolist()
    questions = _ids(64, seed=3)[0].view(8, 8).tolist()
    prompts = [system + q for q in questions[:4]]
    others = [system + q for q in questions[4:]]
    rows = e2e.ttft_benchmark(tiny_model, prompts, others, max_new_tokens=2, rounds=1, progress=False)
    assert [r["mode"] for r in rows] == ["no prefix cache", "prefix cache, cold", "prefix cache, warm"]
    off, cold, warm = rows
    assert off["prefill_tokens"] == off["prompt_tokens"] == 4 * 48 and off["prefill_cut"] == 0
    assert 0 < cold["prefill_cut"] <= cold["prefill_cut_ceiling"] + 1e-9
    assert cold["prefill_cut"] < warm["prefill_cut"] <= warm["prefill_cut_ceiling"] + 1e-9
    assert warm["prefix_hit_tokens"] >= 4 * 40 - 4
    gate_rows = e2e.gates([], rows)
    assert len(gate_rows) == 2 and all("prefix cache" in g["gate"] for g in gate_rows)


def test_reusable_tokens():
    a, b, c = [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]
    assert e2e.reusable_tokens([a, b, c]) == 0 + 3 + 2
    assert e2e.reusable_tokens([a], [a]) == 3  # the last token is always computed


def test_perplexity_rows(tiny_model):
    variants = [v for v in perplexity.VARIANTS if v.kind != "quantized" or v.backend == "fp8"]
    rows, notes = perplexity.perplexity_rows(tiny_model, {"a": _ids(80), "b": _ids(80, seed=5)}, variants,
                                             prefill=32, chunk=16, progress=False)
    ran = [v for v in variants if not v.missing()]
    assert len(rows) == 2 * len(ran) and len(notes) == len(variants) - len(ran)
    by = {(r["text"], r["variant"]): r for r in rows}
    for text in ("a", "b"):
        ref, dyn = by[(text, perplexity.REFERENCE.name)], by[(text, "DynamicCache")]
        assert ref["increase"] == 0 and ref["kl"] == 0 and ref["predictions"] == 79
        assert math.isclose(dyn["perplexity"], ref["perplexity"], rel_tol=1e-4) and dyn["kl"] < 1e-6
        assert all(r["kl"] >= -1e-6 and 0 <= r["top1_agreement"] <= 1 for r in rows if r["text"] == text)
        assert dyn["increase_se"] < 1e-5  # the same predictions: no noise in the difference
        int8 = by[(text, "PagedCache int8")]
        assert int8["increase_se"] == perplexity.paired_se(int8["token_nll"], ref["token_nll"]) > 0
    gate_rows = perplexity.gates(rows, variants)
    assert any(g["gate"] == "PagedCache int8: perplexity increase" for g in gate_rows)
    fp8 = next(v for v in variants if v.backend == "fp8")
    if fp8.missing():  # transformers 4.57: the row is said to be missing, not silently dropped
        assert any(n.startswith("QuantizedCache fp8: not run") for n in notes)
    else:
        vs = next(g for g in gate_rows if g["gate"] == "PagedCache int8 vs QuantizedCache fp8: perplexity increase")
        assert vs["difference_se"] > 0
    setup = {"model": "tiny", "dtype": "float32", "tokens": 80, "prefill": 32, "chunk": 16}
    table = perplexity.markdown(machine() | {"transformers": transformers.__version__}, rows, gate_rows, notes, setup)
    assert "| PagedCache int8 |" in table and "a: ppl" in table


def test_paired_se():
    a, b = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    assert math.isclose(perplexity.paired_se(a, b), math.sqrt(5 / 3) / 2)  # sample std of 1..4 over sqrt(4)
    assert perplexity.paired_se(a + 7, a) == 0  # a constant difference has no noise
    assert math.isnan(perplexity.paired_se(a[:1], b[:1]))


def test_chunks():
    assert perplexity.chunks(300, 128, 64) == [(0, 128), (128, 192), (192, 256), (256, 300)]
    assert perplexity.chunks(100, 128, 64) == [(0, 100)]


def test_shared_prefix_prompts_from_real_text():
    """The TTFT workload with SmolLM2's tokenizer (only the tokenizer is loaded: the model is not needed)."""
    from kvcache.assets import AssetUnavailable, smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path(download=False)
    except AssetUnavailable:
        asset_missing("SmolLM2 is not cached (python -m kvcache.assets downloads it once)")
    pytest.importorskip("gguf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    try:
        prompts, others, sources = e2e.shared_prefix_prompts(tokenizer, 4, 128, 16)
    except AssetUnavailable:
        asset_missing("the Devil's Dictionary text is not cached (python -m kvcache.assets --text devil)")
    assert len(prompts) == len(others) == 4 and all(len(p) == 144 for p in prompts + others)
    assert prompts[0][0] == tokenizer.bos_token_id and len({tuple(p) for p in prompts + others}) == 8
    assert e2e._shared_prefix_length(prompts) >= 128
    assert sources["system"]["source"] == "pydoc" and sources["questions"]["source"] == "devil"
