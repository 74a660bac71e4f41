"""What the HF drop-in tests share (test_hf, test_hybrid, test_mla): a batch with a left-padded row, the
generate modes each architecture runs, one generate call, and the largest logit difference of two runs."""

from __future__ import annotations

import torch


def inputs(length: int = 12):
    """Two rows of `length` token ids; row 1 is left-padded by 5 (ids 0, mask 0)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    ids[1, :5] = 0
    return ids, mask


MODES = {
    "greedy": lambda ids, mask: dict(input_ids=ids[:1], do_sample=False),
    "left_padding": lambda ids, mask: dict(input_ids=ids, attention_mask=mask, do_sample=False),
    "sampling": lambda ids, mask: dict(input_ids=ids, attention_mask=mask, do_sample=True, top_k=20),
    "beam_search": lambda ids, mask: dict(input_ids=ids[:1], num_beams=3, num_return_sequences=2, do_sample=False),
    "prompt_lookup": lambda ids, mask: dict(input_ids=torch.cat([ids[:1], ids[:1, :6]], 1), prompt_lookup_num_tokens=3,
                                            do_sample=False),
}


def generate(model, cache, impl, new_tokens: int = 8, **kwargs):
    use_attention(model, impl)
    torch.manual_seed(2)
    with torch.no_grad():
        return model.generate(past_key_values=cache, max_new_tokens=new_tokens, return_dict_in_generate=True,
                              output_logits=True, pad_token_id=0, **kwargs)


def max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits))


def use_attention(model, impl: str) -> None:
    """model.set_attn_implementation(impl), skipping the test where the model cannot switch: transformers 4.57
    only prints a message for classes that do not go through its AttentionInterface (StableLM, Qwen2-MoE), and
    the model stays on SDPA (an outside-in probe: the "kvcache" cases of those classes compared SDPA with SDPA)."""
    import pytest
    import transformers

    model.set_attn_implementation(impl)
    if model.config._attn_implementation != impl:
        pytest.skip(f"{type(model).__name__} cannot switch to attn_implementation={impl!r} in transformers "
                    f"{transformers.__version__} (it stays on {model.config._attn_implementation!r})")
