"""The real SmolLM2-135M through PagedCache: bit-identical to DynamicCache in dense attention, and the same
greedy tokens for 64 steps with the "kvcache" kernel. Skipped unless the model is cached (make demo, or
python -m kvcache.assets, fetches it once)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import kvcache  # noqa: E402
from kvcache import assets  # noqa: E402


@pytest.fixture(scope="module")
def smollm2():
    try:
        assets.smollm2_gguf_path(download=False)
    except assets.AssetUnavailable:
        pytest.skip("SmolLM2 is not cached")
    model, tokenizer = assets.load_smollm2(torch.float32, download=False)
    ids, _ = assets.real_token_ids(tokenizer, 160, "pydoc")
    return model, ids


def _generate(model, cache, impl, ids, n):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(ids, past_key_values=cache, max_new_tokens=n, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)


def test_smollm2_dense_is_bit_identical_and_kernel_gives_the_same_64_tokens(smollm2):
    model, ids = smollm2
    ref = _generate(model, transformers.DynamicCache(config=model.config), "sdpa", ids, 64)
    dense = _generate(model, kvcache.PagedCache(config=model.config), "sdpa", ids, 16)
    assert torch.equal(dense.sequences, ref.sequences[:, : ids.shape[1] + 16])
    assert all(torch.equal(a, b) for a, b in zip(dense.logits, ref.logits))
    fused = _generate(model, kvcache.PagedCache(config=model.config), "kvcache", ids, 64)
    assert torch.equal(fused.sequences, ref.sequences)
    worst = max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(ref.logits, fused.logits))
    assert worst <= 1e-5  # fp32 kernel vs PyTorch SDPA: summation order only


def test_demo_ops_tour_runs(capsys):
    from kvcache import demo

    demo.main(["--ops"])
    out = capsys.readouterr().out
    assert "identical to what went in: True" in out and "reads back identical: True" in out
