"""Typed wrappers of the ``torch.ops.kvcache`` ops.

The ops are defined in C++ (``csrc/ops.cpp``) and called here through their ``.default`` overloads:
no Python ``torch.library.custom_op`` sits on the hot path. The per-layer ops (``append``,
``paged_attention`` and their planned forms) take a shorter road in eager mode with plain tensors: the same
op through torch's C++ dispatcher, reached from ``kvcache._C`` without torch.ops' argument parsing
(csrc/direct_calls.cpp; ~2 us less per call). Every op that writes its arguments returns
nothing, so torch.compile generates its fake (meta) kernel itself; only ``plan_step``, whose outputs' sizes
depend on the data, has a Python one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import _C as _native  # (its import registers torch.ops.kvcache)
from ._args import integer_arg
from .formats import KVFormat

_ops = torch.ops.kvcache
_library_ops = _ops  # (tests point _ops at the emulated CUDA kernels' namespace: the direct path then steps aside)
_is_compiling = torch.compiler.is_compiling
_torch_function_mode = torch._C._is_torch_function_mode_enabled
_Tensor = torch.Tensor


def _direct(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a per-layer op may take its direct entry point: eager mode (torch.compile traces the torch.ops
    call), plain tensors and no torch-function mode (the direct path does not look for ``__torch_function__``;
    ``__torch_dispatch__`` subclasses and modes it does see, in the dispatcher)."""
    return (type(a) is _Tensor and type(b) is _Tensor and _ops is _library_ops and not _is_compiling()
            and not _torch_function_mode())


def _name_bad_int(**ints) -> None:
    """Raises a ValueError naming the first Python int argument out of int64's range. Called after a call fails:
    pybind11 (the direct path) answers such an int with a TypeError that prints every argument, whole pools
    included, and torch.ops with "Expected a value of type 'int' ... but instead found type 'int'"."""
    for name, value in ints.items():
        if isinstance(value, int) and not -2**63 <= value < 2**63:
            shown = value if value.bit_length() <= 256 else f"an integer of {value.bit_length()} bits"
            raise ValueError(f"{name} = {shown} is out of range: it must fit in int64 "
                             f"[-2**63, 2**63)") from None


def _name_bad_float(**floats) -> None:
    """Raises an error naming the first float argument that is no float: an int too large for a double
    (``float()`` answers it with an OverflowError that names nothing) or another type (a str that ``float()``
    would parse included). None (the default) and Python floats pass at once."""
    for name, value in floats.items():
        if value is None or type(value) is float:
            continue
        if isinstance(value, (str, bytes, bool)) or not hasattr(type(value), "__float__"):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}")
        try:
            if isinstance(value, int):  # (not SymFloats under torch.compile: no specialization)
                float(value)
        except OverflowError:
            raise ValueError(f"{name} = an integer of {value.bit_length()} bits is out of range: it must be a "
                             f"finite float") from None


def _int_args(window_left, sink_tokens):
    """``window_left`` and ``sink_tokens`` as ints: a float (``2.5``) or a bool is a TypeError naming the argument,
    not a window silently truncated by ``int()``. Plain ints pass at once (this runs per layer and step)."""
    if type(window_left) is not int and not isinstance(window_left, torch.SymInt):  # (SymInts: torch.compile)
        window_left = integer_arg("window_left", window_left, "keys to the left of each query, -1: all")
    if type(sink_tokens) is not int and not isinstance(sink_tokens, torch.SymInt):
        sink_tokens = integer_arg("sink_tokens", sink_tokens, "the first keys, always visible")
    return window_left, sink_tokens


def _format_of(kernel_id: int, name: str) -> KVFormat:
    """The format a kernel id names; a bad id is an error that names the argument."""
    try:
        return KVFormat.from_kernel_id(kernel_id)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None

def append(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
           k_format: int = 0, v_format: int = 0) -> None:
    """Writes the K/V of new tokens into the page pools.

    Args:
        key, value: ``[batch, num_kv_heads, q_len, head_dim]`` (value: ``v_head_dim``, the V pool's row width,
            which may differ from the K pool's: MLA latents), any strides (as Hugging Face models hand them
            over), same dtype as the pools.
        k_cache, v_cache: pools ``[num_blocks, num_kv_heads, page_size, head_dim]`` (``v_cache``: ``v_head_dim``),
            written in place.
        slot_mapping: ``[batch, q_len]`` int64; ``slot = block_id * page_size + offset``, -1 skips a token.
        k_scale, v_scale, k_format, v_format: quantized storage (see :class:`kvcache.KVPool`, which passes
            them for you): K/V are quantized on the way in, int8 scales written per row.

    Bad values: full-precision pools store K/V as given (NaN payloads included). Quantized pools compute every
    scale and zero point from finite values only, so a NaN or +-Inf changes nothing stored for other tokens;
    NaN is stored as NaN where the format can (fp8 code 0x7f; a NaN scale for the token's int8 row or int4 /
    KIVI-value group), else as the code nearest 0 (KIVI keys); +-Inf as the largest code of its sign. int4 and
    KIVI saturate values at +-65504 (fp16 metadata); no stored scale overflows. (README: "Bad values".)

    >>> import torch, kvcache
    >>> k_cache, v_cache = kvcache.PageLayout(2, 4, 1, 8, torch.float32).allocate(fill=0.0)
    >>> key = torch.ones(1, 1, 2, 8); value = 2 * key
    >>> kvcache.append(key, value, k_cache, v_cache, torch.tensor([[5, -1]]))
    >>> k_cache[1, 0, 1].tolist() == [1.0] * 8, float(v_cache.sum())
    (True, 16.0)
    """
    op = _native.append if _direct(key, k_cache) else _ops.append.default
    try:  # (free unless it raises)
        op(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_format, v_format)
    except (TypeError, RuntimeError):
        _name_bad_int(k_format=k_format, v_format=v_format)
        raise


def paged_gather(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int | None = None, *,
                 out: tuple[torch.Tensor, torch.Tensor] | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, k_format: int = 0,
                 v_format: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers each sequence's pages into padded ``[batch, num_kv_heads, max_len, head_dim]`` K and V (V rows
    as wide as the V pool's, which may differ from K's).

    Rows past a sequence's length are zero. ``block_tables`` is ``[batch, max_blocks]`` int32 and
    ``seq_lens`` ``[batch]`` int32. Without ``out``, ``max_len`` defaults to ``max(seq_lens)``.

    >>> import torch, kvcache
    >>> layout = kvcache.PageLayout(4, 2, 1, 3, torch.float32)
    >>> k_cache = torch.arange(24.).view(layout.shape); v_cache = -k_cache
    >>> k, v = kvcache.paged_gather(k_cache, v_cache, torch.tensor([[3, 1]], dtype=torch.int32),
    ...                             torch.tensor([3], dtype=torch.int32))
    >>> k[0, 0].tolist()
    [[18.0, 19.0, 20.0], [21.0, 22.0, 23.0], [6.0, 7.0, 8.0]]
    """
    if out is None:
        if max_len is None:  # (a negative length sizes nothing: the op names it)
            max_len = max(0, int(seq_lens.max())) if seq_lens.numel() else 0
        elif not 0 <= max_len < 2**63:
            _name_bad_int(max_len=max_len)
            raise ValueError(f"max_len = {max_len} must be >= 0")
        k_dim, v_dim, heads = _row_widths(k_cache, v_cache, k_format, v_format)
        shape = (seq_lens.shape[0], heads, max_len)
        dtype = _gather_dtype(k_cache, v_cache, k_format, v_format)
        out = (k_cache.new_empty(shape + (k_dim,), dtype=dtype), v_cache.new_empty(shape + (v_dim,), dtype=dtype))
    try:
        _ops.paged_gather.default(k_cache, v_cache, block_tables, seq_lens, out[0], out[1], k_scale, v_scale, k_format,
                                  v_format)
    except (TypeError, RuntimeError):
        _name_bad_int(k_format=k_format, v_format=v_format)
        raise
    return out


def paged_gather_ragged(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        cu_seq_lens: torch.Tensor, *,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, k_format: int = 0,
                        v_format: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathers the pages into packed ``[total_tokens, num_kv_heads, head_dim]`` K and V (V: ``v_head_dim``).

    Sequence ``b`` occupies rows ``cu_seq_lens[b]:cu_seq_lens[b + 1]`` (``cu_seq_lens`` is
    ``[batch + 1]`` int32, starting at 0), the varlen convention of FlashAttention.
    """
    if out is None:
        total = max(0, int(cu_seq_lens[-1])) if cu_seq_lens.numel() else 0  # (a negative total: the op names it)
        k_dim, v_dim, heads = _row_widths(k_cache, v_cache, k_format, v_format)
        dtype = _gather_dtype(k_cache, v_cache, k_format, v_format)
        out = (k_cache.new_empty((total, heads, k_dim), dtype=dtype), v_cache.new_empty((total, heads, v_dim), dtype=dtype))
    try:
        _ops.paged_gather_ragged.default(k_cache, v_cache, block_tables, cu_seq_lens, out[0], out[1], k_scale, v_scale,
                                         k_format, v_format)
    except (TypeError, RuntimeError):
        _name_bad_int(k_format=k_format, v_format=v_format)
        raise
    return out


def _gather_dtype(k_cache: torch.Tensor, v_cache: torch.Tensor, k_format: int, v_format: int) -> torch.dtype:
    """The gathers' output dtype: that of the full-precision side (``k=int8,v=bf16`` gives V's bf16 for both),
    float32 when both sides are quantized (they dequantize to it)."""
    if k_format == 0:
        return k_cache.dtype
    return v_cache.dtype if v_format == 0 else torch.float32


def _row_widths(k_cache: torch.Tensor, v_cache: torch.Tensor, k_format: int, v_format: int) -> tuple[int, int, int]:
    """(K row width, V row width, kv heads) in dims of pools of these formats (packed codes: several dims per
    byte); the op itself checks the rest."""
    k_per, v_per = _format_of(k_format, "k_format").dims_per_code, _format_of(v_format, "v_format").dims_per_code
    if k_cache.dim() != 4 or v_cache.dim() != 4:  # the op names the bad shape
        return (k_cache.shape[-1] * k_per if k_cache.dim() else 0), (v_cache.shape[-1] * v_per if v_cache.dim() else 0), (
            k_cache.shape[1] if k_cache.dim() > 1 else 0)
    return k_cache.shape[3] * k_per, v_cache.shape[3] * v_per, k_cache.shape[1]


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies whole blocks within one pool (copy-on-write): ``block_mapping`` is ``[n, 2]`` int64 of
    (src, dst) pairs; destinations are distinct and never also sources in the same call. The K and V pools
    may differ in row width (each block of each is copied whole)."""
    _ops.copy_blocks.default(k_cache, v_cache, block_mapping)


def swap_blocks(k_src: torch.Tensor, v_src: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """Copies blocks between two pools of the same block shape, e.g. device <-> host (K blocks like K blocks,
    V blocks like V blocks: their rows may differ in width).

    ``block_mapping`` is a CPU ``[n, 2]`` int64 tensor of (block in src pools, block in dst pools).
    """
    _ops.swap_blocks.default(k_src, v_src, k_dst, v_dst, block_mapping)


def _attention_outputs(query: torch.Tensor, scale: float | None, return_lse: bool, out: torch.Tensor | None,
                       lse: torch.Tensor | None):
    """The attention ops' defaults: scale ``head_dim ** -0.5``, a contiguous ``out`` like the query, an lse."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)  # (2x cheaper than torch.empty)
    if return_lse and lse is None:
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    return scale, out, lse


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_q_lens: torch.Tensor, scale: float | None = None, *,
                    window_left: int = -1, sink_tokens: int = 0, softcap: float = 0.0,
                    return_lse: bool = False, out: torch.Tensor | None = None,
                    lse: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, k_format: int = 0,
                    v_format: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a ragged batch of queries straight over the pages (decode and chunked prefill alike).

    Args:
        query: ``[total_q, q_heads, head_dim]``; sequence ``b``'s queries are rows
            ``cu_q_lens[b]:cu_q_lens[b + 1]`` and are its *last* tokens (already appended to the pages).
        k_cache, v_cache: the pools of one layer, ``[num_blocks, kv_heads, page_size, head_dim]``, rows of one
            width (pools whose K and V rows differ, MLA latents, are refused: :func:`mla_attention` reads them).
        block_tables: ``[batch, max_blocks]`` int32. seq_lens: ``[batch]`` int32 tokens in the pages.
        cu_q_lens: ``[batch + 1]`` int32 query offsets.
        scale: softmax scale, default ``head_dim ** -0.5``.
        window_left: keys to the left of each query it may see (-1: all). sink_tokens: the first keys,
            always visible (StreamingLLM). softcap: ``softcap * tanh(s / softcap)`` on the scores if > 0.
        return_lse: also return the log-sum-exp ``[total_q, q_heads]`` (float32) of the scaled scores.

    Causal masking is aligned bottom-right: query ``i`` of a sequence with ``q_len`` queries and
    ``seq_len`` tokens is at position ``seq_len - q_len + i``, so one query is a decode step and
    many are a prefill chunk; a batch may mix both. GQA/MQA: query head ``h`` reads KV head
    ``h // (q_heads // kv_heads)``. K and V are both full precision or both quantized (``k_format`` and
    ``v_format`` both 0 or both not; a mix is refused).

    Inference only: the op has no backward, so the output of a query that requires grad does not.
    """
    _name_bad_float(scale=scale, softcap=softcap)
    window_left, sink_tokens = _int_args(window_left, sink_tokens)
    scale, out, lse = _attention_outputs(query, scale, return_lse, out, lse)
    op = _native.paged_attention if _direct(query, k_cache) else _ops.paged_attention.default
    try:
        op(query, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, float(scale), int(window_left),
           int(sink_tokens), float(softcap), out, lse, k_scale, v_scale, k_format, v_format)
    except (TypeError, RuntimeError):
        _name_bad_int(window_left=window_left, sink_tokens=sink_tokens, k_format=k_format, v_format=v_format)
        raise
    return (out, lse) if return_lse else out


def mla_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_q_lens: torch.Tensor, scale: float, *,
                  return_lse: bool = False, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, k_format: int = 0,
                  v_format: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Absorbed multi-head latent attention (DeepSeek-V2/V3) straight over latent pages.

    An MLA model caches per token a latent ``c`` (``kv_lora_rank`` dims) and the rotated key part ``k_rope``
    (``qk_rope_head_dim`` dims): here they are the K and V rows of pools of two widths, as
    :class:`kvcache.PagedCache` stores them. Head ``h``'s key is ``W_UK[h] c`` and its value ``W_UV[h] c``;
    folding ``W_UK`` into the query (``q_latent = q_nope @ W_UK[h]``) gives the same scores against ``c``,
    and the output is taken in latent space, so no key or value is ever expanded:

        s_j = scale * (q_latent . c_j + q_rope . k_rope_j),   out = sum_j softmax(s)_j c_j

    (the caller applies ``W_UV``). Quantized latents (formats as for :func:`append`, not ``hadamard``) are
    dequantized as they are read.

    Args:
        q_latent: ``[total_q, q_heads, kv_lora_rank]``; q_rope: ``[total_q, q_heads, qk_rope_head_dim]``, same
            dtype; sequence ``b``'s queries are rows ``cu_q_lens[b]:cu_q_lens[b + 1]``, its last tokens, causal
            and bottom-right as in :func:`paged_attention`.
        k_cache, v_cache: the latent and rope pools ``[num_blocks, kv_heads, page_size, kv_lora_rank]`` and
            ``[..., qk_rope_head_dim]``; query head ``h`` reads kv head ``h // (q_heads // kv_heads)``.
        block_tables, seq_lens, cu_q_lens: as for :func:`paged_attention`.
        scale: the softmax scale of the model (MLA models fold a YaRN factor into it; there is no default).
        return_lse: also return the log-sum-exp ``[total_q, q_heads]`` (float32).

    Returns ``out`` ``[total_q, q_heads, kv_lora_rank]`` in the query's dtype (and the lse).

    >>> import torch, kvcache
    >>> pool = kvcache.KVPool.allocate(4, 4, 1, 8, torch.float32, v_head_dim=2)
    >>> c, k_rope = torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 2)
    >>> pool.append(c, k_rope, torch.tensor([[0, 1, 2]]))
    >>> q_latent, q_rope = torch.randn(1, 16, 8), torch.randn(1, 16, 2)
    >>> out = kvcache.mla_attention(q_latent, q_rope, pool.k, pool.v, torch.tensor([[0]], dtype=torch.int32),
    ...                             torch.tensor([3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 0.3)
    >>> s = 0.3 * (q_latent[0] @ c[0, 0].T + q_rope[0] @ k_rope[0, 0].T)
    >>> torch.allclose(out[0], torch.softmax(s, -1) @ c[0, 0], atol=1e-5)
    True
    """
    if scale is None:  # (no head_dim ** -0.5 default: the latent's width is not the model's head_dim)
        raise TypeError("mla_attention: scale must be a float (the model's softmax scale); it has no default")
    _name_bad_float(scale=scale)
    if out is None:
        out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    if return_lse and lse is None:
        lse = torch.empty(q_latent.shape[:2], dtype=torch.float32, device=q_latent.device)
    try:
        _ops.mla_attention.default(q_latent, q_rope, k_cache, v_cache, block_tables, seq_lens, cu_q_lens,
                                   float(scale), out, lse, k_scale, v_scale, k_format, v_format)
    except (TypeError, RuntimeError):
        _name_bad_int(k_format=k_format, v_format=v_format)
        raise
    return (out, lse) if return_lse else out


class StepPlanTensors(NamedTuple):
    """What :func:`plan_step` returns: ``host`` (CPU, uint8: the header and the task list) and ``device``
    (uint8 on the pools' device: the validated tables, lengths and slots, and the task list). Read-only."""

    host: torch.Tensor
    device: torch.Tensor


def plan_step(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              cu_q_lens: torch.Tensor, slot_mapping: torch.Tensor | None = None, *, q_heads: int,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, k_format: int = 0,
              v_format: int = 0) -> StepPlanTensors:
    """Plans one step (decode or prefill) for every layer whose pools share this shape and format.

    Reads ``block_tables``, ``seq_lens``, ``cu_q_lens`` (as for :func:`paged_attention`) and ``slot_mapping``
    (as for :func:`append`; optional) on the host once, validates them against the pools with the same
    errors as those ops, and splits the attention into tasks. The index tensors may stay on the host while
    the pools live on a device: the plan is uploaded once. Per layer, :func:`paged_attention_planned` and
    :func:`append_planned` then check only shapes, dtypes, devices and formats, read no index values on the
    host (no synchronization on a GPU), and give bit-identical results to the unplanned ops. A plan serves
    pools with at least as many blocks as it uses; ``q_heads`` is the query's head count.

    The two tensors go together, unmodified: the per-layer ops trust the validated indices in ``device``. They
    refuse the halves of two different plans (both carry the plan's id, a hash of its contents: a ValueError
    naming the plan), but cannot tell index values changed by hand inside ``device`` (on a GPU that would take
    a read per layer): a plan's tensors must not be modified.

    Threads: on the CPU the plan fixes how long contexts are split into tasks, from the thread count when it is
    made (``torch.get_num_threads()``). A planned op gives the same result under any thread count, and the one
    of the unplanned op run with the planning thread count; if the count changes in between, the unplanned op
    splits differently, which changes the rounding (~1e-7 in float32). Plan after ``torch.set_num_threads``.

    >>> import torch, kvcache
    >>> k_cache, v_cache = kvcache.PageLayout(4, 16, 2, 64, torch.float32).allocate(fill=0.0)
    >>> table, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([17], dtype=torch.int32)
    >>> cu = torch.tensor([0, 1], dtype=torch.int32)
    >>> slots = torch.tensor([[16]])  # token 16 of the sequence: block 0 (the table's 2nd page), offset 0
    >>> plan = kvcache.plan_step(k_cache, v_cache, table, lens, cu, slots, q_heads=4)
    >>> for layer in range(2):  # per layer: no index reads
    ...     kvcache.append_planned(plan, torch.ones(1, 2, 1, 64), torch.ones(1, 2, 1, 64), k_cache, v_cache)
    ...     out = kvcache.paged_attention_planned(plan, torch.randn(1, 4, 64), k_cache, v_cache)
    >>> out.shape
    torch.Size([1, 4, 64])
    """
    try:
        host, device = _ops.plan_step.default(k_cache, v_cache, block_tables, seq_lens, cu_q_lens, slot_mapping,
                                              int(q_heads), k_scale, v_scale, k_format, v_format)
    except (TypeError, RuntimeError):
        _name_bad_int(q_heads=q_heads, k_format=k_format, v_format=v_format)
        raise
    return StepPlanTensors(host, device)


def paged_attention_planned(plan: StepPlanTensors, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            scale: float | None = None, *, window_left: int = -1, sink_tokens: int = 0,
                            softcap: float = 0.0, return_lse: bool = False, out: torch.Tensor | None = None,
                            lse: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, k_format: int = 0,
                            v_format: int = 0) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`paged_attention` of one layer on a step's :func:`plan_step` (its tables, lengths and task list)."""
    host, device = plan
    _name_bad_float(scale=scale, softcap=softcap)
    window_left, sink_tokens = _int_args(window_left, sink_tokens)
    if return_lse and lse is None:
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    try:
        if _direct(query, k_cache):  # (it fills the scale and out defaults itself: this runs once per layer and step)
            out = _native.paged_attention_planned(query, k_cache, v_cache, host, device, scale, window_left,
                                                  sink_tokens, softcap, out, lse, k_scale, v_scale, k_format, v_format)
            return (out, lse) if return_lse else out
        if scale is None:
            scale = query.shape[-1] ** -0.5
        if out is None:
            out = torch.empty_like(query, memory_format=torch.contiguous_format)
        _ops.paged_attention_planned.default(query, k_cache, v_cache, host, device, float(scale), int(window_left),
                                             int(sink_tokens), float(softcap), out, lse, k_scale, v_scale, k_format,
                                             v_format)
    except (TypeError, RuntimeError):
        _name_bad_int(window_left=window_left, sink_tokens=sink_tokens, k_format=k_format, v_format=v_format)
        raise
    return (out, lse) if return_lse else out


def append_planned(plan: StepPlanTensors, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, *, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                   k_format: int = 0, v_format: int = 0) -> None:
    """:func:`append` of one layer at the slot_mapping of a step's :func:`plan_step`."""
    host, device = plan
    op = _native.append_planned if _direct(key, k_cache) else _ops.append_planned.default
    try:
        op(key, value, k_cache, v_cache, host, device, k_scale, v_scale, k_format, v_format)
    except (TypeError, RuntimeError):
        _name_bad_int(k_format=k_format, v_format=v_format)
        raise


def host_index_reads() -> int:
    """How many times the ops have read index values (lengths, tables, slots) on the host since the library
    was loaded: on a GPU each such read is a device-to-host copy, i.e. a synchronization. A debugging aid:
    the per-layer calls of a planned step add none."""
    return int(_native.host_index_reads())


@torch.library.register_fake("kvcache::plan_step")
def _plan_step_fake(k_cache, v_cache, block_tables, seq_lens, cu_q_lens, slot_mapping, q_heads, k_scale=None,
                    v_scale=None, k_format=0, v_format=0):
    # the plan's sizes depend on the lengths (its task list): data-dependent
    ctx = torch.library.get_ctx()
    host = torch.empty(ctx.new_dynamic_size(), dtype=torch.uint8, device="cpu")
    device = torch.empty(ctx.new_dynamic_size(), dtype=torch.uint8, device=k_cache.device)
    return host, device


def merge_states(v_a: torch.Tensor, lse_a: torch.Tensor, v_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges two attention states over disjoint key sets (split-K, or a shared prefix + own suffix).

    ``v_*`` are normalized outputs ``[tokens, heads, head_dim]`` and ``lse_*`` their log-sum-exps
    ``[tokens, heads]`` (float32), as returned by ``paged_attention(..., return_lse=True)``.
    """
    v_out = torch.empty_like(v_a, memory_format=torch.contiguous_format)
    lse_out = torch.empty_like(lse_a, memory_format=torch.contiguous_format)
    _ops.merge_states.default(v_a, lse_a, v_b, lse_b, v_out, lse_out)
    return v_out, lse_out
