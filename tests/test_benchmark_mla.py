"""Plumbing of benchmarks/mla.py (not its speed): the quick mode (a tiny DeepSeek-V3) runs every mode it can,
checks the modes' logits against DynamicCache's and measures the caches' bytes per token."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:  # the CPU-only environment pins 4.57
    pytest.skip(f"transformers {transformers.__version__} hands DeepSeek's cache per-head K/V, not the latents "
                "benchmarks/mla.py pages (transformers >= 5)", allow_module_level=True)
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip(f"DeepseekV3ForCausalLM is not in transformers {transformers.__version__}", allow_module_level=True)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import mla  # noqa: E402


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("mla")
    threads = torch.get_num_threads()
    try:
        payload = mla.main(["--quick", "--out-dir", str(out), "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return payload, out


def test_files_are_written(quick):
    payload, out = quick
    assert json.loads((out / "mla.json").read_text())["rows"] == json.loads(json.dumps(payload["rows"]))
    table = (out / "mla.md").read_text()
    assert "| L | mode | format | step ms |" in table and payload["machine"]["cpu"] in table
    assert "Gate:" in table


def test_a_row_for_every_mode_and_length(quick):
    payload, _ = quick
    rows = payload["rows"]
    assert [(r["length"], r["mode"], r["format"]) for r in rows] == [
        (n, m.name, m.format) for n in mla.QUICK_LENGTHS for m in mla.MODES]
    for r in rows:
        if r["cache"] == "dynamic" or r["attn"] == "sdpa":  # these run on every kvcache
            assert r["available"], r
        if r["available"]:
            assert r["step_ms"] > 0 and r["speedup_vs_dynamic"] > 0 and len(r["step_ms_all"]) == r["rounds"] == 2
        else:  # only the absorbed attention may be missing, and the reason is kept
            assert r["attn"] == "kvcache" and r["reason"]
    assert all(r["speedup_vs_dynamic"] == 1.0 for r in rows if r["cache"] == "dynamic")
    assert payload["gate"]["result"] == "NOT MEASURED"  # the gate is at 8k; quick stops at 64


def test_logits_agree_with_dynamic_cache(quick):
    payload, _ = quick
    for check in payload["logits_checks"]:
        assert check["pass"] and check["history_effect"] > 0
    for r in payload["rows"]:
        if not r["available"]:
            continue
        assert r["logits"]["pass"]
        if r["attn"] == "sdpa" and r["format"] == "bf16":  # the pages hand back exactly the latents stored
            assert r["logits"]["max_abs_diff"] == 0.0
        if r["attn"] == "sdpa" and r["format"] == "int8":  # the default window keeps the newest 128 tokens in bf16
            window = payload["setup"]["residual_length"]   # (the absorbed rows sum in another order: never exact)
            assert (r["logits"]["max_abs_diff"] > 0) == (r["length"] > window), r  # older tokens: int8 codes


def test_bytes_per_token_match_the_arithmetic(quick):
    payload, _ = quick
    c = mla.QUICK_CONFIG
    width, layers = c["kv_lora_rank"] + c["qk_rope_head_dim"], c["num_hidden_layers"]
    for r in payload["rows"]:
        if not r["available"]:
            continue
        if r["format"] == "bf16":  # latents of (kv_lora_rank + rope) bf16 values per layer and token
            assert r["bytes_per_token"] == width * 2 * layers
            assert r["bytes_per_token_per_layer"] == width * 2
            if r["cache"] == "paged":
                assert r["dynamic_cache_bytes"] == r["bytes"]
        else:  # int8 codes and a scale per row once sealed, plus the open pages of the bf16 window
            assert width * layers <= r["sealed_bytes_per_token"] < width * 2 * layers
            window, page = payload["setup"]["residual_length"], 16
            open_tokens = r["residual_blocks"] * page
            assert min(r["length"], window) <= open_tokens <= min(r["length"], window + page)
            assert r["bytes"] == r["sealed_bytes_per_token"] * r["length"] + width * 2 * layers * open_tokens


def test_a_mode_that_raises_is_reported_not_fatal(monkeypatch):
    """A mode the installed kvcache cannot run (the absorbed attention before it landed) becomes a row that says
    so, with the error, and the other modes still run."""
    model = mla.build_model(mla.QUICK_CONFIG)
    real = mla.make_cache

    def make_cache(model, mode, latents, chunk=mla.FILL_CHUNK):
        if mode == mla.ABSORBED_BF16:
            raise ValueError("does not read yet")
        return real(model, mode, latents, chunk)

    monkeypatch.setattr(mla, "make_cache", make_cache)
    rows, check = mla.run_length(model, 32, rounds=1, log=lambda s: None)
    missing = {(r["mode"], r["format"]): r for r in rows if not r["available"]}
    assert missing[(mla.ABSORBED_BF16.name, "bf16")]["reason"] == "ValueError: does not read yet"
    assert all(r["attn"] == "kvcache" for r in missing.values())  # (int8 too, on a kvcache without it)
    assert len(rows) == len(mla.MODES) and check["pass"]
    assert mla.gate([{**r, "length": mla.GATE_LENGTH} for r in rows])["result"] == "NOT RUN"
