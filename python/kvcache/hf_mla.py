"""Absorbed MLA attention for transformers' multi-head latent attention modules (DeepSeek-V2/V3 and the models
built like them), on the latent pages of a :class:`kvcache.PagedCache`: the adapter between the model and
:func:`kvcache.mla_attention`.

In transformers 5 an MLA module hands the cache its latents, ``kv_nope`` ``[b, 1, s, kv_lora_rank]`` as the key
and the rotated ``k_rot`` ``[b, 1, s, qk_rope_head_dim]`` as the value, then expands the key and value of every
head through ``kv_b_proj`` (``expand_kv``) and calls the attention function. Under the ``"kvcache"``
attention the cache's ``update`` only writes the latents and returns the new ones, so the module expands only
this forward's tokens, never the history; the attention function then ignores those expansions and runs

    q_latent = q_nope @ W_UK[h]                                   (the key up-projection, folded into the query)
    o_latent = mla_attention(q_latent, q_rope, latent pages)      (softmax over c_j and k_rope_j, output in latent space)
    out      = o_latent @ W_UV[h]^T                               (the value up-projection)

with ``W_UK`` / ``W_UV`` read from ``module.kv_b_proj`` (``[heads * (qk_nope_head_dim + v_head_dim),
kv_lora_rank]``). Nothing of the model is replaced: the module runs its own forward, and this is the branch of
the attention function that recognizes it (:func:`is_mla`).

A forward with no history before it (a fresh prompt, not through :class:`kvcache.Engine`) whose latents the pages
hold as given (full precision, or quantized formats inside their full-precision window) attends with PyTorch's
SDPA on the keys and values the module just expanded, as vLLM and FlashMLA do for prefill: for long query blocks
the expanded form costs fewer multiply-adds (``qk_nope + qk_rope`` per score instead of ``kv_lora_rank +
qk_rope``). What the kernel cannot express (masks other than left padding, Hadamard-rotated formats, dropout in
training, a quantized ``kv_b_proj``) goes through the module's own ``expand_kv`` over the gathered history.
"""

from __future__ import annotations

import contextvars

import torch

from . import residual as res

__all__ = ["is_mla", "holds_latents", "absorbable", "clear_pending", "leave_pending", "pending_write", "mla_attention"]

# The MLA module's latents lose the cache's tag when the module expands them (``expand_kv`` makes new
# tensors), so ``PagedCache.update`` leaves (cache, layer index, step plan) here for the attention function of
# the same layer; it is taken (and cleared) by that call.
_PENDING: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("kvcache_mla_pending", default=None)


def is_mla(module) -> bool:
    """Whether ``module`` is an MLA attention module built as transformers' DeepSeek-V3 one."""
    return all(hasattr(module, name) for name in ("kv_b_proj", "kv_lora_rank", "qk_nope_head_dim",
                                                  "qk_rope_head_dim", "v_head_dim", "num_heads"))


def clear_pending() -> None:
    """Called at the start of every forward (the mask function): nothing left by an interrupted one is taken."""
    _PENDING.set(None)


def holds_latents(module, pool) -> bool:
    """Whether ``pool`` holds ``module``'s latents (transformers >= 5), not the expanded per-head K/V that
    transformers 4.x hands the cache (the attention function then reads those through the dense path).
    NOTE: the widths alone can coincide (kv_lora_rank = qk_nope + qk_rope and v_head_dim = qk_rope: a 4.x
    module's expanded K/V then looked like latents and decoded wrong tokens), so the module must also be one
    that hands latents (it has ``expand_kv``) and the pool one head wide, as latents are."""
    return (callable(getattr(module, "expand_kv", None)) and pool.num_kv_heads == 1
            and pool.head_dim == module.kv_lora_rank and pool.v_head_dim == module.qk_rope_head_dim)


def leave_pending(cache, layer_idx: int, plan) -> None:
    """Called by ``PagedCache.update`` when it wrote a layer's latents under the ``"kvcache"`` attention."""
    _PENDING.set((cache, layer_idx, plan))


def pending_write(module) -> tuple | None:
    """The (cache, layer index, plan) ``update`` left for ``module``'s layer, if any (taken once)."""
    pending = _PENDING.get()
    _PENDING.set(None)
    if pending is None or pending[1] != getattr(module, "layer_idx", None):
        return None
    return pending


def _weights(module, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``W_UK`` ``[heads, qk_nope, kv_lora_rank]`` and ``W_UV`` ``[heads, v_head_dim, kv_lora_rank]`` (views of
    ``kv_b_proj.weight``), or None when that weight is not a plain floating-point matrix (quantized layers)."""
    w = getattr(module.kv_b_proj, "weight", None)
    nope, v_dim, heads = module.qk_nope_head_dim, module.v_head_dim, module.num_heads
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or type(w) not in (torch.Tensor, torch.nn.Parameter):
        return None
    if tuple(w.shape) != (heads * (nope + v_dim), module.kv_lora_rank):
        return None
    w = w.to(dtype).view(heads, nope + v_dim, module.kv_lora_rank)
    return w[:, :nope], w[:, nope:]


def absorbable(pool, dropout: float) -> bool:
    """Whether the absorbed kernel can run this layer's step (else: the module's own expansion of the history)."""
    return dropout == 0.0 and not pool.format.k.hadamard and not pool.format.v.hadamard


def mla_attention(module, cache, layer_idx: int, plan, query: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """The layer's attention output ``[batch, q_len, heads, v_head_dim]`` through the absorbed kernel over its
    latent pages, or None if the weights are not usable as ``W_UK`` / ``W_UV`` (then the caller expands)."""
    weights = _weights(module, query.dtype)
    if weights is None:
        return None
    w_uk, w_uv = weights
    batch, heads, q_len, _ = query.shape
    nope = module.qk_nope_head_dim
    q = query.transpose(1, 2).reshape(batch * q_len, heads, -1)           # [tokens, heads, nope + rope]
    if plan.query_rows is not None:
        q = q.index_select(0, plan.query_rows)
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk).transpose(0, 1)   # [tokens, heads, kv_lora_rank]
    q_rope = q[..., nope:]
    pool = cache.store.pools[layer_idx]
    if plan.residual is not None:
        o_latent = res.mla_attention(plan.residual, pool, cache.store.residual_pools[layer_idx], q_latent, q_rope,
                                     plan.cu_q_lens, float(scaling))
    else:
        o_latent = pool.mla_attention(q_latent, q_rope, plan.block_tables, plan.seq_lens, plan.cu_q_lens,
                                      float(scaling))
    out = torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [tokens, heads, v_head_dim]
    if plan.query_rows is not None:
        full = out.new_zeros(batch * q_len, heads, out.shape[-1])
        full.index_copy_(0, plan.query_rows, out)
        out = full
    return out.reshape(batch, q_len, heads, -1)
