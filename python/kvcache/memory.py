"""KV-cache memory calculator.

The cache of a decoder holds, for every attention layer, a key and a value vector per KV head and
token::

    M = L * h_kv * (d_K * s_K + d_V * s_V) * sum_i T_i   (+ metadata, e.g. quantization scales)

with ``L`` attention layers, ``h_kv`` KV heads, key and value widths ``d_K`` and ``d_V`` (both the
head dim ``d`` in ordinary attention), ``s_K``/``s_V`` bytes per element and ``T_i`` tokens of
sequence ``i``. A layer with a sliding window ``W`` holds at most ``min(T_i, W - 1)`` tokens: the
ones the next token attends to besides itself, which is what transformers' ``DynamicCache`` keeps
(its ``DynamicSlidingWindowLayer``; a chunked-attention layer of chunk ``C`` likewise ``C - 1``).
kvcache's own :class:`kvcache.PagedCache` keeps every token of a sliding layer in its pages.

Two families fit the same formula:

- **Multi-head latent attention** (MLA: DeepSeek-V2/V3 and their descendants) caches, per token
  and layer, one latent of ``kv_lora_rank`` values and one rotary key of ``qk_rope_head_dim``
  values shared by every head: ``h_kv = 1``, ``d_K = kv_lora_rank``, ``d_V = qk_rope_head_dim``.
  The sides are the ones transformers 5.x hands the cache: the latent as the key, the rotary part
  as the value (so ``k_bits`` is the latent's format and ``v_bits`` the rotary part's).
- **Hybrid models** (Qwen3-Next, Jamba, ...) where only some layers attend: ``L`` counts the
  attention layers only. The linear-attention / Mamba / conv layers keep a state per sequence
  that does not grow with tokens; :class:`KVShape` counts its elements apart from the per-token
  cache and :func:`state_bytes` sizes it.

Sizes are computed exactly: element sizes are kept in bits and sums in :class:`fractions.Fraction`,
so sub-byte formats (e.g. 3- or 4-bit) never round. Every byte count returned is an ``int`` when it
is whole (always the case for byte-aligned formats) and a ``Fraction`` otherwise. All validation
errors raise ``ValueError`` naming the offending argument and value. This module imports nothing
from the rest of ``kvcache`` and never imports torch: dtypes are recognised by their name.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from numbers import Integral, Real
from typing import Any

__all__ = [
    "KVShape", "MemoryReport", "bytes_per_token", "cache_bytes", "paged_memory",
    "contiguous_memory", "state_bytes", "dtype_bits", "format_bytes",
]  # fmt: skip

Bytes = int | Fraction

# Bits per element, by dtype name. torch and numpy dtypes print as these names ("torch.bfloat16").
_DTYPE_BITS = {
    "float64": 64, "double": 64, "fp64": 64, "float32": 32, "float": 32, "fp32": 32,
    "float16": 16, "half": 16, "fp16": 16, "bfloat16": 16, "bf16": 16,
    "float8_e4m3fn": 8, "float8_e4m3fnuz": 8, "float8_e5m2": 8, "float8_e5m2fnuz": 8, "fp8": 8,
    "int64": 64, "int32": 32, "int16": 16, "int8": 8, "uint8": 8,
    "int4": 4, "uint4": 4, "fp4": 4, "nf4": 4, "int2": 2, "uint2": 2,
}  # fmt: skip
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _is_int(value: Any) -> bool:
    # bool is an Integral, but True as a layer count is always a mistake
    return isinstance(value, Integral) and not isinstance(value, bool)


def _positive_int(value: Any, name: str) -> int:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _non_negative_int(value: Any, name: str) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _is_finite_real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _whole(value: Fraction) -> Bytes:
    return int(value) if value.denominator == 1 else value


def dtype_bits(dtype: Any, name: str = "dtype") -> int:
    """Bits per element of ``dtype``: an int number of bits, a name, or a torch/numpy dtype.

    Names are matched case-insensitively, with or without a ``torch.`` prefix; ``name`` is the
    argument named in the ``ValueError`` raised for anything else.

    Examples
    --------
    >>> dtype_bits("bfloat16"), dtype_bits("torch.float32"), dtype_bits(4)
    (16, 32, 4)
    """
    if _is_int(dtype):
        return _positive_int(dtype, name)
    key = str(dtype).lower().removeprefix("torch.")
    if key in _DTYPE_BITS:
        return _DTYPE_BITS[key]
    itemsize = getattr(dtype, "itemsize", None)  # unnamed dtype objects (numpy, torch >= 2.1)
    if isinstance(dtype, type) and dtype.__module__ == "numpy":  # a numpy scalar type (np.float16): its dtype's
        import numpy
        itemsize = numpy.dtype(dtype).itemsize
    if not isinstance(dtype, str) and _is_int(itemsize) and itemsize > 0:
        return 8 * int(itemsize)
    raise ValueError(f"{name} must be a positive number of bits or a known dtype, got {dtype!r}")


def _meta_bytes(value: Any, name: str) -> Fraction:
    if not _is_finite_real(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative number of bytes, got {value!r}")
    return Fraction(value)


def _get(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


def _first(config: Any, *names: str) -> Any:
    # configs may carry an attribute set to None (e.g. head_dim=None): treat it as missing
    return next((v for v in (_get(config, n) for n in names) if v is not None), None)


def _missing(*names: str) -> ValueError:
    alts = f" (also tried {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""
    return ValueError(f"config has no {names[0]!r}{alts}")


# Layer types (``config.layer_types`` and Jamba's ``layers_block_type``) whose layers cache every
# token, and those whose layers keep a fixed-size state per sequence instead.
_ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
_STATE_TYPES = ("linear_attention", "mamba", "conv")


def _optional_count(value: Any, name: str) -> int | None:
    return None if value is None else _non_negative_int(value, name)


@dataclass(frozen=True, repr=False)
class KVShape:
    """Cache geometry of a model.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Positive sizes; ``num_kv_heads=1`` is multi-query attention. ``num_layers`` counts the
        layers that cache every token (the attention layers of a hybrid model).
    sliding_windows : int or sequence of (int or None), optional
        Per-layer sliding window (``None`` = full attention); a single int applies to every layer.
        Stored as a tuple of ``num_layers`` entries, or ``None`` when no layer has a window.
    v_head_dim : int, optional
        Width of a cached value vector when it differs from the key's ``head_dim``; stored as
        ``head_dim`` when not given.
    mla : bool, default False
        Multi-head latent attention: one "head" (``num_kv_heads=1``) whose key side is the
        ``kv_lora_rank`` latent and whose value side the ``qk_rope_head_dim`` rotary key, as
        transformers 5.x hands them to the cache. Build it with :meth:`mla_shape`.
    state_layers : int, default 0
        Layers that keep a fixed-size state per sequence instead of a per-token cache
        (linear attention, Mamba, conv layers of hybrid models).
    conv_state_elements, recurrent_state_elements : int or None, default 0
        Elements of that state per sequence, summed over the state layers: the rolling
        convolution window and the recurrent (SSM / linear-attention) matrix. ``None`` when
        unknown (a hybrid family whose state :meth:`from_config` cannot size).

    Examples
    --------
    >>> KVShape(4, 8, 128, sliding_windows=[1024, None, 1024, None]).window_groups
    ((1024, 2), (None, 2))
    >>> KVShape.mla_shape(61, kv_lora_rank=512, qk_rope_head_dim=64)  # DeepSeek-V3
    KVShape(num_layers=61, num_kv_heads=1, head_dim=512, v_head_dim=64, mla=True)
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...] | None = None
    v_head_dim: int | None = None
    mla: bool = False
    state_layers: int = 0
    conv_state_elements: int | None = 0
    recurrent_state_elements: int | None = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, _positive_int(getattr(self, name), name))
        v_dim = self.head_dim if self.v_head_dim is None else self.v_head_dim
        object.__setattr__(self, "v_head_dim", _positive_int(v_dim, "v_head_dim"))
        if not isinstance(self.mla, bool):
            raise ValueError(f"mla must be a bool, got {self.mla!r}")
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(
                f"num_kv_heads must be 1 with mla=True (one latent shared by every head), "
                f"got {self.num_kv_heads!r}"
            )
        state_layers = _non_negative_int(self.state_layers, "state_layers")
        object.__setattr__(self, "state_layers", state_layers)
        for name in ("conv_state_elements", "recurrent_state_elements"):
            count = _optional_count(getattr(self, name), name)
            if state_layers == 0 and count != 0:
                raise ValueError(
                    f"{name} must be 0 without state layers (state_layers=0), got {count!r}"
                )
            object.__setattr__(self, name, count)
        windows = self.sliding_windows
        if windows is not None:
            if _is_int(windows):
                windows = (windows,) * self.num_layers
            elif not isinstance(windows, Iterable) or isinstance(windows, str):
                raise ValueError(f"sliding_windows must be an int or a sequence, got {windows!r}")
            windows = tuple(windows)
            if len(windows) != self.num_layers:
                raise ValueError(
                    f"sliding_windows must have num_layers={self.num_layers} entries, "
                    f"got {len(windows)}"
                )
            windows = tuple(
                None if w is None else _positive_int(w, f"sliding_windows[{i}]")
                for i, w in enumerate(windows)
            )
            windows = None if all(w is None for w in windows) else windows
        object.__setattr__(self, "sliding_windows", windows)

    def __repr__(self) -> str:
        # the three sizes always; the other fields only where they differ from their defaults
        shown = [f"num_layers={self.num_layers}", f"num_kv_heads={self.num_kv_heads}",
                 f"head_dim={self.head_dim}"]  # fmt: skip
        if self.sliding_windows is not None:
            shown.append(f"sliding_windows={self.sliding_windows!r}")
        if self.v_head_dim != self.head_dim:
            shown.append(f"v_head_dim={self.v_head_dim}")
        if self.mla:
            shown.append("mla=True")
        if self.state_layers:
            shown += [f"state_layers={self.state_layers}",
                      f"conv_state_elements={self.conv_state_elements!r}",
                      f"recurrent_state_elements={self.recurrent_state_elements!r}"]  # fmt: skip
        return f"KVShape({', '.join(shown)})"

    @classmethod
    def mla_shape(
        cls, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
        sliding_windows: Any = None,
    ) -> "KVShape":  # fmt: skip
        """The cache of multi-head latent attention: per token and layer, a ``kv_lora_rank``
        latent (the key side) and a ``qk_rope_head_dim`` rotary key (the value side).

        The number of query heads and their ``qk_nope_head_dim``/``v_head_dim`` do not enter: the
        heads are expanded from the latent by ``kv_b_proj``, never cached.

        Examples
        --------
        >>> bytes_per_token(KVShape.mla_shape(61, 512, 64), dtype="bfloat16")  # 61 * 576 * 2
        70272
        """
        rank = _positive_int(kv_lora_rank, "kv_lora_rank")
        rope = _positive_int(qk_rope_head_dim, "qk_rope_head_dim")
        return cls(num_layers, 1, rank, sliding_windows, v_head_dim=rope, mla=True)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """The window of every layer, ``None`` for full attention."""
        return self.sliding_windows or (None,) * self.num_layers

    @property
    def window_groups(self) -> tuple[tuple[int | None, int], ...]:
        """``(window, number of layers)`` for each distinct window, in order of first layer."""
        counts: dict[int | None, int] = {}
        for w in self.layer_windows:
            counts[w] = counts.get(w, 0) + 1
        return tuple(counts.items())

    @classmethod
    def from_config(cls, config: Any) -> "KVShape":
        """Read the geometry from a Hugging Face config object, a namespace or a dict.

        Multimodal configs are read through ``text_config``.

        - **Layers.** From ``layer_types`` when present (else Jamba's ``layers_block_type`` or
          ``attn_layer_period``/``attn_layer_offset``, or Qwen3-Next's ``full_attention_interval``):
          ``full_attention``, ``sliding_attention``,
          ``chunked_attention`` and ``attention`` layers cache every token; ``linear_attention``,
          ``mamba`` and ``conv`` layers are counted as ``state_layers``. Any other type raises. The
          last ``num_kv_shared_layers`` layers (Gemma 3n) reuse earlier layers' K/V and are not counted.
        - **Windows.** A sliding layer's window is ``sliding_window`` (a chunked layer's
          ``attention_chunk_size``); it holds ``window - 1`` tokens, as DynamicCache does. Without
          ``layer_types``, Qwen-style ``use_sliding_window``/``max_window_layers``, Gemma-3-style
          ``sliding_window_pattern`` or Gemma-2 alternation decide, else ``sliding_window``
          applies to every layer.
        - **MLA.** A config with ``kv_lora_rank`` and ``qk_rope_head_dim`` (DeepSeek-V2/V3 and
          their descendants) caches the latent and the rotary key: :meth:`mla_shape`. That is
          what DeepSeek's inference and transformers >= 5 hold; transformers 4.x expands the
          latent and caches ``num_key_value_heads`` full K and V heads instead. Multi-token
          prediction layers (``num_nextn_predict_layers``) are not counted.
        - **State of hybrid layers.** Sized for Qwen3-Next (``model_type="qwen3_next"``: a
          conv window of ``linear_conv_kernel_dim`` over the q, k and v channels, and a
          ``linear_key_head_dim x linear_value_head_dim`` matrix per value head) and Jamba
          (``"jamba"``: ``mamba_expand * hidden_size`` channels, a conv window of
          ``mamba_d_conv`` and ``mamba_d_state`` SSM values each). For other families the two
          state counts are ``None``.

        Raises ``ValueError`` naming the attribute that is missing or wrong.

        Examples
        --------
        >>> KVShape.from_config({"n_layer": 12, "n_head": 12, "n_embd": 768})
        KVShape(num_layers=12, num_kv_heads=12, head_dim=64)
        """
        text = _get(config, "text_config")
        config = config if text is None else text
        num_layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
        if num_layers is None:
            raise _missing("num_hidden_layers", "n_layer", "num_layers")
        kinds = _layer_kinds(config, num_layers)
        windows = _config_windows(config, num_layers, kinds)
        shared = _get(config, "num_kv_shared_layers")
        if shared:  # Gemma 3n: the last layers attend to earlier layers' K/V and cache none of their own
            shared = _non_negative_int(shared, "num_kv_shared_layers")
            if shared >= num_layers:
                raise ValueError(f"num_kv_shared_layers={shared} leaves no layer of num_layers={num_layers} "
                                 f"caching K/V")
            num_layers -= shared
            kinds = None if kinds is None else kinds[:num_layers]
            windows = None if windows is None else windows[:num_layers]
        state_layers, state = 0, (0, 0)
        if kinds is not None:
            attention = [i for i, kind in enumerate(kinds) if kind in _ATTENTION_TYPES]
            if not attention:
                raise ValueError(
                    f"layer_types has no attention layer (got {sorted(set(kinds))}): "
                    "nothing is cached per token"
                )
            state_layers = len(kinds) - len(attention)
            num_layers = len(attention)
            windows = None if windows is None else [windows[i] for i in attention]
            if state_layers:
                state = _state_elements(config, state_layers)
        extra = dict(state_layers=state_layers, conv_state_elements=state[0],
                     recurrent_state_elements=state[1])  # fmt: skip
        rank, rope = _get(config, "kv_lora_rank"), _get(config, "qk_rope_head_dim")
        if rank is not None and rope is not None:
            rank = _positive_int(rank, "kv_lora_rank")
            rope = _positive_int(rope, "qk_rope_head_dim")
            return cls(num_layers, 1, rank, windows, v_head_dim=rope, mla=True, **extra)
        num_heads = _first(config, "num_attention_heads", "n_head")
        kv_names = ("num_key_value_heads", "num_kv_heads", "num_attention_heads", "n_head")
        if _get(config, "new_decoder_architecture") and num_heads is not None:
            # Falcon-40B/180B: K and V are projected for num_kv_heads groups but broadcast to every query head
            # before the cache's update, so the cache holds num_attention_heads of each
            num_kv_heads = num_heads
        elif _get(config, "multi_query"):
            num_kv_heads = 1  # Falcon-7B / GPTBigCode: the flag wins over their kv-head counts
        elif (num_kv_heads := _first(config, *kv_names)) is None:
            raise _missing(*kv_names)
        elif _is_int(num_heads) and _is_int(num_kv_heads) and num_kv_heads > num_heads:
            raise ValueError(f"num_key_value_heads={num_kv_heads} exceeds num_attention_heads={num_heads}: every KV "
                             f"head serves a group of query heads, so there are at most as many")
        head_dim = _get(config, "head_dim")
        if head_dim is None:
            hidden = _first(config, "hidden_size", "n_embd")
            if hidden is None:
                raise _missing("head_dim", "hidden_size", "n_embd")
            if num_heads is None:
                raise _missing("num_attention_heads", "n_head")
            if not (_is_int(hidden) and _is_int(num_heads)) or num_heads <= 0 or hidden % num_heads:
                raise ValueError(
                    f"hidden_size={hidden!r} is not divisible by num_attention_heads={num_heads!r}"
                )
            head_dim = hidden // num_heads
        return cls(num_layers, num_kv_heads, head_dim, windows, **extra)


def _check_shape(shape: Any) -> None:
    if not isinstance(shape, KVShape):
        raise ValueError(f"shape must be a KVShape (e.g. KVShape.from_config(config)), got "
                         f"{type(shape).__name__} {shape!r}")


def _layer_kinds(config: Any, num_layers: Any) -> list[str] | None:
    """The type of every layer, or None when the config says every layer is alike."""
    kinds, name = _get(config, "layer_types"), "layer_types"
    if kinds is None:  # Jamba: a property in transformers 4.x, absent from its config.json
        kinds, name = _get(config, "layers_block_type"), "layers_block_type"
    interval = _get(config, "full_attention_interval")
    if kinds is None and interval is not None and _is_int(num_layers):
        # Qwen3-Next / Qwen3.5's config.json: no layer_types, every interval-th layer full attention (as
        # transformers derives them)
        interval = _positive_int(interval, "full_attention_interval")
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if kinds is None:
        period, offset = _get(config, "attn_layer_period"), _get(config, "attn_layer_offset")
        if period is None or offset is None or not _is_int(num_layers):
            return None
        period = _positive_int(period, "attn_layer_period")
        offset = _non_negative_int(offset, "attn_layer_offset")
        if offset >= period:
            raise ValueError(
                f"attn_layer_offset must be below attn_layer_period={period}, got {offset}"
            )
        return ["attention" if i % period == offset else "mamba" for i in range(num_layers)]
    kinds = list(kinds)
    if len(kinds) != num_layers:
        raise ValueError(f"{name} has {len(kinds)} entries, expected {num_layers} (num_layers)")
    for i, kind in enumerate(kinds):
        if kind not in _ATTENTION_TYPES + _STATE_TYPES:
            raise ValueError(
                f"{name}[{i}]={kind!r} is not a supported layer type (per-token cache: "
                f"{', '.join(_ATTENTION_TYPES)}; fixed state: {', '.join(_STATE_TYPES)})"
            )
    return kinds


def _config_ints(config: Any, *names: str) -> list[int] | None:
    values = [_get(config, n) for n in names]
    if any(v is None for v in values):
        return None
    return [_positive_int(v, n) for v, n in zip(values, names)]


def _state_elements(config: Any, state_layers: int) -> tuple[int | None, int | None]:
    """(conv, recurrent) state elements per sequence over all state layers, None if unknown."""
    model_type = _get(config, "model_type")
    if model_type == "qwen3_next":  # Gated DeltaNet: conv over [q, k, v] channels, S per v head
        sizes = _config_ints(config, "linear_num_key_heads", "linear_key_head_dim",
                             "linear_num_value_heads", "linear_value_head_dim",
                             "linear_conv_kernel_dim")  # fmt: skip
        if sizes is not None:
            k_heads, k_dim, v_heads, v_dim, kernel = sizes
            conv = (2 * k_heads * k_dim + v_heads * v_dim) * kernel
            return state_layers * conv, state_layers * v_heads * k_dim * v_dim
    elif model_type == "jamba":  # Mamba-1: expand * hidden channels, each a conv window and an SSM
        sizes = _config_ints(config, "mamba_expand", "hidden_size", "mamba_d_conv", "mamba_d_state")
        if sizes is not None:
            expand, hidden, d_conv, d_state = sizes
            return state_layers * expand * hidden * d_conv, state_layers * expand * hidden * d_state
    return None, None


def _config_windows(
    config: Any, num_layers: Any, kinds: list[str] | None
) -> list[int | None] | None:
    window = _get(config, "sliding_window")
    use = _get(config, "use_sliding_window")
    if use is not None and not use:
        window = None  # Qwen2 config.json files keep a window size while sliding is off
    if kinds is not None:
        chunk = _get(config, "attention_chunk_size")
        windows: list[int | None] = []
        for i, kind in enumerate(kinds):
            if kind == "sliding_attention":
                windows.append(window)  # a None window means full attention, as in transformers
            elif kind == "chunked_attention":
                if not chunk:
                    raise ValueError(
                        f"layer_types[{i}]='chunked_attention' needs attention_chunk_size, "
                        f"got {chunk!r}"
                    )
                windows.append(chunk)  # Llama-4: DynamicCache keeps chunk_size - 1 tokens
            else:
                windows.append(None)  # full attention, or a state layer (dropped by the caller)
        return windows
    if not window or not _is_int(num_layers):
        return None  # KVShape reports a bad num_layers by name
    max_window_layers = _get(config, "max_window_layers")
    pattern = _get(config, "sliding_window_pattern")
    if use and max_window_layers is not None:  # Qwen2/3: the first max_window_layers are full
        return [window if i >= max_window_layers else None for i in range(num_layers)]
    if _is_int(pattern) and pattern > 0:  # Gemma 3 before layer_types: every pattern-th is global
        return [window if (i + 1) % pattern else None for i in range(num_layers)]
    if _get(config, "model_type") == "gemma2":  # Gemma 2 before layer_types: even layers slide
        return [window if i % 2 == 0 else None for i in range(num_layers)]
    return [window] * num_layers


def _layer_bits(
    shape: KVShape, k_bits: Any, v_bits: Any, dtype: Any, k_meta: Any, v_meta: Any
) -> Fraction:
    """Bits one token occupies in one layer: h_kv * (d_K * b_K + d_V * b_V + 8 * metadata bytes)."""
    default = 16 if dtype is None else dtype_bits(dtype, "dtype")
    kb = default if k_bits is None else dtype_bits(k_bits, "k_bits")
    vb = default if v_bits is None else dtype_bits(v_bits, "v_bits")
    meta = _meta_bytes(k_meta, "k_meta_bytes_per_token_head")
    meta += _meta_bytes(v_meta, "v_meta_bytes_per_token_head")
    return shape.num_kv_heads * (shape.head_dim * kb + shape.v_head_dim * vb + 8 * meta)


def _lengths(lengths: int | Iterable[int], batch_size: int) -> tuple[int, ...]:
    batch_size = _positive_int(batch_size, "batch_size")
    if _is_int(lengths):
        return (_non_negative_int(lengths, "lengths"),) * batch_size
    if batch_size != 1:
        raise ValueError(f"batch_size={batch_size} can only be given with a single int length")
    if not isinstance(lengths, Iterable) or isinstance(lengths, str):
        raise ValueError(f"lengths must be an int or a sequence of ints, got {lengths!r}")
    return tuple(_non_negative_int(t, f"lengths[{i}]") for i, t in enumerate(lengths))


def bytes_per_token(
    shape: KVShape, *, k_bits: Any = None, v_bits: Any = None, dtype: Any = None,
    k_meta_bytes_per_token_head: Real = 0, v_meta_bytes_per_token_head: Real = 0,
) -> Bytes:  # fmt: skip
    """Bytes one cached token takes across all layers (a token shorter than every window).

    Only the layers that cache every token count: the fixed state of a hybrid model's other
    layers is :func:`state_bytes`.

    Parameters
    ----------
    shape : KVShape
        Cache geometry.
    k_bits, v_bits : int, str or dtype, optional
        Bits per element of K and of V (or a dtype such as ``"bfloat16"``, ``torch.int8``).
        Each defaults to ``dtype``, which defaults to 16 bits. For MLA, K is the latent and V the
        rotary key.
    dtype : int, str or dtype, optional
        Shorthand setting both ``k_bits`` and ``v_bits``.
    k_meta_bytes_per_token_head, v_meta_bytes_per_token_head : int or Fraction
        Extra bytes stored per (token, KV head, layer) for K and V, e.g. 4 for one fp32 scale, or
        ``Fraction(2 * 128, 32)`` for an fp16 scale per group of 32 elements of a 128-dim head.

    Returns
    -------
    int or Fraction
        ``L * h_kv * ((d_K * bits_K + d_V * bits_V) / 8 + meta_K + meta_V)``; an int when whole.

    Examples
    --------
    >>> bytes_per_token(KVShape(32, 32, 128), dtype="float16")  # Llama-2-7B: 512 KiB
    524288
    """
    _check_shape(shape)
    bits = _layer_bits(
        shape, k_bits, v_bits, dtype, k_meta_bytes_per_token_head, v_meta_bytes_per_token_head
    )
    return _whole(bits * shape.num_layers / 8)


def cache_bytes(
    shape: KVShape, lengths: int | Iterable[int], *, batch_size: int = 1, k_bits: Any = None,
    v_bits: Any = None, dtype: Any = None, k_meta_bytes_per_token_head: Real = 0,
    v_meta_bytes_per_token_head: Real = 0,
) -> Bytes:  # fmt: skip
    """Bytes held by a batch of sequences; sliding-window layers hold ``min(T_i, W - 1)`` tokens
    (what ``DynamicCache`` keeps between steps: the next token attends to them and to itself; at ``W = 1``
    its slice ``keys[:, :, -W + 1:]`` keeps every token, and so does this).

    Parameters
    ----------
    shape : KVShape
        Cache geometry.
    lengths : int or iterable of int
        Tokens of each sequence, or one length shared by ``batch_size`` sequences.
    batch_size : int, default 1
        Number of sequences of length ``lengths``; only with an int ``lengths``.
    k_bits, v_bits, dtype, k_meta_bytes_per_token_head, v_meta_bytes_per_token_head
        Element sizes and metadata, as in :func:`bytes_per_token`.

    Returns
    -------
    int or Fraction
        Total bytes, an int when whole.

    Examples
    --------
    >>> cache_bytes(KVShape(32, 8, 128), 8192, dtype="bfloat16") == 2**30
    True
    """
    _check_shape(shape)
    seqs = _lengths(lengths, batch_size)
    bits = _layer_bits(
        shape, k_bits, v_bits, dtype, k_meta_bytes_per_token_head, v_meta_bytes_per_token_head
    )
    return _whole(bits * _held_tokens(shape, seqs) / 8)


def state_bytes(
    shape: KVShape, *, batch_size: int = 1, dtype: Any = None, conv_bits: Any = None,
    recurrent_bits: Any = "float32",
) -> Bytes | None:  # fmt: skip
    """Bytes of the fixed state a hybrid model's non-attention layers keep for ``batch_size``
    sequences, however long they are; ``0`` without such layers, ``None`` when unknown.

    Parameters
    ----------
    shape : KVShape
        Cache geometry, with ``state_layers`` and the two state element counts.
    batch_size : int, default 1
        Number of sequences.
    dtype, conv_bits : int, str or dtype, optional
        Bits per conv-state element: ``conv_bits``, else ``dtype`` (the model's dtype, which
        transformers keeps that window in), else 16 bits.
    recurrent_bits : int, str or dtype, default "float32"
        Bits per element of the recurrent state: the Qwen3-Next (gated delta rule) and Jamba
        (selective scan) layers of transformers 5.x keep it in float32 whatever the model's dtype
        (their conv window is in the model's dtype).

    Returns
    -------
    int, Fraction or None
        ``batch_size * (conv_elements * bits_conv + recurrent_elements * bits_recurrent) / 8``;
        ``None`` when the shape leaves the state unknown (``conv_state_elements`` or
        ``recurrent_state_elements`` is ``None``).

    Examples
    --------
    >>> jamba_like = KVShape(1, 8, 128, state_layers=7, conv_state_elements=7 * 8192 * 4,
    ...                      recurrent_state_elements=7 * 8192 * 16)
    >>> state_bytes(jamba_like, dtype="bfloat16")  # 7 layers * 8192 * (4 * 2 + 16 * 4) bytes
    4128768
    """
    _check_shape(shape)
    batch_size = _positive_int(batch_size, "batch_size")
    default = 16 if dtype is None else dtype_bits(dtype, "dtype")
    cb = default if conv_bits is None else dtype_bits(conv_bits, "conv_bits")
    rb = dtype_bits(recurrent_bits, "recurrent_bits")
    conv, recurrent = shape.conv_state_elements, shape.recurrent_state_elements
    if conv is None or recurrent is None:
        return None
    return _whole(Fraction(batch_size * (conv * cb + recurrent * rb), 8))


def _held_tokens(shape: KVShape, seqs: tuple[int, ...]) -> int:
    """Sum over layers and sequences of the tokens a layer holds (min(T_i, W - 1) if windowed)."""
    return sum(n * sum(_window_tokens(t, w) for t in seqs) for w, n in shape.window_groups)


def _window_tokens(t: int, window: int | None) -> int:
    """Tokens a layer of this window holds after ``t`` tokens: all, or the newest ``window - 1`` (DynamicCache's
    ``keys[:, :, -window + 1:]``: at ``window=1`` that slice keeps every token, and so does this)."""
    return t if window is None else len(range(t)[1 - window:])


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one allocation layout: bytes holding tokens versus bytes allocated.

    Attributes
    ----------
    layout : str
        ``"paged"`` or ``"contiguous"``.
    used_bytes, reserved_bytes : int or Fraction
        Bytes of cached tokens, and bytes allocated for them.
    blocks_per_seq : tuple of int
        Paged layout only: blocks held by each sequence (summed over layer groups).
    page_size, max_len : int or None
        The page size of a paged layout, the reserved length of a contiguous one.
    """

    layout: str
    used_bytes: Bytes
    reserved_bytes: Bytes
    blocks_per_seq: tuple[int, ...] = ()
    page_size: int | None = None
    max_len: int | None = None

    @property
    def num_blocks(self) -> int:
        return sum(self.blocks_per_seq)

    @property
    def waste_bytes(self) -> Bytes:
        """Reserved but unused bytes (internal fragmentation)."""
        return _whole(Fraction(self.reserved_bytes - self.used_bytes))

    @property
    def waste_fraction(self) -> float:
        """``waste_bytes / reserved_bytes``, 0.0 when nothing is reserved."""
        if not self.reserved_bytes:
            return 0.0
        return float(Fraction(self.waste_bytes) / self.reserved_bytes)

    def __str__(self) -> str:
        if self.layout == "paged":
            head = f"paged (page_size={self.page_size}, {self.num_blocks} blocks)"
        else:
            head = f"{self.layout} (max_len={self.max_len})"
        return (
            f"{head}: used {format_bytes(self.used_bytes)}, "
            f"reserved {format_bytes(self.reserved_bytes)}, "
            f"waste {format_bytes(self.waste_bytes)} ({self.waste_fraction:.1%})"
        )


def _window_blocks(t: int, window: int | None, page_size: int) -> int:
    live = _window_tokens(t, window)
    if live == t:  # (a window of 1 too: DynamicCache keeps every token there)
        return -(-t // page_size)
    # Blocks wholly before the window are freed; the live tokens [t - W + 1, t) may straddle a page.
    return (t - 1) // page_size - (t - live) // page_size + 1


def paged_memory(
    shape: KVShape, lengths: int | Iterable[int], page_size: int, *, batch_size: int = 1,
    k_bits: Any = None, v_bits: Any = None, dtype: Any = None,
    k_meta_bytes_per_token_head: Real = 0, v_meta_bytes_per_token_head: Real = 0,
) -> MemoryReport:  # fmt: skip
    """Paged (vLLM-style) view: a block holds ``page_size`` tokens of every layer of a layer group.

    One block id covers all layers sharing a window, so a full-attention model needs
    ``ceil(T_i / page_size)`` blocks per sequence. A sliding-window group keeps only the blocks
    touched by its last ``W - 1`` tokens; ``blocks_per_seq`` sums over groups.

    Parameters
    ----------
    shape, lengths, batch_size, k_bits, v_bits, dtype, k_meta_bytes_per_token_head, \
v_meta_bytes_per_token_head
        As in :func:`cache_bytes`.
    page_size : int
        Tokens per block, a positive power of two.

    Returns
    -------
    MemoryReport
        With ``blocks_per_seq``; ``waste_bytes`` is the unfilled part of the last blocks.

    Examples
    --------
    >>> r = paged_memory(KVShape(1, 1, 64), [5, 16], page_size=8)  # 256 B per token
    >>> r.blocks_per_seq, r.used_bytes, r.reserved_bytes, r.waste_bytes
    ((1, 2), 5376, 6144, 768)
    """
    _check_shape(shape)
    if not _is_int(page_size) or page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a positive power of two, got {page_size!r}")
    seqs = _lengths(lengths, batch_size)
    bits = _layer_bits(
        shape, k_bits, v_bits, dtype, k_meta_bytes_per_token_head, v_meta_bytes_per_token_head
    )
    blocks = [0] * len(seqs)
    used = reserved = 0
    for window, n_layers in shape.window_groups:
        for i, t in enumerate(seqs):
            b = _window_blocks(t, window, page_size)
            blocks[i] += b
            used += n_layers * _window_tokens(t, window)
            reserved += n_layers * b * page_size
    used_bytes, reserved_bytes = _whole(bits * used / 8), _whole(bits * reserved / 8)
    return MemoryReport("paged", used_bytes, reserved_bytes, tuple(blocks), page_size=page_size)


def contiguous_memory(
    shape: KVShape, lengths: int | Iterable[int], max_len: int | None = None, *,
    batch_size: int = 1, k_bits: Any = None, v_bits: Any = None, dtype: Any = None,
    k_meta_bytes_per_token_head: Real = 0, v_meta_bytes_per_token_head: Real = 0,
) -> MemoryReport:  # fmt: skip
    """Contiguous view: every sequence reserves ``max_len`` tokens (default: the longest length).

    Parameters
    ----------
    shape, lengths, batch_size, k_bits, v_bits, dtype, k_meta_bytes_per_token_head, \
v_meta_bytes_per_token_head
        As in :func:`cache_bytes`.
    max_len : int, optional
        Tokens reserved per sequence; sliding-window layers reserve ``min(max_len, W - 1)``.

    Returns
    -------
    MemoryReport

    Examples
    --------
    >>> r = contiguous_memory(KVShape(1, 1, 64), [5, 16], max_len=16)  # 256 B per token
    >>> r.reserved_bytes, r.waste_bytes, r.waste_fraction
    (8192, 2816, 0.34375)
    """
    _check_shape(shape)
    seqs = _lengths(lengths, batch_size)
    max_len = max(seqs, default=0) if max_len is None else _non_negative_int(max_len, "max_len")
    if seqs and max(seqs) > max_len:
        raise ValueError(f"lengths must not exceed max_len={max_len}, got {max(seqs)}")
    per_seq = sum(n * _window_tokens(max_len, w) for w, n in shape.window_groups)
    bits = _layer_bits(
        shape, k_bits, v_bits, dtype, k_meta_bytes_per_token_head, v_meta_bytes_per_token_head
    )
    used, reserved = bits * _held_tokens(shape, seqs), bits * per_seq * len(seqs)
    return MemoryReport("contiguous", _whole(used / 8), _whole(reserved / 8), max_len=max_len)


def format_bytes(num_bytes: Real, precision: int = 2) -> str:
    """Format a byte count with binary units (KiB = 1024 B).

    Parameters
    ----------
    num_bytes : int, Fraction or float
        The count; whole counts under 1 KiB print without decimals.
    precision : int, default 2
        Decimals for every other count.

    Examples
    --------
    >>> format_bytes(2**30), format_bytes(524288), format_bytes(512), format_bytes(1536)
    ('1.00 GiB', '512.00 KiB', '512 B', '1.50 KiB')
    """
    if not _is_finite_real(num_bytes):
        raise ValueError(f"num_bytes must be a finite number, got {num_bytes!r}")
    precision = _non_negative_int(precision, "precision")
    sign, value, unit = "-" if num_bytes < 0 else "", Fraction(abs(num_bytes)), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0 and value.denominator == 1:
        return f"{sign}{value} B"
    text = f"{float(value):.{precision}f}"
    if float(text) >= 1024 and unit < len(_UNITS) - 1:  # 1023.999 KiB rounds up to 1.00 MiB
        value, unit = value / 1024, unit + 1
        text = f"{float(value):.{precision}f}"
    return f"{sign}{text} {_UNITS[unit]}"
