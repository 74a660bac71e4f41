"""Hugging Face transformers drop-in: :class:`PagedCache` as ``past_key_values``, and the ``"kvcache"``
attention implementation that reads the pages in place.

>>> import torch, kvcache, transformers
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                                   num_attention_heads=4, num_key_value_heads=2)
>>> model = transformers.LlamaForCausalLM(config).eval()
>>> cache = kvcache.PagedCache(config=model.config, kv_format="int8")
>>> out = model.generate(torch.tensor([[1, 2, 3]]), past_key_values=cache, max_new_tokens=4, do_sample=False)
>>> cache.get_seq_length(), cache.stats()["format"]
(6, 'int8+residual=128')

Two ways to attend:

- *dense* (any ``attn_implementation``: ``eager``, ``sdpa``...): ``update`` writes the new K/V into the
  pages with :func:`kvcache.append` and returns the layer's whole K/V through :func:`kvcache.paged_gather`,
  so every model works unchanged (and, in full precision, bit-identically to ``DynamicCache``).
- *fused* (``model.set_attn_implementation("kvcache")``): ``update`` only writes, and the registered
  attention function runs :func:`kvcache.paged_attention` over the pages (dequantizing in registers):
  no per-step copy of the history. Leading (left) padding is never stored; other masks fall back to
  the dense path, so results stay correct. MLA models (DeepSeek-V2/V3) attend through the absorbed
  :func:`kvcache.mla_attention` over their latent pages (:mod:`kvcache.hf_mla`).

The pages of all layers share one :class:`kvcache.BlockAllocator` (a :class:`PagedStore`). Copies of a
cache (``copy.deepcopy``, beam-search reordering, ``batch_select_indices``...) share pages copy-on-write:
full pages are shared, a shared partial page is copied on its first write.

The parts live in modules named for what they are: :mod:`kvcache.store` (the multi-layer store),
:mod:`kvcache.step` (the once-per-forward plan), :mod:`kvcache.hf_cache` (the cache),
:mod:`kvcache.hf_attention` (the attention and mask functions), :mod:`kvcache.hf_mla` (its branch for MLA
modules) and :mod:`kvcache.hf_registration` (their registration with transformers); this module gathers them.
"""

from __future__ import annotations

from .hf_attention import kvcache_attention, kvcache_mask
from .hf_cache import ATTENTION_NAME, PagedCache, PagedLayer
from .hf_registration import install_registration, register_attention
from .step import StepPlan
from .store import PagedStore

__all__ = ["PagedCache", "PagedLayer", "PagedStore", "StepPlan", "ATTENTION_NAME", "register_attention",
           "kvcache_attention", "kvcache_mask", "install_registration"]
