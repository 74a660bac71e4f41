"""The ``"kvcache"`` attention implementation for transformers: :func:`kvcache_attention` reads the pages of a
:class:`kvcache.PagedCache` in place (the kernels' plan of the step, made once per forward); anything the
kernel cannot express goes through PyTorch. :func:`kvcache_mask` is its mask function."""

from __future__ import annotations


import torch

from . import hf_mla, residual as res
from .hf_cache import PagedCache, check_pageable, packed_attention_mask, sparse_attention_refusal, wants_grad
from .padding import PENDING_CACHE, PENDING_PADDING, Padding, leading_pads
from .step import StepPlan

__all__ = ["kvcache_attention", "kvcache_mask"]


def kvcache_mask(batch_size, *args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask function of the ``"kvcache"`` implementation: the 2-D padding mask (or None when nothing is
    padded); causality, windows and sinks are the kernel's. Leaves the padding for the cache's update. Where
    the keys do not end at the last query (a static cache's preallocated buffer) or the mask is chunked, the
    whole 4-D mask, for PyTorch's attention."""
    from transformers import masking_utils

    config = kwargs.get("config")
    check_pageable(config, "the \"kvcache\" mask")  # (the model would index this mask, and hand the kernel its picks)
    mask = masking_utils.flash_attention_mask(batch_size, *args, attention_mask=attention_mask, **kwargs)
    q_length = args[0] if args else kwargs.get("q_length", kwargs.get("cache_position"))
    q_length = int(q_length.shape[0]) if torch.is_tensor(q_length) else int(q_length)
    PENDING_PADDING.set(None if mask is None else Padding(mask, q_length))
    hf_mla.clear_pending()
    _plan_ahead(batch_size, q_length)
    if (getattr(config, "attention_chunk_size", None) and kwargs.get("mask_function") is not None
            and kwargs["mask_function"] is not masking_utils.causal_mask_function):
        # chunked attention (Llama 4's local layers): the kernel has causal and sliding-window masks, not chunks;
        # the whole mask, which sends these layers through PyTorch's attention over the pages
        return masking_utils.sdpa_mask(batch_size, *args, attention_mask=attention_mask,
                                       **{**kwargs, "allow_is_causal_skip": False})
    if not _queries_end_at_keys_end(args, kwargs):
        # keys that do not end at the last query (transformers' StaticCache and static sliding windows: the
        # whole preallocated buffer, unfilled slots included): the 2-D padding mask and bottom-right causality
        # would attend slots the prompt has not reached; the whole mask places every query where it is
        return masking_utils.sdpa_mask(batch_size, *args, attention_mask=attention_mask, **kwargs)
    return mask


def _queries_end_at_keys_end(args: tuple, kwargs: dict) -> bool:
    """Whether the mask's last query sits at its last key (the alignment the kernel and the 2-D padding mask
    assume), from the sizes transformers hands the mask function: ``q_length, kv_length, q_offset, kv_offset``
    (5.4+) or ``cache_position, kv_length, kv_offset`` (4.57 - 5.3)."""
    given = dict(kwargs)
    if args:
        names = (("cache_position", "kv_length", "kv_offset") if torch.is_tensor(args[0]) else
                 ("q_length", "kv_length", "q_offset", "kv_offset"))
        given.update(zip(names, args))
    kv_end = given.get("kv_length")
    if kv_end is None:
        return True
    kv_end = kv_end + given.get("kv_offset", 0)
    if "q_length" in given:
        q_offset = given.get("q_offset", 0)
        # (a static layer hands a tensor offset: its keys are the whole buffer, so the whole mask in any case)
        return not torch.is_tensor(q_offset) and q_offset + given["q_length"] == kv_end
    positions = given.get("cache_position")
    if not torch.is_tensor(positions) or positions.numel() == 0:
        return True
    if torch.compiler.is_compiling():
        return False  # (no host read under compile: the whole mask is right whatever the alignment)
    return int(positions[-1]) + 1 == kv_end


@torch.compiler.disable
def _plan_ahead(batch_size: int, q_length: int) -> None:
    # the cache whose get_mask_sizes transformers just asked plans its step here, before the layer loop
    cache = PENDING_CACHE.get()
    PENDING_CACHE.set(None)
    if isinstance(cache, PagedCache):
        cache._plan_ahead(int(batch_size), q_length)


_NOT_GIVEN = object()  # a model that names no sliding_window (Qwen2-MoE: its window is on the module)


def kvcache_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window=_NOT_GIVEN, softcap: float | None = None, **kwargs):
    """Attention over the pages of a :class:`PagedCache` (the tag ``update`` left on ``key``); anything
    else (no cache, another cache, masks the kernel cannot express) goes through PyTorch's SDPA."""
    if kwargs.get("indices") is not None:  # DeepSeek sparse attention hands its indexer's picks to other kernels
        raise sparse_attention_refusal(f"{type(module).__name__} passed the indexer's chosen tokens as indices=")
    tag = getattr(key, "_kvcache", None)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    # output_attentions=True: the weights, computed in PyTorch over the gathered pages as eager attention does
    weights = bool(kwargs.get("output_attentions"))
    if hf_mla.is_mla(module):  # latents in the pages; the key and value here are this forward's expansion
        pending = hf_mla.pending_write(module)  # (taken in any case: it is this layer's)
        tag = tag or pending
    if tag is not None and not torch.compiler.is_compiling():
        tag[0]._unattended = None  # this layer's K/V reached the "kvcache" attention (PagedCache._check_attended)
    if hf_mla.is_mla(module) and tag is not None and hf_mla.holds_latents(module, tag[0].store.pools[tag[1]]):
        out = _mla(module, *tag, query, key, value, attention_mask, dropout if module.training else 0.0, scaling,
                   weights=weights)
        return out if weights else (out, None)
    if sliding_window is _NOT_GIVEN:  # (a None given means no window: Exaone 4's global layers pass None and keep the
        sliding_window = getattr(module, "sliding_window", None)  # window on every module, which was applied to them)
    if tag is not None:
        _check_value(module, tag, key, value)
    # learned per-head sink logits (gpt-oss and the models built like it): a softmax term of their own, which
    # the kernel does not have
    sinks = kwargs.get("s_aux")
    if tag is not None:
        cache, layer_idx, plan = tag
        pool = cache.store.pools[layer_idx]  # (K and V rows of two widths, not MLA latents: the dense path)
        # while autograd records (training, or a forward outside torch.no_grad), PyTorch's attention over the
        # gathered pages: the kernel has no backward
        if (pool.head_dim == pool.v_head_dim and _fused_ok(cache, plan, attention_mask, query)
                and not (sliding_window and plan.residual is not None) and not wants_grad(query, key, value)
                and not weights and sinks is None):
            return _paged(cache, layer_idx, plan, query, scaling, sliding_window, softcap), None
        if cache._external_plan is not None:  # an Engine's packed step: every row's history, row after row
            if attention_mask is not None and attention_mask.dim() == 4:
                chunk = getattr(module.config, "attention_chunk_size", None)
                why = (f"chunked attention, attention_chunk_size={chunk}" if chunk else
                       "the model builds its own 4-D mask, as transformers 4.x's OPT does")
                raise ValueError(f"kvcache.Engine: this model's attention mask is more than causal and sliding "
                                 f"windows ({why}), which the packed step cannot follow; run it with "
                                 f"model.generate and a kvcache.PagedCache")
            key, value = cache._packed(layer_idx, plan, query.dtype)
            attention_mask = packed_attention_mask(plan, query.dtype, window=sliding_window)
        else:
            key, value = cache._dense(layer_idx, query.dtype, key, value)
    # (a PagedCache's sink_tokens hold here too: output_attentions and autograd forwards come this way)
    sink_tokens = tag[0].sink_tokens if tag is not None and tag[0]._external_plan is None else 0
    out = _dense_attention(query, key, value, attention_mask, dropout if module.training else 0.0, scaling,
                           sliding_window, softcap, weights=weights, sinks=sinks, sink_tokens=sink_tokens)
    return out if weights else (out, None)


def _check_value(module, tag, key: torch.Tensor, value: torch.Tensor) -> None:
    """Refuses a V other than the one the cache's update returned (DiffLlama splits and repeats V between the cache
    and its two attention calls): the kernel reads V from the pages, so it would attend to the untransformed V and
    silently give other tokens. A cast or copy of the same values passes."""
    given = getattr(key, "_kvcache_value", None)
    if given is None or value is given or torch.compiler.is_compiling():
        return
    if value.shape == given.shape and torch.equal(value, given.to(value.dtype)):
        return
    cache, layer_idx, _ = tag
    cache._unattended = None
    raise ValueError(f"kvcache: {type(module).__name__} (layer {layer_idx}) hands its attention other value states "
                     f"than the cache's update returned (the model transforms V between the cache and the attention, "
                     f"as DiffLlama does), which the \"kvcache\" attention, reading V from the pages, cannot follow: "
                     f"run it with eager or sdpa attention (its K/V are paged there too); kvcache.Engine cannot run it")


def _mla(module, cache: PagedCache, layer_idx: int, plan: StepPlan, query, key, value, mask, dropout: float,
         scaling: float, weights: bool = False):
    """An MLA layer (kvcache.hf_mla): a fresh prompt through SDPA on the module's own expansion of its tokens,
    later steps through the absorbed kernel over the latent pages, anything else on the expanded history.
    ``weights`` (output_attentions=True): (output, attention weights), eager attention's over the expanded history."""
    if weights:
        grad = wants_grad(query, key, value)
        key, value = module.expand_kv(*cache._dense(layer_idx, query.dtype, key if grad else None,
                                                    value if grad else None))
        return _dense_attention(query, key, value, mask, dropout, scaling, None, None, weights=True)
    pool = cache.store.pools[layer_idx]
    # no history, and the pages hold this forward's latents as given (full precision in the model's dtype, or a
    # full-precision window): key/value are the whole of it
    exact = plan.residual is not None or (not pool.format.k.quantized and not pool.format.v.quantized
                                           and pool.k.dtype == query.dtype)
    if cache._external_plan is None and plan.length == 0 and exact:
        return _dense_attention(query, key, value, mask, dropout, scaling, None, None)
    # while autograd records, the module's expansion of the gathered latents (the kernel has no backward); the
    # latents of recorded forwards carry their gradient there (PagedCache._dense)
    grad = wants_grad(query, key, value)
    if not grad and hf_mla.absorbable(pool, dropout) and _fused_ok(cache, plan, mask, query):
        out = hf_mla.mla_attention(module, cache, layer_idx, plan, query, scaling)
        if out is not None:
            return out
    key, value = module.expand_kv(*cache._dense(layer_idx, query.dtype, key if grad else None, value if grad else None))
    return _dense_attention(query, key, value, mask, dropout, scaling, None, None)


def _fused_ok(cache: PagedCache, plan: StepPlan, mask, query) -> bool:
    """Whether the kernel's view (stored tokens, bottom-right causal) is exactly what the mask asks for."""
    if mask is None:
        return not any(cache.pads)
    if mask.dim() != 2 or mask.shape[0] != len(cache.pads):
        return False
    key = (id(mask), plan.version, plan.length)
    if getattr(cache, "_mask_checked", None) == key:
        return cache._mask_ok
    pads = leading_pads(mask)
    total = plan.length + plan.q_len
    ok = pads is not None and [p + total - mask.shape[1] for p in pads] == cache.pads
    cache._mask_checked, cache._mask_ok = key, ok
    cache._mask_ref = mask  # keeps id(mask) from being reused while the key is live
    return ok


def _paged(cache: PagedCache, layer_idx: int, plan: StepPlan, query: torch.Tensor, scaling: float,
           sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    batch, heads, q_len, dim = query.shape
    q = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
    if plan.query_rows is not None:
        q = q.index_select(0, plan.query_rows)
    pool = cache.store.pools[layer_idx]
    if plan.residual is not None:  # (sliding windows went to the dense path: positions span two pools)
        out = res.attention(plan.residual, pool, cache.store.residual_pools[layer_idx], q, plan.cu_q_lens,
                            float(scaling), softcap=float(softcap or 0.0))
    else:  # on the step's kernel plan: no index reads on the host per layer
        out = pool.attention_planned(q, plan.kernel_plan(pool, heads), float(scaling),
                                     window_left=-1 if not sliding_window else int(sliding_window) - 1,
                                     sink_tokens=cache.sink_tokens if sliding_window else 0,
                                     softcap=float(softcap or 0.0))
    if plan.query_rows is not None:
        full = out.new_zeros(batch * q_len, heads, dim)
        full.index_copy_(0, plan.query_rows, out)
        out = full
    return out.view(batch, q_len, heads, dim)


def _dense_attention(query, key, value, mask2d, dropout, scaling, sliding_window, softcap, weights: bool = False,
                     sinks: torch.Tensor | None = None, sink_tokens: int = 0):
    """Bottom-right causal attention with a 2-D padding mask (or a ready 4-D mask) in PyTorch. ``weights``:
    returns (output, attention weights). Masked positions are masked as eager attention masks them (the dtype's
    lowest value, so a row with nothing to see, a padding query, is uniform rather than NaN). ``sinks``
    ``[heads]``: learned sink logits, one more softmax term per head that takes probability mass and adds nothing
    to the output (gpt-oss). ``sink_tokens``: with ``sliding_window``, each row's first tokens (after its left
    padding) stay visible (StreamingLLM, as the kernel's ``sink_tokens``)."""
    batch, heads, q_len, _ = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if mask2d is not None and mask2d.dim() == 4:
        if sink_tokens and sliding_window:  # (the model's own 4-D mask has its window and no sinks)
            raise ValueError(f"sink_tokens={sink_tokens}: this forward passed its own 4-D attention mask, which has "
                             f"no attention sinks; pass a 2-D padding mask, or a cache without sink_tokens")
        allowed = mask2d if mask2d.dtype == torch.bool else None
        additive = None if allowed is not None else mask2d
    else:
        i = torch.arange(q_len, device=query.device).unsqueeze(1) + (kv_len - q_len)
        j = torch.arange(kv_len, device=query.device).unsqueeze(0)
        allowed = (j <= i).view(1, 1, q_len, kv_len)
        present = None if mask2d is None else mask2d[:, -kv_len:].to(torch.bool).view(batch, 1, 1, kv_len)
        if sliding_window:
            seen = (j > i - int(sliding_window)).view(1, 1, q_len, kv_len)
            if sink_tokens:  # a row's sinks are its first tokens after its left padding
                first = (0 if present is None else
                         (~present).to(torch.int64).cumprod(-1).sum(-1, keepdim=True))  # [batch, 1, 1, 1]
                jj = j.view(1, 1, 1, kv_len)
                seen = seen | ((jj >= first) & (jj < first + int(sink_tokens)))
            allowed = allowed & seen
        if present is not None:
            allowed = allowed & present
        additive = None
    if heads != kv_heads:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    if softcap or weights or sinks is not None:
        scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if allowed is not None:  # (-inf: a padding query's row was NaN, and the NaN reached the real tokens)
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        if additive is not None:
            scores = scores + additive
        if sinks is not None:
            sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(batch, heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1).float(), dim=-1)[..., :-1].to(query.dtype)
        else:
            probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        if weights and dropout:
            probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
        out = torch.matmul(probs, value)
        if weights:
            return out.transpose(1, 2).contiguous(), probs
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=allowed if allowed is not None else additive, dropout_p=dropout,
            scale=scaling)
    return out.transpose(1, 2).contiguous()

