"""Shared by the tier tests and the worker processes they start: the tiny model and the prompts."""

from __future__ import annotations

import torch

PAGE, CHUNK = 16, 32
PREFIX_TOKENS = 6 * CHUNK  # 192: with the int8 window of 128, a mix of sealed and open pages


def tiny_model(num_attention_heads: int = 4, num_key_value_heads: int = 2, seed: int = 0, name: str | None = None):
    """A 2-layer Llama with random weights (``seed``), named as from_pretrained would (the tiers refuse an
    unnamed model): by default after its seed and shape, the same in every process; ``name=""`` leaves it
    unnamed."""
    import transformers
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=num_attention_heads,
                                      num_key_value_heads=num_key_value_heads)
    model = transformers.LlamaForCausalLM(config).eval()
    default = f"kvcache-tests/tiny-llama-h{num_attention_heads}-kv{num_key_value_heads}-seed{seed}"
    model.config._name_or_path = default if name is None else name
    return model


def prompts(seed: int, n: int, prefix_seed: int = 1) -> list[list[int]]:
    """``n`` prompts sharing one prefix (``prefix_seed``), each with its own suffix (``seed``)."""
    prefix = torch.randint(3, 128, (PREFIX_TOKENS,), generator=torch.Generator().manual_seed(prefix_seed)).tolist()
    g = torch.Generator().manual_seed(seed)
    return [prefix + torch.randint(3, 128, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 20, (n,), generator=g)]
