"""KV storage formats: small typed objects with a stable text form.

A format says how K (or V) is stored in the pages: full precision, or quantized with its scales and
zero points. It is part of a cache's identity (prefix-cache namespaces include ``str(fmt)``), so the
text form is canonical and round-trips through :func:`parse`.

>>> fmt = CacheFormat.parse("k=int8,v=int4")
>>> str(fmt), fmt.k.bits, fmt.v.bits
('k=int8,v=int4', 8, 4)
>>> fmt.bytes_per_token_head(head_dim=128, page_size=16)  # (128 + 4) for K, (64 + 4 x 4) for V
212.0
>>> str(KVFormat.parse("kivi2")), str(KVFormat.parse("fp8_e4m3(scale=0.05)")), str(KVFormat.parse("int8(hadamard)"))
('kivi2', 'fp8_e4m3(scale=0.05)', 'int8(hadamard)')
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

import torch

def _float32_text(x: float) -> str:
    """The shortest text that reads back as the float32 the pools store for ``x``: canonical (two scales the
    pools store alike print alike) and round-tripping (``:g``'s 6 digits merged different float32 scales)."""
    x32 = struct.unpack("<f", struct.pack("<f", x))[0]
    for digits in range(1, 10):  # (9 significant digits always read back as the same float32)
        text = f"{x32:.{digits}g}"
        if struct.unpack("<f", struct.pack("<f", float(text)))[0] == x32:
            return text
    return repr(x32)


# name -> (bits per element, granularity of its scales)
_KINDS = {
    "fp32": 32, "fp16": 16, "bf16": 16,
    "int8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8,
    "int4": 4, "kivi4": 4, "kivi2": 2,
}  # fmt: skip
_TORCH_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# torch's names of the float dtypes, as a user writes them after torch_dtype="bfloat16" (and "float8_e4m3fn"):
# the same formats as their torch dtypes
_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_FULL_DTYPES = {name: dtype for dtype, name in _TORCH_NAMES.items()}
# Storage kinds as the kernels number them (csrc/core/kv_format.h: KVKind); + ROTATED for ``hadamard``.
_KERNEL_IDS = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3, "int4": 4, "kivi4": 5, "kivi2": 6}
ROTATED = 16


@dataclass(frozen=True)
class KVFormat:
    """How one of K or V is stored.

    - ``fp32`` / ``fp16`` / ``bf16``: as is.
    - ``int8``: symmetric, one float32 scale per (token, kv head).
    - ``fp8_e4m3`` / ``fp8_e5m2``: one float32 scale per kv head; ``scale=None`` computes it from the
      first tokens written.
    - ``int4``: asymmetric groups of ``group`` (32) along head_dim, fp16 scale and zero point per group.
    - ``kivi2`` / ``kivi4`` (KIVI): keys per channel (statistics over the tokens of a page), values per
      token in groups of ``group``; the open page stays in full precision until it is sealed.

    ``hadamard`` (int8, fp8, int4; text ``int8(hadamard)``): each (token, kv head) row is rotated by a
    fixed orthogonal transform (signs, then a Walsh-Hadamard matrix; :func:`kvcache.quant.rotate`) before
    it is quantized. The transform spreads outlier channels over all dims, so a row's quantization step
    shrinks; attention is unchanged in exact arithmetic (queries are rotated alike, outputs unrotated,
    the log-sum-exp and soft-capping untouched). It needs a power-of-two head_dim and stores nothing.
    """

    kind: str
    group: int = 32
    scale: float | None = None
    hadamard: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown KV format {self.kind!r}; known: {', '.join(_KINDS)}")
        if self.group not in (16, 32, 64, 128):
            raise ValueError(f"group={self.group} must be 16, 32, 64 or 128")
        if self.scale is not None:
            if not self.kind.startswith("fp8"):
                raise ValueError(f"scale={self.scale!r} is only for fp8 formats, not {self.kind}")
            if isinstance(self.scale, (bool, str, bytes)) or not hasattr(type(self.scale), "__float__"):
                raise TypeError(f"scale must be a float, got {type(self.scale).__name__}")
            # The pools keep it in float32 and the kernels divide by it: a scale that is not a positive
            # normal float32 (inf, NaN, 1e-50 -> 0, 1e39 -> inf) would turn every stored value into NaN or inf.
            f32 = torch.finfo(torch.float32)
            try:
                s = float(self.scale)
            except OverflowError:  # (an int past a double)
                s = float("inf")
            if not f32.tiny <= s <= f32.max:
                raise ValueError(f"scale={self.scale!r} must be a positive float32 normal number "
                                 f"({f32.tiny:.3g} to {f32.max:.3g}), which the pools and kernels store it as")
        if self.group != 32 and not self.grouped:  # (int8 and fp8 scale whole rows / heads: a group was dropped
            # from the text, and the format then compared unequal to the one its text parses to)
            raise ValueError(f"group={self.group} is only for int4 and KIVI formats, not {self.kind}")
        if self.hadamard and self.kind not in ("int8", "fp8_e4m3", "fp8_e5m2", "int4"):
            why = ("KIVI keys are quantized per channel, which a rotation would mix" if self.kind.startswith("kivi")
                   else "it spreads outliers before quantization; full precision has none to spread")
            raise ValueError(f"hadamard is only for int8, fp8 and int4 formats, not {self.kind} ({why})")

    # ---- properties ---------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        return _KINDS[self.kind]

    @property
    def quantized(self) -> bool:
        return self.kind not in ("fp32", "fp16", "bf16")

    @property
    def grouped(self) -> bool:
        return self.kind in ("int4", "kivi2", "kivi4")

    def metadata_bytes_per_token_head(self, head_dim: int, page_size: int, role: str) -> float:
        """Scales and zero points stored per (token, kv head), averaged over a page (``role`` "k" or "v")."""
        if self.kind == "int8":
            return 4.0                                   # one float32 scale
        if self.kind == "int4" or (self.kind.startswith("kivi") and role == "v"):
            return head_dim // self.group * 4.0          # fp16 scale + fp16 zero per group
        if self.kind.startswith("kivi"):                 # keys: fp16 scale + zero per channel per page
            return head_dim * 4.0 / page_size
        return 0.0                                       # full precision; fp8's per-head scale is per layer

    def bytes_per_token_head(self, head_dim: int, page_size: int, role: str) -> float:
        return head_dim * self.bits / 8 + self.metadata_bytes_per_token_head(head_dim, page_size, role)

    # ---- text form ----------------------------------------------------------------------------
    # ---- how the pages store it: the one owner of kernel ids and tensor shapes ----------------------
    @property
    def kernel_id(self) -> int:
        """The kernels' number of this format (``k_format`` / ``v_format`` of the ops; 0 = full precision)."""
        if not self.quantized:
            return 0
        if self.kind not in _KERNEL_IDS or self.group != 32:
            raise NotImplementedError(f"KV format {self} is not implemented by the kernels yet "
                                      f"(int8, fp8_e4m3, fp8_e5m2, int4, kivi4 and kivi2 with groups of 32 are)")
        return _KERNEL_IDS[self.kind] + (ROTATED if self.hadamard else 0)

    @classmethod
    def from_kernel_id(cls, kernel_id: int, dtype: torch.dtype = torch.float32) -> "KVFormat":
        """The format the kernels number ``kernel_id`` (full precision: ``dtype``'s)."""
        if kernel_id == 0:
            return cls.parse(dtype)
        kind = next((k for k, i in _KERNEL_IDS.items() if i == kernel_id % ROTATED), None)
        if kind is None or kernel_id < 0 or kernel_id >= 2 * ROTATED:
            raise ValueError(f"{kernel_id} is not a kernel format id (0, {sorted(_KERNEL_IDS.values())}, + {ROTATED})")
        return cls(kind, hadamard=kernel_id >= ROTATED)

    @property
    def dims_per_code(self) -> int:
        """Dims per stored element: 2 for int4 and kivi4 (two per byte), 4 for kivi2, else 1."""
        return 8 // self.bits if self.kind in ("int4", "kivi4", "kivi2") else 1

    @property
    def code_dtype(self) -> torch.dtype:
        """The dtype of the pool's code tensor."""
        if not self.quantized:
            return _FULL_DTYPES[self.kind]
        return torch.int8 if self.kind == "int8" else torch.uint8

    def code_shape(self, num_blocks: int, num_kv_heads: int, page_size: int, head_dim: int) -> tuple[int, ...]:
        """The shape of the pool's code tensor."""
        return (num_blocks, num_kv_heads, page_size, head_dim // self.dims_per_code)

    @property
    def scale_dtype(self) -> torch.dtype | None:
        """The dtype of the pool's scale tensor (None: full precision stores none)."""
        if not self.quantized:
            return None
        return torch.float16 if self.grouped else torch.float32

    def scale_shape(self, num_blocks: int, num_kv_heads: int, page_size: int, head_dim: int,
                    role: str) -> tuple[int, ...] | None:
        """The shape of the pool's scale tensor for keys (``role="k"``) or values (``"v"``)."""
        if not self.quantized:
            return None
        if self.kind == "int8":
            return (num_blocks, num_kv_heads, page_size)
        if self.kind.startswith("fp8"):
            return (num_kv_heads,)
        if self.kind.startswith("kivi") and role == "k":  # per channel over a page: 32 scales, 32 zeros per chunk
            return (num_blocks, num_kv_heads, head_dim // 32, 2, 32)
        return (num_blocks, num_kv_heads, page_size, head_dim // self.group, 2)  # (scale, zero) per group

    def __str__(self) -> str:
        args = []
        if self.grouped and self.group != 32:
            args.append(f"group={self.group}")
        if self.scale is not None:
            args.append(f"scale={_float32_text(float(self.scale))}")
        if self.hadamard:
            args.append("hadamard")
        return self.kind + (f"({','.join(args)})" if args else "")

    @classmethod
    def parse(cls, text: "str | KVFormat | torch.dtype") -> "KVFormat":
        if isinstance(text, KVFormat):
            return text
        if isinstance(text, torch.dtype):
            if text not in _TORCH_NAMES:
                raise ValueError(f"dtype {text} is not a KV storage dtype")
            return cls(_TORCH_NAMES[text])
        if not isinstance(text, str):
            raise TypeError(f"a KV format is a str (e.g. 'int8'), a KVFormat, a CacheFormat or a torch dtype, got "
                            f"{text!r} ({type(text).__name__})")
        m = re.fullmatch(r"\s*([a-z0-9_]+)\s*(?:\((.*)\))?\s*", text)
        if not m:
            raise ValueError(f"cannot parse KV format {text!r}; e.g. 'int8', 'int4', 'int8(hadamard)', "
                             f"'fp8_e4m3(scale=0.1)'")
        kwargs: dict = {}
        for item in filter(None, (m.group(2) or "").split(",")):
            key, eq, value = item.partition("=")
            key = key.strip()
            if key == "hadamard" and not eq:
                kwargs["hadamard"] = True
            elif key == "group":
                kwargs["group"] = int(value)
            elif key == "scale":
                kwargs["scale"] = float(value)
            else:
                raise ValueError(f"unknown option {key!r} in KV format {text!r} (options: group, scale, hadamard)")
        return cls(_ALIASES.get(m.group(1), m.group(1)), **kwargs)


@dataclass(frozen=True)
class CacheFormat:
    """The formats of K and V (they may differ, e.g. ``k=int8,v=int4``)."""

    k: KVFormat
    v: KVFormat

    def __post_init__(self) -> None:
        if not self.k.quantized and not self.v.quantized and self.k.kind != self.v.kind:
            # (the storage ops take K and V pages of one dtype: KVPool made the pools, and the first append failed)
            raise ValueError(f"k={self.k},v={self.v}: K and V in full precision must share one dtype (a quantized "
                             f"side may be paired with any)")

    def __str__(self) -> str:
        return str(self.k) if self.k == self.v else f"k={self.k},v={self.v}"

    @classmethod
    def parse(cls, text: "str | CacheFormat | KVFormat | torch.dtype") -> "CacheFormat":
        """``"int8"`` (both), ``"k=int8,v=int4"``, a :class:`KVFormat` or a torch dtype."""
        if isinstance(text, CacheFormat):
            return text
        if not isinstance(text, str) or "=" not in text.split("(")[0]:
            fmt = KVFormat.parse(text)
            return cls(fmt, fmt)
        items = list(_split_kv(text))
        parts = dict(items)
        if sorted(key for key, _ in items) != ["k", "v"]:  # also refuses a key given twice
            raise ValueError(f"cannot parse cache format {text!r}; expected 'k=<format>,v=<format>', each once")
        return cls(KVFormat.parse(parts["k"]), KVFormat.parse(parts["v"]))

    @property
    def family(self) -> str | None:
        """"full", "quantized" (int8, fp8, int4) or "kivi" when K and V share one, else None. The attention step
        (PagedCache, Engine) reads only pools of one family; KVPool stores any mix."""
        families = {"kivi" if f.kind.startswith("kivi") else "quantized" if f.quantized else "full" for f in (self.k, self.v)}
        return families.pop() if len(families) == 1 else None

    def bytes_per_token_head(self, head_dim: int, page_size: int) -> float:
        """Bytes of K plus V (codes and metadata) per token and kv head, as a quantized page stores them. A
        cache with a full-precision window (``residual_length``, 128 tokens by default) holds its newest tokens'
        pages in the model's dtype besides: at 1,000 tokens of fp32 K/V, head_dim 128, int8 with the window
        averages ~414 bytes per token and head, not this 264; and right after a prompt, until the next forward
        seals its aged pages, the prompt is held both ways."""
        return self.k.bytes_per_token_head(head_dim, page_size, "k") + self.v.bytes_per_token_head(head_dim, page_size, "v")


def _split_kv(text: str):
    """'k=int4(group=64),v=int8' -> [('k', 'int4(group=64)'), ('v', 'int8')], commas inside () kept."""
    depth, start = 0, 0
    for i, ch in enumerate(text + ","):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            key, _, value = text[start:i].partition("=")
            yield key.strip(), value.strip()
            start = i + 1
