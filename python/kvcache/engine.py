"""A small batched generation loop over the paged cache, with prefix reuse. Not a server: a readable
loop to modify.

Each step is one forward of a *packed* batch: the new tokens of every running request side by side
(``input_ids`` ``[1, total]`` with explicit ``position_ids``), written into each request's pages and
attended with :func:`kvcache.paged_attention` over a ragged batch (``cu_q_lens``). New requests first
look their prompt up in the :class:`kvcache.PrefixCache`; they prefill only the part that was not
cached, and cache their prompt for the next ones.

>>> import torch, kvcache, transformers
>>> config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
...                                   num_attention_heads=4, num_key_value_heads=2)
>>> engine = kvcache.Engine(transformers.LlamaForCausalLM(config).eval(), page_size=4)
>>> system = list(range(1, 20))
>>> out = engine.generate([system + [30, 31], system + [40]], max_new_tokens=3)
>>> [len(r.tokens) for r in out], engine.stats()["prefix_hit_tokens"]
([3, 3], 19)
"""

from __future__ import annotations

import inspect
import math
import numbers
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from . import _html, residual as res
from .hf_cache import (ATTENTION_NAME, PagedCache, _state_layers, cache_geometry, check_pageable, is_mla_config,
                       packed_attention_mask)
from .step import plan_step
from ._args import integer_arg as _integer
from .formats import CacheFormat
from .pool import check_format_widths
from .store import PagedStore
from .prefix import Match, Namespace, OutOfBlocksError, PrefixCache, Sequence

__all__ = ["Engine", "Result"]

_TIER_COUNTERS = ("disk_hit_tokens", "remote_hit_tokens", "disk_fetch_bytes", "remote_fetch_bytes", "disk_fetch_s",
                  "remote_fetch_s", "disk_written_chunks", "remote_written_chunks", "bad_blobs", "declined_fetches",
                  "declined_tokens", "dropped_writes", "remote_errors", "remote_skipped_calls")


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if len(diff) else n


def _request_seed(seed: int, index: int) -> int:
    """The seed of request ``index``'s sampling generator: ``seed`` itself for request 0, then steps of an odd 64-bit
    constant (the golden ratio's), so that nearby seeds and indices give distinct streams; in [0, 2**64), which
    torch.Generator.manual_seed takes."""
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)


def _real(name: str, value, what: str) -> float:
    """``value`` as a float: ints, floats and numpy / torch real scalars pass; a bool or a string is a TypeError."""
    if torch.is_tensor(value) and value.dim() == 0 and not (value.is_complex() or value.dtype == torch.bool):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number ({what}), not {type(value).__name__}")
    return float(value)


def _flag(name: str, value) -> bool:
    """``value`` as a bool: True / False (or a numpy bool). Anything else is refused: ``do_sample="no"`` or
    ``progress=None`` would otherwise be read by truthiness."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be True or False, not {type(value).__name__}")
    return bool(value)


def _packing_refusal(config) -> str:
    """Why the Engine's packed steps (every request's tokens in one row, each request's attention from the step's
    plan) would give a model wrong tokens, or "" (found by an outside audit: silently other tokens, or an error from
    inside transformers)."""
    kind = getattr(config, "model_type", "")
    if getattr(config, "alibi", False) or kind in ("bloom", "mpt"):
        return ("its ALiBi position biases are built from the attention mask's positions, which the packed row "
                "does not have")
    if kind == "gpt_neo" and "local" in (getattr(config, "attention_layers", None) or ()):
        return "its local attention layers apply their window over the packed row's positions, not each request's"
    if kind == "diffllama":
        return "its attention splits V after the cache (two attention calls over halves of it), which the packed step's kernel cannot follow"
    if kind == "jetmoe":
        return "its attention does not go through transformers' attention interface"
    rope = _length_dependent_rope(config)
    if rope:
        return (f"its rotary frequencies depend on the longest position of a forward (rope_type {rope!r}): packed "
                f"with a longer request, a short one would take the long frequencies")
    return ""


def _length_dependent_rope(config) -> str:
    """The rope_type whose frequencies transformers picks from a forward's largest position ("dynamic" NTK scaling,
    Phi-3's "longrope"), or ""."""
    for name in ("rope_scaling", "rope_parameters"):
        params = getattr(config, name, None)
        if not isinstance(params, dict):
            continue
        for entry in [params, *(v for v in params.values() if isinstance(v, dict))]:  # (or one per layer type)
            kind = entry.get("rope_type") or entry.get("type")
            if kind in ("dynamic", "longrope"):
                return kind
    return ""


def _learned_position_limit(model, config) -> int | None:
    """``config.max_position_embeddings`` when the model learns a table of position embeddings (GPT-2's ``wpe``,
    OPT's and BioGPT's ``embed_positions``, which keep 2 more rows for an offset), else None: rotary and ALiBi
    models extrapolate past it (with whatever quality), a table has no row to look up."""
    limit = getattr(config, "max_position_embeddings", None)
    if type(limit) is not int or limit < 1:
        return None
    words = model.get_input_embeddings()
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if (isinstance(module, torch.nn.Embedding) and module is not words and ("pos" in leaf or leaf == "wpe")
                and limit <= module.num_embeddings <= limit + 2):
            return limit
    return None


def _model_name(model) -> str:
    """The model's ``name_or_path``: its text config's, else its own config's (a multimodal model's text config
    carries none); "" for a model whose config was made in code."""
    config = model.config
    return str(getattr(config.get_text_config(decoder=True), "_name_or_path", "")
               or getattr(config, "_name_or_path", "") or "")


def _shared_store(cache: PrefixCache, geometry: dict, *, page_size: int, kv_format, residual_length,
                  residual_sink_tokens: int) -> PagedStore:
    """The store whose pools hold the pages ``cache`` already indexes (another Engine's or PagedCache's), for an
    Engine given that cache: its block ids are only valid there. Refused unless this Engine's pages would be the
    same: page size, format and residual settings, and the model's kv heads, row widths, dtype and device."""
    store = cache.store
    if page_size != store.page_size:
        raise ValueError(f"prefix_cache: its pages are {store.page_size} tokens (the store it is bound to), not "
                         f"page_size={page_size}; give the same page_size, or a new PrefixCache")
    # the settings this Engine would give its own store (checked as for one), over the cache's allocator
    wanted = PagedStore(page_size=page_size, kv_format=kv_format, allocator=cache.allocator,
                        residual_length=residual_length, residual_sink_tokens=residual_sink_tokens)
    mine = (str(wanted.kv_format or "model dtype"), wanted.residual_label or "no residual pages")
    theirs = (str(store.kv_format or "model dtype"), store.residual_label or "no residual pages")
    if mine != theirs:
        raise ValueError(f"prefix_cache: its pages are stored as {', '.join(theirs)} (the store it is bound to), this "
                         f"Engine asks for {', '.join(mine)}; give the same kv_format / residual settings, or a new "
                         f"PrefixCache")
    bound = dict(store.engine_geometry or {})
    for pool in store.pools.values():  # a PagedCache's store: what its pools were made for
        bound.update(kv_heads=pool.num_kv_heads, k_dim=pool.head_dim, v_dim=pool.v_head_dim or pool.head_dim,
                     device=pool.k.device)
        if store.kv_format is None:
            bound["dtype"] = pool.k.dtype
    diff = [f"{k}={geometry[k]} (its pages: {v})" for k, v in bound.items() if geometry[k] != v]
    if diff:
        raise ValueError(f"prefix_cache: its pages are in the pools of another store, made for another model "
                         f"geometry: this model has {', '.join(diff)}; give this model a new PrefixCache")
    return store


# seconds a generate call runs before its bar appears: short calls (tests, a loop of small batches) stay quiet
PROGRESS_DELAY_S = 1.0


def _progress_bar(total: int, progress: bool):
    """A tqdm bar over ``total`` requests, or None when turned off, for a single prompt, or without tqdm
    (transformers brings it; kvcache itself does not depend on it)."""
    if not progress or total < 2:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="kvcache.Engine", unit="request", leave=False, delay=PROGRESS_DELAY_S)


@dataclass
class Result:
    """One request's outcome: generated ``tokens`` (and ``text`` with a tokenizer), why it stopped
    (``finish_reason``: ``"stop"`` at an end-of-sequence token, which is its last token, ``"length"`` after
    ``max_new_tokens``), how many prompt tokens came from the prefix cache, its timings (seconds from the start
    of :meth:`Engine.generate`), and how often a bounded pool preempted it."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    cached_tokens: int = 0
    first_token_s: float = 0.0
    done_s: float = 0.0
    preemptions: int = 0  # times the engine gave its pages back for an older request's (then computed them again)
    finish_reason: str = ""  # "stop" (an end-of-sequence token) or "length" (max_new_tokens); "" until it finishes

    @property
    def time_per_output_token(self) -> float:
        return (self.done_s - self.first_token_s) / max(1, len(self.tokens) - 1)


class _Running:
    def __init__(self, index: int, result: Result, seq: Sequence, node: int | None):
        self.index, self.result, self.seq, self.node = index, result, seq, node
        # tokens to feed in the next forward: the prompt's uncached part, and after a preemption the generated
        # tokens too (the last of them has not been fed yet either way)
        self.pending = (result.prompt + result.tokens)[seq.num_tokens:]
        # whether the pages hold the whole prompt: only once a forward that fed its pending tokens has completed
        # (an interrupted one may have written some layers only: never published to a tier)
        self.prompt_written = seq.num_tokens >= len(result.prompt)


class Engine:
    """Batched prefill and decode of many prompts over one paged store.

    MLA models (DeepSeek-V2/V3) attend through the absorbed kernel over their latent pages (:mod:`kvcache.hf_mla`);
    with a Hadamard-rotated latent format, which that kernel does not read, they run with the model's own
    eager/sdpa attention (sdpa unless the model uses eager) over the packed step: each layer gets every request's
    history row after row, and the model a 4-D mask that keeps each query to its own request's keys.

    Args:
        model: a transformers causal LM; the engine runs it with the ``"kvcache"`` attention implementation.
        tokenizer: optional; lets prompts be strings and results carry text.
        kv_format: storage format of the pages (default: the model's dtype).
        prefix_cache: share cached prompt prefixes between requests (and across ``generate`` calls); or a
            :class:`kvcache.PrefixCache` to use (its allocator's size bounds the pool; its ``disk`` / ``remote``
            tier options apply unless given here). The cache's pages live in one store's pools
            (``prefix_cache.store``): an Engine given a cache that another Engine (or a PagedCache) already uses
            shares that store, pools and allocator, so prefixes either computed are hits for both. That store's
            page size, format and residual settings, and the model's kv heads, head dims, dtype and device must
            then match, else a ValueError naming ``prefix_cache`` (use a new PrefixCache); its namespace (the
            model's name) keeps the prefixes of different models apart. A ``max_tokens`` that asks for another
            number of pages than that allocator has is refused (a ValueError naming both).
        page_size, max_tokens: the pages, ints (numpy / torch integer scalars too; a bool or a float is refused
            with a TypeError): ``page_size`` tokens each, and ``max_tokens`` (rounded up to whole pages) bounds
            the pool; by default it grows, or with a :class:`kvcache.PrefixCache` given is that cache's allocator.
            A bounded pool schedules: a request waits until its prompt's pages fit (after evicting unlocked cached
            prefixes), and when the running requests outgrow the pool the youngest is *preempted*: its
            pages are given back and it waits at the head of the queue with the tokens it has generated,
            which are computed again (as a prefill, from whatever of its prompt is still cached) when it
            resumes (in full precision with the tokens it gets alone; with quantized pages its recomputed
            history is read as a prefill wrote it, as after a prefix hit, which may flip near-ties). The
            oldest request always runs, so every request finishes; a request whose prompt and
            ``max_new_tokens - 1`` generated tokens (the last is never written) cannot fit the pool even alone is
            refused up front with
            :class:`OutOfBlocksError`, before any work. ``stats()`` counts ``preemptions`` and
            ``recomputed_tokens``; each :class:`Result` its own ``preemptions``.
        max_batch: requests decoded together (an int >= 1).
        residual_length, residual_sink_tokens: with a quantized format, the newest / first tokens of every
            request stay in the model's dtype (default 128 newest, the accurate configuration; 0 quantizes every
            token as written; see :class:`kvcache.PagedCache`).
        disk, remote: prefix tiers beyond this process (:mod:`kvcache.tiers`): ``disk`` a directory (or a
            :class:`kvcache.tiers.DiskTier`; made if missing, a path to a file is refused naming ``disk``),
            ``remote`` a ``redis://host:port/db`` URL (or a
            :class:`kvcache.tiers.RedisTier`). A prompt's chunks beyond the local match are fetched from them;
            a finished request's full chunks are written to them in the background. Need ``prefix_cache``, and
            a model with a ``name_or_path`` or a ``namespace`` naming it: the chunks outlive the process, and
            two unnamed models of one class would load each other's (a ValueError naming ``disk`` / ``remote``).
        chunk_tokens: tokens per tier chunk (a multiple of ``page_size``; default 256).
    """

    def __init__(self, model, tokenizer=None, *, kv_format=None, prefix_cache=True, page_size: int = 16,
                 max_tokens: int | None = None, max_batch: int = 16, namespace: Namespace | None = None,
                 residual_length: int | None = None, residual_sink_tokens: int = 0, disk=None, remote=None,
                 chunk_tokens: int | None = None):
        # The arguments are all checked before anything is made or bound: a given PrefixCache is bound to the store
        # made below for good, so a bad argument found after it would leave the cache tied to a dead Engine's store.
        text_config = model.config.get_text_config(decoder=True)
        check_pageable(text_config, "Engine (its steps use the \"kvcache\" attention)")
        refusal = _packing_refusal(text_config)
        if refusal:
            raise ValueError(f"kvcache.Engine does not run {type(model).__name__}: {refusal}; use model.generate "
                             f"with kvcache.PagedCache(config=model.config)")
        states = _state_layers(text_config)
        if states is not None:  # (refused here, not at the first generate: nothing is made or bound for it)
            layer = next(i for i, s in enumerate(states) if s is not None)
            raise ValueError(f"kvcache.Engine does not run hybrid models: layer {layer} of {type(text_config).__name__} "
                             f"is a {type(states[layer]).__name__} (a linear-attention/Mamba state of the whole "
                             f"history, not paged per token); use model.generate with "
                             f"kvcache.PagedCache(config=model.config)")
        max_batch = _integer("max_batch", max_batch, "the requests decoded together")
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1 (the requests decoded together)")
        page_size = _integer("page_size", page_size, "tokens per page")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be >= 1 (tokens per page)")
        if max_tokens is not None:
            max_tokens = _integer("max_tokens", max_tokens, "the tokens the pool holds; None: it grows")
            if max_tokens < 1:
                raise ValueError(f"max_tokens={max_tokens} must be >= 1 (the tokens the pool holds; None: it grows)")
        if residual_length is not None:  # (negative values: refused by the store, before it binds anything)
            residual_length = _integer("residual_length", residual_length, "newest tokens kept in the model's dtype")
        residual_sink_tokens = _integer("residual_sink_tokens", residual_sink_tokens,
                                        "first tokens kept in the model's dtype")
        if chunk_tokens is not None:  # (checked with or without a tier: a bad value is refused where it is given)
            from .tiers import check_chunk_tokens
            chunk_tokens = _integer("chunk_tokens", chunk_tokens, "tokens per tier chunk")
            check_chunk_tokens(chunk_tokens, page_size)
        if not isinstance(prefix_cache, (bool, np.bool_, PrefixCache)):
            raise TypeError(f"prefix_cache={prefix_cache!r} must be True, False or a kvcache.PrefixCache, not "
                            f"{type(prefix_cache).__name__}")
        if not isinstance(prefix_cache, PrefixCache):
            prefix_cache = bool(prefix_cache)
        if namespace is not None and not isinstance(namespace, Namespace):
            raise TypeError(f"namespace={namespace!r} must be a kvcache.Namespace, not {type(namespace).__name__}")
        if isinstance(prefix_cache, PrefixCache) and max_tokens is not None:
            # the cache's allocator is the pool (shared, sized when it was made): another size cannot be honoured
            alloc = prefix_cache.allocator
            pages = -(-max_tokens // page_size)
            bound_store = prefix_cache.store
            if bound_store is not None and not bound_store.fixed_size:
                raise ValueError(f"max_tokens={max_tokens} conflicts with prefix_cache, whose pool (that of the store "
                                 f"it is bound to) grows without a bound, shared; leave max_tokens out, or give a new "
                                 f"PrefixCache")
            if alloc.page_size == page_size and pages != alloc.num_blocks:  # (another page size: refused below)
                raise ValueError(
                    f"max_tokens={max_tokens} ({pages} pages of {page_size} tokens) conflicts with prefix_cache, whose "
                    f"allocator is the pool: {alloc.num_blocks} pages ({alloc.num_blocks * page_size} tokens); leave "
                    f"max_tokens out, or make the PrefixCache over a BlockAllocator({pages}, {page_size})")
        options = getattr(prefix_cache, "tier_options", None) or {}
        if disk is None and remote is None:
            disk, remote = options.get("disk"), options.get("remote")
            chunk_tokens = options.get("chunk_tokens") if chunk_tokens is None else chunk_tokens
        if disk is not None or remote is not None:
            from .tiers import DEFAULT_CHUNK_TOKENS, _as_tier, check_chunk_tokens, check_identity
            chunk_tokens = DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
            chunk_tokens = check_chunk_tokens(chunk_tokens, page_size)
            disk, remote = _as_tier(disk, "disk"), _as_tier(remote, "remote")  # a bad path or URL fails here
            check_identity(namespace, _model_name(model), type(model).__name__, disk=disk, remote=remote)
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self._max_tokens = max_tokens  # as given (the pool may be a given prefix_cache's allocator instead)
        config = model.config.get_text_config(decoder=True)
        heads, k_dim, v_dim = cache_geometry(config)
        if kv_format is not None and not is_mla_config(config):  # a width the format cannot take, refused before any
            # store is made or bound (MLA: the pages' widths depend on the transformers version, KVPool checks them)
            check_format_widths(CacheFormat.parse(kv_format), k_dim, v_dim)  # (it failed at the first generate,
            # leaving a given prefix_cache bound to this Engine's store)
        param = next(model.parameters())
        geometry = dict(layers=config.num_hidden_layers, kv_heads=heads, k_dim=k_dim, v_dim=v_dim, dtype=param.dtype,
                        device=param.device)
        if isinstance(prefix_cache, PrefixCache) and prefix_cache.store is not None:
            self.store = _shared_store(prefix_cache, geometry, page_size=page_size, kv_format=kv_format,
                                       residual_length=residual_length, residual_sink_tokens=residual_sink_tokens)
        else:
            self.store = PagedStore(page_size=page_size, kv_format=kv_format, max_tokens=max_tokens,
                                    prefix_cache=prefix_cache, residual_length=residual_length,
                                    residual_sink_tokens=residual_sink_tokens)
            self.store.engine_geometry = geometry  # what a second Engine sharing this store's pools must match
        fmt = "+".join(filter(None, ("" if kv_format is None else str(self.store.kv_format), self.store.residual_label)))
        name = _model_name(model)
        self.namespace = namespace or Namespace(model=name or type(model).__name__, kv_format=fmt)
        self.store.claim_namespace(self.namespace, model, check=namespace is None and not name)
        self.store.namespace = self.namespace
        self.store.namespace_owner = (config, name)
        self.cache = PagedCache(config, store=self.store)  # its steps are the engine's packed plans
        self._dtype_bytes = next(model.parameters()).element_size()
        self._kv_shape = (config.num_hidden_layers, heads, k_dim, v_dim)
        self._position_limit = _learned_position_limit(model, config)
        # (transformers 4.x's BLOOM refuses an argument its forward does not name; the others take it into **kwargs,
        # ignored by some: their logits are then selected here)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._admitted: list[_Running] = []
        self.latent = is_mla_config(config)  # MLA latents, read by the absorbed kernel (hf_mla); not k_dim != v_dim:
        # a latent as wide as the rotary part is MLA too
        self._stats: dict = {}
        self._forwards = 0
        self.tiers = None
        if disk is not None or remote is not None:
            from .tiers import PrefixTiers
            param = next(model.parameters())
            self.tiers = PrefixTiers(self.store, config, param.dtype, param.device, disk=disk, remote=remote,
                                     chunk_tokens=chunk_tokens)
            if self.store.prefix_cache is not None:
                self.store.prefix_cache.tiers = self.tiers

    # ---- the loop --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = 32, *, do_sample: bool = False, temperature: float = 1.0,
                 top_k: int | None = None, eos_token_id=None, seed: int = 0,
                 progress: bool = True) -> list[Result]:
        """Generates for every prompt (token-id lists, or strings with a tokenizer); results in prompt order.
        With several prompts a tqdm bar counts finished requests on stderr once the call has run for
        ``kvcache.engine.PROGRESS_DELAY_S`` (1 s); ``progress=False`` turns it off.

        A request stops after ``max_new_tokens`` or at an end-of-sequence token, kept as its last token:
        ``eos_token_id`` is an int, a list / tuple of ints or an int tensor (any of them stops, as in HF
        generate; ``[]``: none). By default (None) the ids of the model's ``generation_config.eos_token_id``,
        which HF generate stops at too, and the tokenizer's ``eos_token_id``.

        ``do_sample=True`` samples from the logits divided by ``temperature`` (> 0), among the ``top_k`` most
        likely tokens (0 or None: all). Each request draws from a generator of its own, seeded from ``seed`` and its
        index in ``prompts`` (request 0 from ``seed`` itself), so its tokens do not depend on which other requests
        share its steps: ``max_batch``, the pool's size, preemptions and prefix hits do not change them, only the
        logits can (in full precision the batched logits equal a request's own to rounding).

        Bad input (a prompt without tokens, a token id that is not an int or outside the model's vocabulary, a
        ``max_new_tokens`` that is not an int >= 1, a ``top_k`` that is not None or an int >= 0, a ``temperature``
        that is not a finite number (> 0 when sampling), a ``seed`` that is not an int, a ``do_sample`` or
        ``progress`` that is not a bool, an ``eos_token_id`` of another type) is refused before any work, naming
        the argument and its value; arguments that greedy decoding does not use are checked too."""
        # every argument is checked, used or not (a top_k=1.5 would otherwise fail inside the first step's sampling,
        # or be ignored when greedy), before any work
        max_new_tokens = _integer("max_new_tokens", max_new_tokens, "tokens per request")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1 (the first token comes with the prefill)")
        do_sample = _flag("do_sample", do_sample)
        temperature = _real("temperature", temperature, "what the logits are divided by when sampling")
        if math.isnan(temperature) or math.isinf(temperature) or do_sample and not temperature > 0:
            raise ValueError(f"temperature={temperature} must be > 0 when sampling, and finite (do_sample=False is "
                             f"greedy)")
        if top_k is not None:
            top_k = _integer("top_k", top_k, "the most likely tokens sampled from; 0 or None: all")
            if top_k < 0:
                raise ValueError(f"top_k={top_k} must be >= 0 (0 or None: no top-k filter)")
        seed = _integer("seed", seed, "of the sampling generator")
        if not -(1 << 63) <= seed < 1 << 64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed={seed} must be in [-2**63, 2**64)")
        progress = _flag("progress", progress)
        stop = self._stop_ids(eos_token_id)
        if isinstance(prompts, str) or torch.is_tensor(prompts) and prompts.dim() < 2:
            raise TypeError("prompts must be a list of prompts (token-id lists, or strings with a tokenizer); for "
                            "one prompt pass [prompt]")
        prompts = [self._encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        self._check_fits(prompts, max_new_tokens)
        bar = _progress_bar(len(prompts), progress)
        generators = [torch.Generator().manual_seed(_request_seed(seed, i)) for i in range(len(prompts))] \
            if do_sample else None
        waiting = deque((i, Result(p)) for i, p in enumerate(prompts))
        running: list[_Running] = []
        results: list[Result | None] = [None] * len(prompts)
        stats = dict(prompt_tokens=sum(map(len, prompts)), prefill_tokens=0, prefix_hit_tokens=0, steps=0,
                     peak_blocks=0, peak_kv_bytes=0, peak_dense_tokens=0, peak_dense_bytes=0, tier_hit_tokens=0,
                     preemptions=0, recomputed_tokens=0)
        tiers_before = self.tiers.stats() if self.tiers is not None else None
        self._stats = {}  # (a call that raises leaves none: the previous call's figures read as this one's)
        self.store.forget_scales()  # fp8 without a given scale: not the previous call's, if no page keeps them
        previous_impl = self.model.config._attn_implementation
        self.model.set_attn_implementation(self._attention(previous_impl))
        start = time.perf_counter()
        self._admitted = []  # every request admitted in this call (see _admit)
        try:
            while waiting or running:
                if not self._make_room(running, waiting, stats):  # no new requests in a step that preempted
                    self._admit_waiting(waiting, running, stats)
                logits = self._forward(running, stats)
                for req in running:
                    req.prompt_written = True
                now = time.perf_counter() - start
                next_tokens = self._sample(logits, temperature, top_k,
                                           None if generators is None else [generators[r.index] for r in running])
                still = []
                for req, token in zip(running, next_tokens.tolist()):
                    res = req.result
                    if not res.tokens:
                        res.first_token_s = now
                        self._cache_prompt(req)
                    res.tokens.append(token)
                    req.pending = [token]
                    if len(res.tokens) >= max_new_tokens or token in stop:
                        res.done_s = now
                        res.finish_reason = "stop" if token in stop else "length"
                        self._finish(req)
                        results[req.index] = res
                        if bar is not None:
                            bar.update(1)
                    else:
                        still.append(req)
                running = still
        finally:
            for req in running:
                self._finish(req)
            for req in self._admitted:  # (released already, but for requests an interrupt caught between their
                self._release(req)      # admission and the running list: a release of a released one is a no-op)
            self._admitted = []
            self.cache._unattended = None  # (a step stopped inside a layer leaves its mark: not the next call's)
            self.model.set_attn_implementation(previous_impl)
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - start
        if self.tokenizer is not None:
            for res in results:
                res.text = self.tokenizer.decode(res.tokens, skip_special_tokens=True)
        self._summarize(results, stats, wall)
        if self.tiers is not None:
            now = self.tiers.stats()
            self._stats.update({k: v - tiers_before[k] for k, v in now.items() if k in _TIER_COUNTERS})
            self._stats["tiers"] = now
        return results

    def _attention(self, current: str | None) -> str:
        """The attention implementation of a step: the kernel's (for MLA latents the absorbed one, kvcache.hf_mla),
        or for latents in a Hadamard-rotated format, which that kernel does not read, the model's own eager/sdpa
        over the packed history."""
        fmt = self.store.kv_format
        if not (self.latent and fmt is not None and (fmt.k.hadamard or fmt.v.hadamard)):
            return ATTENTION_NAME
        return current if current in ("eager", "sdpa") else "sdpa"

    def _stop_ids(self, eos_token_id) -> frozenset[int]:
        """The token ids that end a request: ``eos_token_id`` (an int, a list / tuple of ints or an int tensor), or
        by default the model's ``generation_config.eos_token_id`` and the tokenizer's ``eos_token_id``."""
        if eos_token_id is None:
            config = getattr(self.model, "generation_config", None)
            defaults = [getattr(config, "eos_token_id", None)]
            if self.tokenizer is not None:
                defaults.append(self.tokenizer.eos_token_id)
            return frozenset().union(*(self._stop_ids(d) for d in defaults if d is not None))
        ids = eos_token_id
        if torch.is_tensor(ids):
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() > 1:
                raise TypeError(f"eos_token_id: a tensor of stop ids must be of integers, 0-D or 1-D; got "
                                f"{ids.dtype} of shape {tuple(ids.shape)}")
            ids = ids.reshape(-1).tolist()
        elif isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
            ids = [ids]
        elif not isinstance(ids, (list, tuple)):
            raise TypeError(f"eos_token_id={eos_token_id!r} must be an int, a list / tuple of ints or an int tensor, "
                            f"not {type(eos_token_id).__name__}")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise TypeError(f"eos_token_id={eos_token_id!r}: {bad[0]!r} is not a token id (an int >= 0)")
        negative = [t for t in ids if t < 0]
        if negative:
            raise ValueError(f"eos_token_id={eos_token_id!r}: {negative[0]!r} is not a token id (an int >= 0)")
        return frozenset(int(t) for t in ids)

    def _encode(self, prompt, name: str = "prompt") -> list[int]:
        """A prompt's token ids, checked: at least one, every one an int of the model's vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need Engine(model, tokenizer=...)")
            ids = list(self.tokenizer(prompt)["input_ids"])
            if not ids:
                raise ValueError(f"{name}={prompt!r}: the tokenizer gives no tokens for it; a prompt must have at "
                                 f"least one token")
            return ids
        if torch.is_tensor(prompt):
            if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
                raise TypeError(f"{name}: token ids must be integers, got a tensor of {prompt.dtype}")
            prompt = prompt.reshape(-1).tolist()
        try:
            ids = list(prompt)
        except TypeError:
            raise TypeError(f"{name}={prompt!r}: a prompt is a list of token ids (or a string with a tokenizer); for "
                            f"one prompt pass [prompt]") from None
        if not ids:
            raise ValueError(f"{name}: a prompt must have at least one token")
        vocab = self._vocab_size()
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{name}[{j}]={t!r}: token ids must be ints, not {type(t).__name__}")
            if not 0 <= t < vocab:
                raise IndexError(f"{name}[{j}]={t} is not a token id of the model's vocabulary of {vocab} "
                                 f"(0 <= id < {vocab})")
        return [int(t) for t in ids]

    def _vocab_size(self) -> int:
        """Rows of the model's input embedding (the ids it can read), else its config's ``vocab_size``."""
        try:
            return int(self.model.get_input_embeddings().num_embeddings)
        except (AttributeError, NotImplementedError, TypeError):
            return int(self.model.config.get_text_config(decoder=True).vocab_size)

    def _check_fits(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Refuses, before any work, a request that a bounded pool cannot hold even alone (prompt and every
        token but the last generated one are written), or that needs positions past a model's learned position
        embeddings (GPT-2, OPT: it failed inside the embedding, mid-batch)."""
        if self._position_limit is not None:
            for i, prompt in enumerate(prompts):
                last = len(prompt) + max_new_tokens - 2  # the position of the last token fed (the last is not)
                if last >= self._position_limit:
                    raise ValueError(
                        f"prompts[{i}]: {len(prompt)} tokens + max_new_tokens={max_new_tokens} feed positions up to "
                        f"{last}, but {type(self.model).__name__} learns position embeddings for positions 0 to "
                        f"{self._position_limit - 1} (config.max_position_embeddings={self._position_limit}); "
                        f"nothing was run")
        if not self.store.fixed_size:
            return
        page, capacity = self.store.page_size, self.store.allocator.num_blocks
        # the bound this Engine was given: its max_tokens, else its prefix_cache's allocator (the store's max_tokens
        # is then that allocator's size, or the max_tokens of the Engine that made a shared store: not this one's)
        bound = ("the size of prefix_cache's allocator" if self._max_tokens is None
                 else f"max_tokens={self._max_tokens}, in whole pages")
        for i, prompt in enumerate(prompts):
            need = -(-(len(prompt) + max_new_tokens - 1) // page)
            if need > capacity:
                raise OutOfBlocksError(
                    f"prompts[{i}]: {len(prompt)} tokens + max_new_tokens={max_new_tokens} need up to {need} pages of "
                    f"{page} tokens, more than the pool's {capacity} ({bound}); nothing was run")

    def _make_room(self, running: list[_Running], waiting: deque, stats: dict) -> bool:
        """Takes the pages of every running request's pending tokens, oldest request first. When the pool is
        short (after evicting unlocked cached prefixes) the youngest running request is preempted: its pages go
        back and it waits at the head of the queue. Returns whether any request was preempted."""
        preempted = False
        i = 0
        while i < len(running):
            req = running[i]
            try:
                self._take_pages(req)
            except OutOfBlocksError:
                if len(running) == 1:  # alone and still short
                    if not self._unlock_own_prefix(req):  # the pool is held elsewhere (a shared PrefixCache's)
                        alloc = self.store.allocator
                        raise OutOfBlocksError(
                            f"prompts[{req.index}]: its next {len(req.pending)} token(s) do not fit the pool even "
                            f"alone: {alloc.num_free} of its {alloc.num_blocks} pages are free after evicting every "
                            f"unlocked cached prefix (is the allocator of a shared PrefixCache in use "
                            f"elsewhere?)") from None
                    continue
                victim = running.pop()
                self._preempt(victim, waiting, stats)
                preempted = True
                continue  # retry req (unless it was the victim: then i == len(running))
            i += 1
        return preempted

    def _unlock_own_prefix(self, req: _Running) -> bool:
        """Lets the prefix cache evict the prefix ``req`` matched (the sequence keeps its own references to those
        pages), so that a shared partial page's copy-on-write finds a block; whether there was a lock to drop."""
        if req.node is None:
            return False
        self.store.prefix_cache.unlock(req.node)
        req.node = None
        return True

    def _take_pages(self, req: _Running) -> None:
        """Pages for ``req``'s pending tokens (all or nothing), after copy-on-write of a shared partial page."""
        self.store.copy_blocks(self.store.allocator.append(req.seq, len(req.pending)))

    def _preempt(self, req: _Running, waiting: deque, stats: dict) -> None:
        """Gives ``req``'s pages back; it resumes first, computing its prompt and tokens again (what of its prompt
        is still cached comes from the prefix cache)."""
        self._release(req)
        req.result.preemptions += 1
        stats["preemptions"] += 1
        waiting.appendleft((req.index, req.result))

    def _admit_waiting(self, waiting: deque, running: list[_Running], stats: dict) -> None:
        """Admits waiting requests, in queue order, up to ``max_batch`` and while their pages fit the pool (a
        request that does not fit waits, and so do the ones behind it). A new request whose prompt shares at least
        a page more than it finds cached with a prompt being prefilled in this step waits one step: it will then
        reuse that prefix instead of computing it again (cache-aware scheduling). What of the shared part is
        cached already is not counted: requests that share a cached prefix are admitted together."""
        tree, page = self.store.prefix_cache, self.store.page_size
        # the prompts prefilled in this step (and cached after it), with how many of their tokens were cached
        prefilling = [(torch.tensor(r.result.prompt), r.result.cached_tokens) for r in running if not r.result.tokens]
        popped, admitted, new = [], [], []
        while waiting and len(running) + len(new) + len(admitted) < self.max_batch:
            entry = waiting.popleft()
            popped.append(entry)
            result = entry[1]
            if tree is not None and not result.tokens:
                p = torch.tensor(result.prompt)
                # its key for a lookup keeps its last token to compute
                shared = [min(_common_prefix(p, other), len(p) - 1) for other, _ in prefilling]
                if any(n >= page for n in shared) and any(c is None for _, c in prefilling):
                    looked_up = self._admit(admitted, stats)  # the admitted ones: what they find cached
                    new += looked_up
                    admitted = []
                    prefilling = [(q, c) for q, c in prefilling if c is not None]
                    prefilling += [(torch.tensor(r.result.prompt), r.result.cached_tokens) for r in looked_up
                                   if not r.result.tokens]
                    shared = [min(_common_prefix(p, other), len(p) - 1) for other, _ in prefilling]
                # p finds min(n, cached) of a shared n cached (the tree's path along both); the rest only after
                # the other one's prefill is cached
                if any(n >= page and n - min(n, cached) >= page for n, (_, cached) in zip(shared, prefilling)):
                    continue
                prefilling.append((p, None))  # its cached length is known once it is looked up
            admitted.append(entry)
        new += self._admit(admitted, stats) if admitted else []
        for k, req in enumerate(new):
            try:
                self._take_pages(req)
            except OutOfBlocksError:  # the pool is full until a running request finishes
                for r in new[k:]:  # they wait, and give back the pages their matches pinned
                    self._release(r)
                new = new[:k]
                break
        started = {id(r.result) for r in new}
        back = [e for e in popped if id(e[1]) not in started]
        if not running and not new and back:  # the pool to itself, and still short
            new = [self._admit_alone(back.pop(0), stats)]
        running += new
        waiting.extendleft(reversed(back))

    def _admit_alone(self, entry: tuple[int, Result], stats: dict) -> _Running:
        """Admits a request into a pool no other request of this engine holds. Its own matched prefix may then be
        evicted too (its sequence keeps those pages), which frees the block a shared partial page's copy-on-write
        takes; if it still does not fit, the pool is held elsewhere (a shared PrefixCache's allocator)."""
        req = self._admit([entry], stats)[0]
        self._unlock_own_prefix(req)
        try:
            self._take_pages(req)
        except OutOfBlocksError:
            self._release(req)
            alloc = self.store.allocator
            raise OutOfBlocksError(
                f"prompts[{req.index}]: its {len(req.pending)} tokens to compute do not fit the pool even alone: "
                f"{alloc.num_free} of its {alloc.num_blocks} pages are free after evicting every unlocked cached "
                f"prefix (is the allocator of a shared PrefixCache in use elsewhere?)") from None
        return req

    def _admit(self, batch: list[tuple[int, Result]], stats: dict) -> list[_Running]:
        """Requests start from the longest cached prefix of what they have to compute, all looked up in one
        call (each locked while its request runs)."""
        alloc, tree = self.store.allocator, self.store.prefix_cache
        matches = [(0, None, None)] * len(batch)  # (length, blocks, node) per request
        if tree is not None:
            keys = [(r.prompt + r.tokens)[:-1] for _, r in batch]  # keep >= 1 token to compute
            held: list[int] = []  # what the fills loaded, locked until the match below pins it
            try:
                if self.tiers is not None:  # chunks beyond the local match, from disk or Redis, into the tree
                    for k in keys:
                        stats["tier_hit_tokens"] += self.tiers.fill(k, held)
                page = self.store.page_size
                table = torch.empty(len(keys), max(-(-len(k) // page) for k in keys), dtype=torch.int32)
                cu = torch.tensor([0] + [len(k) for k in keys]).cumsum(0)
                flat = torch.tensor([t for k in keys for t in k], dtype=torch.int32)
                lengths, nodes = tree.match_ragged_into(flat, cu, table, self.namespace, lock=True)
            finally:
                for node in held:
                    tree.unlock(node)
            try:
                matches = [(n, table[i, :-(-n // page)], node) for i, (n, node) in enumerate(zip(lengths.tolist(),
                                                                                              nodes.tolist()))]
            except BaseException:  # (a KeyboardInterrupt here: the locks just taken go back)
                for node in nodes.tolist():
                    tree.unlock(node)
                raise
        running = []
        try:
            for (index, result), (length, blocks, node) in zip(batch, matches):
                running.append(_Running(index, result, alloc.sequence(Match(length, blocks, node)) if length
                                        else alloc.sequence(), node))
                if not result.tokens:  # counted at its first forward (a resumed request's hits: recomputation saved)
                    result.cached_tokens = running[-1].seq.num_tokens
        except BaseException:  # an interrupt part-way: the locks and pages taken so far go back
            for req in running:
                self._release(req)
            for _, _, node in matches[len(running):]:
                if node is not None:
                    tree.unlock(node)
            raise
        # until generate() adds them to its running requests (or a KeyboardInterrupt stops it before that), only
        # this list holds their locks and pages: generate's cleanup releases them from here
        self._admitted.extend(running)
        return running

    def _release(self, req: _Running) -> None:
        """Gives back the pages and the prefix lock of a request that has not run (or is done)."""
        self.store.allocator.release(req.seq)
        self._unlock_own_prefix(req)

    def _cache_prompt(self, req: _Running) -> None:
        tree = self.store.prefix_cache
        if tree is not None:
            prompt = torch.tensor(req.result.prompt)
            tree.insert(prompt, req.seq.blocks[: -(-len(prompt) // self.store.page_size)], self.namespace)

    def _finish(self, req: _Running) -> None:
        if self.tiers is not None and req.result.tokens and req.prompt_written:  # the prompt's pages are complete
            n = len(req.result.prompt)
            self.tiers.publish(req.result.prompt, req.seq.blocks[: -(-n // self.store.page_size)])
        self._release(req)

    def _forward(self, running: list[_Running], stats: dict) -> torch.Tensor:
        """One packed forward of every request's pending tokens; returns each request's last logits."""
        page, alloc = self.store.page_size, self.store.allocator
        tokens, positions, starts, q_lens = [], [], [], []
        for req in running:  # each already holds the pages of its pending tokens (_make_room, _admit_waiting)
            n = len(req.pending)
            start = req.seq.num_tokens - n
            tokens += req.pending
            positions += range(start, start + n)
            starts.append(start)
            q_lens.append(n)
            if not req.result.tokens:  # its first forward (a request waiting for pages may be admitted again)
                stats["prefill_tokens"] += n
                stats["prefix_hit_tokens"] += req.result.cached_tokens
            elif n > 1:  # resumed after a preemption: all but its newest token were computed before
                stats["recomputed_tokens"] += n - 1
        device = next(self.model.parameters()).device
        self.store.compact_residual()
        plan = plan_step([r.seq for r in running], starts, q_lens, packed=True, page_size=page, device=device,
                         residual=self.store.residual)
        self.store.ensure_blocks(plan.num_blocks)
        self.cache.set_step_plan(plan)
        cu_q = plan.cu_q_lens
        used = alloc.num_blocks - alloc.num_free
        stats["peak_blocks"] = max(stats["peak_blocks"], used)  # (kv_bytes: after the forward, below)
        lengths = [r.seq.num_tokens for r in running]
        stats["peak_dense_tokens"] = max(stats["peak_dense_tokens"], sum(lengths))
        stats["peak_dense_bytes"] = max(stats["peak_dense_bytes"], self._dense_bytes(lengths))
        stats["steps"] += 1
        t0 = time.perf_counter()
        mask = None if self.cache.fused else packed_attention_mask(plan, next(self.model.parameters()).dtype)
        last = cu_q[1:] - 1  # each request's last token: the logits it samples from
        keep = dict(logits_to_keep=last) if self._takes_logits_to_keep else {}
        out = self.model(input_ids=torch.tensor([tokens], device=device),
                         position_ids=torch.tensor([positions], device=device), past_key_values=self.cache,
                         attention_mask=mask, use_cache=True, **keep)
        logits = out.logits[0]
        if logits.shape[0] != len(running):  # a model that ignored logits_to_keep (transformers 4.x's GPT-J, CodeGen,
            # GPTBigCode take it into **kwargs): every position's logits, of which request i read position i
            if logits.shape[0] != len(tokens):
                raise RuntimeError(f"kvcache.Engine: {type(self.model).__name__} returned logits for "
                                   f"{logits.shape[0]} positions of a step of {len(tokens)} tokens and "
                                   f"{len(running)} requests")
            logits = logits.index_select(0, last.to(logits.device))
        logits = logits.float()
        stats["peak_kv_bytes"] = self._peak_kv_bytes(used, stats["peak_kv_bytes"])
        # mostly prefill: the cost of a token; not the engine's first forward, which pays one-time costs
        # (>= 256 tokens: shorter forwards are dominated by per-forward costs and overstate a token's)
        if self.tiers is not None and len(tokens) >= max(256, 4 * len(running)) and self._forwards:
            self.tiers.observe_compute(len(tokens), time.perf_counter() - t0)
        self._forwards += 1
        return logits

    def _peak_kv_bytes(self, blocks: int, peak: int) -> int:
        """The larger of ``peak`` and the bytes in use now: the pages of ``blocks`` blocks, and the live
        full-precision copies of the open ones (a quantized format's window: the store holds both). The live
        copies are counted (a native refcount per open block) only when they could raise the peak."""
        n = blocks * self.store.bytes_per_block()
        residual = self.store.residual
        if residual is not None and residual.slot_of:
            per_copy = self.store.residual_bytes_per_block()
            if n + len(residual.slot_of) * per_copy > peak:  # an upper bound: dead slots not collected yet
                n += sum(map(residual.is_live, residual.slot_of)) * per_copy
        return max(peak, n)

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_k: int | None,
                generators: list[torch.Generator] | None) -> torch.Tensor:
        """Row i's next token: greedy (``generators`` None), or drawn with ``generators[i]``, the generator of the
        request in row i (one draw per row per step, so a request's stream does not depend on its neighbours)."""
        if generators is None:
            return logits.argmax(dim=-1)
        logits = logits / max(temperature, 1e-5)
        if top_k:
            kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1).cpu()
        return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)])

    # ---- reporting -------------------------------------------------------------------------------
    def _dense_bytes(self, lengths: list[int]) -> int:
        """Bytes of the requests' tokens (``lengths``, one per request) in DynamicCache tensors of the model's
        dtype, one ``DynamicCache(config=config)`` per request: every token in a full-attention layer, the
        newest ``sliding_window - 1`` in a sliding-window one."""
        from . import _dynamic

        layers, heads, k_dim, v_dim = self._kv_shape
        groups = getattr(self, "_dense_groups", None)
        if groups is None:  # (window, number of layers) of the config's layers, read once
            windows = (_dynamic.layer_windows(self.cache.config) + [None] * layers)[:layers]
            groups = self._dense_groups = [(w, windows.count(w)) for w in dict.fromkeys(windows)]
        per_token_layer = heads * (k_dim + v_dim) * self._dtype_bytes
        return per_token_layer * sum(n * sum(_dynamic.held_tokens(t, w) for t in lengths) for w, n in groups)

    def _summarize(self, results: list[Result], stats: dict, wall: float) -> None:
        generated = sum(len(r.tokens) for r in results)
        s = dict(stats)
        s.update(
            requests=len(results), generated_tokens=generated, wall_s=wall,
            tokens_per_s=generated / wall if wall else 0.0,
            ttft_s=sum(r.first_token_s for r in results) / max(1, len(results)),
            # (requests of one token have no time between tokens: counted as 0 they dragged the mean down, 4x
            # with three of four requests stopping at their first token)
            tpot_s=(sum(r.time_per_output_token for r in several) / len(several)
                    if (several := [r for r in results if len(r.tokens) > 1]) else 0.0),
            prefix_hit_rate=stats["prefix_hit_tokens"] / max(1, stats["prompt_tokens"]),
            kv_bytes=stats["peak_kv_bytes"],
            dynamic_cache_bytes=stats["peak_dense_bytes"],
            format=str(self.store.kv_format) if self.store.kv_format else "model dtype",
        )
        if self.store.prefix_cache is not None:
            s["prefix_cache"] = self.store.prefix_cache.stats()
        self._stats = s

    def stats(self) -> dict:
        """Figures of the last :meth:`generate` (none, ``{}``, after one that raised): ``prompt_tokens``, ``prefill_tokens`` (computed),
        ``prefix_hit_tokens`` / ``prefix_hit_rate``, ``ttft_s`` (mean time to first token), ``tpot_s``
        (mean time per output token, over the requests that produced more than one), ``tokens_per_s``, ``kv_bytes`` (peak bytes of the pages in use, cached
        prefixes included, and of a quantized format's full-precision window pages, which the store holds
        beside their quantized blocks) against
        ``dynamic_cache_bytes`` (the peak bytes of the same requests, each in a ``DynamicCache(config=config)``
        of the model's dtype, which keeps only the newest ``sliding_window - 1`` tokens of a sliding-window
        layer where the pages hold every token: on such models ``kv_bytes`` can exceed it), and with a
        bounded pool ``preemptions`` and ``recomputed_tokens`` (the tokens preempted requests computed again).

        With ``disk`` / ``remote`` tiers, also this call's ``disk_hit_tokens``, ``remote_hit_tokens``,
        ``disk_fetch_bytes`` / ``remote_fetch_bytes`` and ``_fetch_s``, ``disk_written_chunks`` /
        ``remote_written_chunks`` (written behind: a write may land after the call returns),
        ``bad_blobs``, ``declined_fetches``, ``dropped_writes``, ``remote_errors``, and ``tiers``: the
        counters since the engine was made, ``remote_breaker_open``, each tier's cost-model constants and
        ``last_lookup`` (where the last prompt diverged from the longest cached prefix; see :meth:`explain`)."""
        s = dict(self._stats)
        if self.tiers is not None:  # writes land after generate returns
            s["tiers"] = self.tiers.stats()
        return s

    def explain(self, prompt) -> dict:
        """Where ``prompt`` diverges from the longest cached prefix: ``local_tokens`` in this process's tree,
        ``disk_tokens`` / ``remote_tokens`` as whole chunks in the tiers, ``diverged_at`` the first token
        none holds. Fetches nothing (a multi-turn miss, e.g. a chat template that rewrote an earlier turn,
        shows as a ``diverged_at`` before the old turn's end), and changes nothing: no recency, no hit counted."""
        ids = self._encode(prompt)
        if self.tiers is not None:
            return self.tiers.explain(ids)
        # (cached_length: a match made the prefix the most recent and counted a hit, so explain() changed the
        # eviction order and the prefix cache's hit rate)
        n = self.store.prefix_cache.cached_length(ids, self.namespace) if self.store.prefix_cache else 0
        return {"prompt_tokens": len(ids), "local_tokens": n, "disk_tokens": 0, "remote_tokens": 0, "diverged_at": n}

    def close(self) -> None:
        """Finishes the tiers' queued writes and stops their writer thread (at most 30 s)."""
        if self.tiers is not None:
            self.tiers.close()

    def _repr_html_(self) -> str:
        rows = {"model": type(self.model).__name__, "format": str(self.store.kv_format or "model dtype"),
                "page_size / max_batch": f"{self.store.page_size} / {self.max_batch}",
                "prefix cache": "on" if self.store.prefix_cache is not None else "off"}
        s = self._stats
        if s:
            rows.update({
                "last generate": f"{s['requests']} requests, {s['prompt_tokens']} prompt tokens, "
                                 f"{s['generated_tokens']} generated",
                "prefix hits": f"{s['prefix_hit_tokens']} tokens ({_html.percent(s['prefix_hit_rate'])})",
                "mean TTFT / TPOT": f"{1e3 * s['ttft_s']:.1f} ms / {1e3 * s['tpot_s']:.1f} ms",
                "tokens / s": f"{s['tokens_per_s']:.1f}",
                "peak KV bytes vs DynamicCache": f"{_html.human_bytes(s['kv_bytes'])} vs "
                                                 f"{_html.human_bytes(s['dynamic_cache_bytes'])}",
            })
            if s["preemptions"]:
                rows["preemptions"] = f"{s['preemptions']} ({s['recomputed_tokens']} tokens computed again)"
        return _html.table("kvcache.Engine", rows)

    def __repr__(self) -> str:
        return (f"Engine(model={type(self.model).__name__}, format={self.store.kv_format or 'model dtype'}, "
                f"page_size={self.store.page_size}, max_batch={self.max_batch}, "
                f"prefix_cache={self.store.prefix_cache is not None})")
