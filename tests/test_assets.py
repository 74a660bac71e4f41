"""benchmarks/assets.py: real text always (it ships with CPython); the SmolLM2 GGUF file and the
captured activations only when the model is already cached (nothing is downloaded here)."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import kvcache

from conftest import asset_missing

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import assets  # noqa: E402


def test_pydoc_text_is_real_and_deterministic():
    text = assets.real_text(1000, "pydoc")
    assert text.startswith('The "assert" statement')
    assert len(text) >= 3000 and text == assets.real_text(1000, "pydoc")
    assert len(assets.real_text(20000, "pydoc")) >= 60000


def test_unknown_text_source_is_refused():
    with pytest.raises(ValueError, match="unknown text source"):
        assets.real_text(10, "wikitext")


@pytest.mark.parametrize("value, is_offline", [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)])
def test_offline_rule_is_one_rule(monkeypatch, tmp_path, value, is_offline):
    """KVCACHE_OFFLINE: unset, empty and 0 allow downloads; anything else forbids them, for the library, for
    `python -m kvcache.assets` (what make test runs) and for conftest's asset_missing alike."""
    from kvcache import assets as lib_assets

    if value is None:
        monkeypatch.delenv("KVCACHE_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("KVCACHE_OFFLINE", value)
    monkeypatch.setenv("KVCACHE_ASSETS", str(tmp_path))  # empty: nothing cached
    assert lib_assets.offline() is is_offline
    assert lib_assets._download_allowed(None) is not is_offline
    if is_offline:
        with pytest.raises(lib_assets.AssetUnavailable, match="not cached"):
            lib_assets.smollm2_gguf_path()
        monkeypatch.setenv("CI", "true")
        with pytest.raises(pytest.skip.Exception):  # offline under CI: a missing asset skips, it cannot be fetched
            asset_missing("x")
    else:
        monkeypatch.setenv("CI", "true")
        with pytest.raises(pytest.fail.Exception, match="CI: x"):
            asset_missing("x")


def test_assets_command_fetches_nothing_offline(monkeypatch, tmp_path):
    """make test runs `python -m kvcache.assets` unconditionally; offline it must succeed and fetch nothing."""
    import subprocess

    monkeypatch.setenv("KVCACHE_OFFLINE", "1")
    monkeypatch.setenv("KVCACHE_ASSETS", str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "kvcache.assets", "--text", "devil"], capture_output=True, text=True,
                         check=True).stdout
    assert "fetched nothing" in out and list(tmp_path.iterdir()) == []


def test_devil_text_when_available():
    try:
        text = assets.real_text(1000, "devil", download=False)
    except assets.AssetUnavailable:
        asset_missing("dict-devil is neither installed nor cached")
    assert text.startswith("PREFACE") and "ABASEMENT" in assets.real_text(5000, "devil", download=False)


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return assets.smollm2_gguf_path(download=False)
    except assets.AssetUnavailable:
        asset_missing("SmolLM2 is not cached (python -m kvcache.assets downloads it once)")


def test_smollm2_gguf_is_the_pinned_file(gguf_path):
    assert gguf_path.stat().st_size == 98362432
    assert gguf_path.read_bytes()[:4] == b"GGUF"
    assert assets.sha256_of(gguf_path) == assets.SMOLLM2_GGUF_SHA256


def test_smollm2_capture_matches_its_own_attention(gguf_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    model, tokenizer = assets.load_smollm2()
    ids, sample = assets.real_token_ids(tokenizer, 48, "pydoc")
    assert ids.shape == (1, 48) and sample.num_tokens == 48 and ids[0, 0] == tokenizer.bos_token_id
    layers, logits = assets.capture_attention_inputs(model, ids)
    assert model.config._attn_implementation == "sdpa"          # restored
    assert [layer.layer for layer in layers] == list(range(30)) and logits.shape == (1, 48, 49152)
    for layer in (layers[0], layers[-1]):
        assert layer.q.shape == (48, 9, 64) and layer.k.shape == layer.v.shape == (48, 3, 64)
        out, _ = kvcache.reference.attention(layer.q, layer.k, layer.v, layer.scaling, compute_dtype=torch.float64)
        torch.testing.assert_close(out, layer.out, rtol=1e-4, atol=1e-5)
    # a real model on real text predicts it far better than chance (perplexity << vocab size)
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    assert nll.exp() < 200


def test_smollm2_checkpoint_holds_the_gguf_weights_and_tokenizer(gguf_path):
    """load_smollm2 reads the checkpoint it made from the GGUF file once: the same bits as the GGUF path, in
    float32 and bfloat16, the same tokens, the tied head kept, and no half-written folder left behind."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tokenizer = assets.load_smollm2()
    assert not list(gguf_path.parent.glob("*.part-*"))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    direct = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    bf16, _ = assets.load_smollm2(torch.bfloat16)
    assert all(torch.equal(a, b.to(torch.bfloat16)) for a, b in zip(bf16.state_dict().values(), theirs.values()))
    direct_tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    text = assets.real_text(2000, "pydoc") + "\n<|im_start|>user\nHi!<|im_end|>"
    assert tokenizer(text).input_ids == direct_tokenizer(text).input_ids
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (direct_tokenizer.bos_token_id, direct_tokenizer.eos_token_id)
    assert tokenizer.chat_template == direct_tokenizer.chat_template
