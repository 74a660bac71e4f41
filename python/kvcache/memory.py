"""KV-cache memory calculator.

The cache of a decoder holds, for every layer, a key and a value vector per KV head and token::

    M = L * h_kv * d * (s_K + s_V) * sum_i T_i   (+ metadata, e.g. quantization scales)

with ``L`` layers, ``h_kv`` KV heads, head dim ``d``, ``s_K``/``s_V`` bytes per element and ``T_i``
tokens of sequence ``i``. A layer with a sliding window ``W`` holds at most ``min(T_i, W)`` tokens.

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
    "contiguous_memory", "dtype_bits", "format_bytes",
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


@dataclass(frozen=True)
class KVShape:
    """Cache geometry of a model.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Positive sizes; ``num_kv_heads=1`` is multi-query attention.
    sliding_windows : int or sequence of (int or None), optional
        Per-layer sliding window (``None`` = full attention); a single int applies to every layer.
        Stored as a tuple of ``num_layers`` entries, or ``None`` when no layer has a window.

    Examples
    --------
    >>> KVShape(4, 8, 128, sliding_windows=[1024, None, 1024, None]).window_groups
    ((1024, 2), (None, 2))
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            object.__setattr__(self, name, _positive_int(getattr(self, name), name))
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

        Multimodal configs are read through ``text_config``. Layer windows come from
        ``layer_types`` when present, else from Qwen-style ``use_sliding_window``/
        ``max_window_layers``, Gemma-3-style ``sliding_window_pattern`` or Gemma-2 alternation,
        else ``sliding_window`` applies to every layer. MLA (DeepSeek) caches are not modelled.
        Raises ``ValueError`` naming the attribute that is missing.

        Examples
        --------
        >>> KVShape.from_config({"n_layer": 12, "n_head": 12, "n_embd": 768})
        KVShape(num_layers=12, num_kv_heads=12, head_dim=64, sliding_windows=None)
        """
        text = _get(config, "text_config")
        config = config if text is None else text
        num_layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
        if num_layers is None:
            raise _missing("num_hidden_layers", "n_layer", "num_layers")
        num_heads = _first(config, "num_attention_heads", "n_head")
        kv_names = ("num_key_value_heads", "num_kv_heads", "num_attention_heads", "n_head")
        if _get(config, "multi_query") and not _get(config, "new_decoder_architecture"):
            num_kv_heads = 1  # Falcon-7B / GPTBigCode: the flag wins over their kv-head counts
        elif (num_kv_heads := _first(config, *kv_names)) is None:
            raise _missing(*kv_names)
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
        return cls(num_layers, num_kv_heads, head_dim, _config_windows(config, num_layers))


def _config_windows(config: Any, num_layers: Any) -> list[int | None] | None:
    window = _get(config, "sliding_window")
    use = _get(config, "use_sliding_window")
    if use is not None and not use:
        window = None  # Qwen2 config.json files keep a window size while sliding is off
    layer_types = _get(config, "layer_types")
    if layer_types is not None:
        layer_types = list(layer_types)
        if len(layer_types) != num_layers:
            raise ValueError(
                f"layer_types has {len(layer_types)} entries, expected {num_layers} (num_layers)"
            )
        chunk = _get(config, "attention_chunk_size")
        windows: list[int | None] = []
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                windows.append(None)
            elif kind == "sliding_attention":
                windows.append(window)  # a None window means full attention, as in transformers
            elif kind == "chunked_attention" and chunk:
                windows.append(chunk)  # Llama-4: a chunk never holds more than chunk_size tokens
            else:
                raise ValueError(f"layer_types[{i}]={kind!r} is not a supported attention type")
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
    """Bits one token occupies in one layer: h_kv * (d * (b_K + b_V) + 8 * metadata bytes)."""
    default = 16 if dtype is None else dtype_bits(dtype, "dtype")
    kb = default if k_bits is None else dtype_bits(k_bits, "k_bits")
    vb = default if v_bits is None else dtype_bits(v_bits, "v_bits")
    meta = _meta_bytes(k_meta, "k_meta_bytes_per_token_head")
    meta += _meta_bytes(v_meta, "v_meta_bytes_per_token_head")
    return shape.num_kv_heads * (shape.head_dim * (kb + vb) + 8 * meta)


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

    Parameters
    ----------
    shape : KVShape
        Cache geometry.
    k_bits, v_bits : int, str or dtype, optional
        Bits per element of K and of V (or a dtype such as ``"bfloat16"``, ``torch.int8``).
        Each defaults to ``dtype``, which defaults to 16 bits.
    dtype : int, str or dtype, optional
        Shorthand setting both ``k_bits`` and ``v_bits``.
    k_meta_bytes_per_token_head, v_meta_bytes_per_token_head : int or Fraction
        Extra bytes stored per (token, KV head, layer) for K and V, e.g. 4 for one fp32 scale, or
        ``Fraction(2 * 128, 32)`` for an fp16 scale per group of 32 elements of a 128-dim head.

    Returns
    -------
    int or Fraction
        ``L * h_kv * (d * (bits_K + bits_V) / 8 + meta_K + meta_V)``; an int when whole.

    Examples
    --------
    >>> bytes_per_token(KVShape(32, 32, 128), dtype="float16")  # Llama-2-7B: 512 KiB
    524288
    """
    bits = _layer_bits(
        shape, k_bits, v_bits, dtype, k_meta_bytes_per_token_head, v_meta_bytes_per_token_head
    )
    return _whole(bits * shape.num_layers / 8)


def cache_bytes(
    shape: KVShape, lengths: int | Iterable[int], *, batch_size: int = 1, k_bits: Any = None,
    v_bits: Any = None, dtype: Any = None, k_meta_bytes_per_token_head: Real = 0,
    v_meta_bytes_per_token_head: Real = 0,
) -> Bytes:  # fmt: skip
    """Bytes held by a batch of sequences; sliding-window layers hold ``min(T_i, W)`` tokens.

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
    seqs = _lengths(lengths, batch_size)
    bits = _layer_bits(
        shape, k_bits, v_bits, dtype, k_meta_bytes_per_token_head, v_meta_bytes_per_token_head
    )
    return _whole(bits * _held_tokens(shape, seqs) / 8)


def _held_tokens(shape: KVShape, seqs: tuple[int, ...]) -> int:
    """Sum over layers and sequences of the tokens a layer holds, min(T_i, W) for windowed ones."""
    return sum(n * sum(t if w is None else min(t, w) for t in seqs) for w, n in shape.window_groups)


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
    if window is None or t <= window:
        return -(-t // page_size)
    # Blocks wholly before the window are freed; the live tokens [t - W, t) may straddle a boundary.
    return (t - 1) // page_size - (t - window) // page_size + 1


def paged_memory(
    shape: KVShape, lengths: int | Iterable[int], page_size: int, *, batch_size: int = 1,
    k_bits: Any = None, v_bits: Any = None, dtype: Any = None,
    k_meta_bytes_per_token_head: Real = 0, v_meta_bytes_per_token_head: Real = 0,
) -> MemoryReport:  # fmt: skip
    """Paged (vLLM-style) view: a block holds ``page_size`` tokens of every layer of a layer group.

    One block id covers all layers sharing a window, so a full-attention model needs
    ``ceil(T_i / page_size)`` blocks per sequence. A sliding-window group keeps only the blocks
    touched by its last ``W`` tokens; ``blocks_per_seq`` sums over groups.

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
            used += n_layers * (t if window is None else min(t, window))
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
        Tokens reserved per sequence; sliding-window layers reserve ``min(max_len, W)``.

    Returns
    -------
    MemoryReport

    Examples
    --------
    >>> r = contiguous_memory(KVShape(1, 1, 64), [5, 16], max_len=16)  # 256 B per token
    >>> r.reserved_bytes, r.waste_bytes, r.waste_fraction
    (8192, 2816, 0.34375)
    """
    seqs = _lengths(lengths, batch_size)
    max_len = max(seqs, default=0) if max_len is None else _non_negative_int(max_len, "max_len")
    if seqs and max(seqs) > max_len:
        raise ValueError(f"lengths must not exceed max_len={max_len}, got {max(seqs)}")
    per_seq = sum(n * (max_len if w is None else min(max_len, w)) for w, n in shape.window_groups)
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
