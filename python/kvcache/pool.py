"""KVPool: the K/V pages of one layer in a storage format, with the tensors every op needs.

>>> import torch, kvcache
>>> pool = kvcache.KVPool.allocate(num_blocks=8, page_size=16, num_kv_heads=2, head_dim=64, format="int8")
>>> pool.k.dtype, tuple(pool.k_scale.shape), str(pool.format)
(torch.int8, (8, 2, 16), 'int8')
>>> key = value = torch.randn(1, 2, 5, 64)
>>> pool.append(key, value, torch.arange(5).view(1, 5))
>>> k, v = pool.gather(torch.tensor([[0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32))
>>> bool((k - key).abs().max() < 0.05)
True

K and V rows may differ in width (MLA latents: ``v_head_dim``), each side in its own format:

>>> mla = kvcache.KVPool.allocate(8, 16, 1, 64, "int8", v_head_dim=32)
>>> tuple(mla.k.shape), tuple(mla.v.shape), mla.layout.equal_widths
((8, 1, 16, 64), (8, 1, 16, 32), False)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import _html, ops
from .formats import CacheFormat, KVFormat
from .layout import PageLayout, pool_tensor
from .quant import fp8_scale_for, rot_scales, rotate

ROTATED = 16  # added to a kernel format id for the hadamard option (kvcache.formats.ROTATED)


def format_id(fmt: KVFormat) -> int:
    """The kernels' number of a format (0 = full precision): ``fmt.kernel_id``."""
    return fmt.kernel_id


def check_format_widths(fmt: CacheFormat, head_dim: int, v_head_dim: int) -> None:
    """A ValueError naming the side, the width and the format when ``fmt`` cannot store rows of these widths
    (int4 and KIVI: multiples of 32; ``hadamard``: a power of two), or a NotImplementedError for a format the
    kernels do not implement."""
    for role, f, dim in (("k", fmt.k, head_dim), ("v", fmt.v, v_head_dim)):
        f.kernel_id  # rejects formats the kernels do not implement yet
        name = "head_dim" if role == "k" else "v_head_dim"
        if f.hadamard:
            try:
                rot_scales(dim)
            except ValueError as err:
                raise ValueError(f"{role.upper()} rows: {name}={dim} cannot take {role}_format={f}: {err}") from None
        if f.grouped and dim % 32:
            raise ValueError(f"{role.upper()} rows: {name}={dim} must be a multiple of 32 for {f.kind} "
                             f"({role}_format={f} keeps its scales per 32 dims)")


@dataclass
class KVPool:
    """One layer's pools: codes ``k``/``v`` ``[num_blocks, num_kv_heads, page_size, head_dim]`` and, for
    quantized formats, ``k_scale``/``v_scale`` (int8: per row ``[num_blocks, num_kv_heads, page_size]``;
    fp8: per kv head ``[num_kv_heads]``; int4: codes ``[..., head_dim / 2]`` two per byte and fp16
    (scale, zero) pairs ``[num_blocks, num_kv_heads, page_size, head_dim / 32, 2]``).

    Formats with the ``hadamard`` option (e.g. ``"int8(hadamard)"``) store rotated rows
    (:func:`kvcache.quant.rotate`) in the same tensors; every method hands back unrotated values and
    exact attention, so callers see no difference but the smaller error.

    ``v_head_dim`` (default ``head_dim``): the width of the V rows, which may differ from the K rows' (MLA
    latents); ``v`` and ``v_scale`` then have V's shapes. Storage ops (append, gather, :meth:`copy_blocks`)
    honour it; :meth:`attention` needs equal widths."""

    num_blocks: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    format: CacheFormat
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    _scales_set: dict = field(default_factory=dict, repr=False)
    _kwargs: tuple = field(default=(), repr=False)  # (k_scale, v_scale, op_kwargs, plan_key, fp8 roles): once
    v_head_dim: int | None = None  # width of the V rows; None: head_dim

    def __post_init__(self) -> None:
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim

    @classmethod
    def allocate(cls, num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                 format: "str | CacheFormat | torch.dtype" = torch.bfloat16,
                 device: torch.device | str = "cpu", *, v_head_dim: int | None = None) -> "KVPool":
        """Pools for ``num_blocks`` pages; ``v_head_dim`` (default ``head_dim``) is the width of the V rows.
        A width a format cannot take (int4 and KIVI: multiples of 32; ``hadamard``: a power of two) is
        refused with a ValueError naming the side, the width and the format, before anything is allocated."""
        fmt = CacheFormat.parse(format)
        layout = PageLayout(num_blocks, page_size, num_kv_heads, head_dim, v_head_dim=v_head_dim)  # validates the geometry
        check_format_widths(fmt, layout.dim("k"), layout.dim("v"))
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():  # (not a lack of memory)
            raise RuntimeError(f"KVPool.allocate: device={str(device)!r}, but this torch sees no CUDA device "
                               f"(torch.cuda.is_available() is False; torch {torch.__version__})")
        tensors = {}
        try:
            for role, f in (("k", fmt.k), ("v", fmt.v)):
                dim = layout.dim(role)
                shape = f.code_shape(num_blocks, num_kv_heads, page_size, dim)
                # full precision starts uninitialized (every slot is written before it is read); codes at zero.
                # (pool_tensor: large CPU pools on huge pages, as PageLayout.allocate's)
                codes = pool_tensor(shape, f.code_dtype, device, fill=0 if f.quantized else None)
                scale = None
                if f.quantized:
                    scale_shape = f.scale_shape(num_blocks, num_kv_heads, page_size, dim, role)
                    # fp8: one scale per kv head, given or computed from the first tokens
                    fill = (f.scale or 1.0) if f.kind.startswith("fp8") else 0.0
                    scale = pool_tensor(scale_shape, f.scale_dtype, device, fill=fill)
                tensors[role], tensors[f"{role}_scale"] = codes, scale
        except (RuntimeError, MemoryError) as err:  # torch's words name neither the argument nor the size
            need = (fmt.k.bytes_per_token_head(layout.head_dim, page_size, "k")
                    + fmt.v.bytes_per_token_head(layout.v_head_dim, page_size, "v")) * num_blocks * page_size * num_kv_heads
            raise MemoryError(f"KVPool.allocate: num_blocks={num_blocks} pages of {page_size} tokens x {num_kv_heads} "
                              f"kv heads in {fmt} need {need / 2**30:.4g} GiB, which {device} could not allocate: "
                              f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from None
        pool = cls(num_blocks, page_size, num_kv_heads, head_dim, fmt, **tensors, v_head_dim=layout.v_head_dim)
        pool._scales_set = {"k": fmt.k.scale is not None, "v": fmt.v.scale is not None}
        return pool

    @property
    def layout(self) -> PageLayout:
        return PageLayout(self.num_blocks, self.page_size, self.num_kv_heads, self.head_dim, v_head_dim=self.v_head_dim)

    def op_kwargs(self) -> dict:
        """The format arguments of append / paged_gather / paged_attention for this pool."""
        return dict(self._cached()[2])

    @property
    def plan_key(self) -> tuple:
        """What a step's kernel plan depends on (:meth:`kvcache.StepPlan.kernel_plan`): device, page and head
        shapes, formats. Pools that share it (a model's layers) share one plan per step."""
        return self._cached()[3]

    def _cached(self) -> tuple:
        # made once per pool (a per-layer cost otherwise); remade if the scale tensors are replaced
        c = self._kwargs
        if not c or c[0] is not self.k_scale or c[1] is not self.v_scale:
            kwargs = {"k_scale": self.k_scale, "v_scale": self.v_scale,
                      "k_format": self.format.k.kernel_id, "v_format": self.format.v.kernel_id}
            key = (self.k.device, self.page_size, self.num_kv_heads, self.head_dim, self.v_head_dim,
                   kwargs["k_format"], kwargs["v_format"])
            fp8 = tuple(role for role, f in (("k", self.format.k), ("v", self.format.v)) if f.kind.startswith("fp8"))
            c = self._kwargs = (self.k_scale, self.v_scale, kwargs, key, fp8)
        return c

    # ---- ops -----------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: "torch.Tensor | ops.StepPlanTensors") -> None:
        """Writes (quantizing) K/V ``[batch, kv_heads, q_len, head_dim]`` at ``slot_mapping``, or at the
        slot_mapping of a step's :func:`kvcache.plan_step` (no index reads on the host).

        fp8 formats without a fixed scale take theirs from the first tokens stored: per kv head, the
        absolute maximum of the finite values (of the rotated rows, for ``hadamard``) mapped onto the format's
        largest value. Tokens at slot -1 do not count (with a step's plan, every token given counts), and a
        call that raises leaves the scale as it was.

        Bad values (NaN, +-Inf) never enter a scale or zero point shared with other tokens: every other
        token of the page, head or channel is stored as if the bad value were absent (as with any finite value
        inside the others' range in its place: 0 where that range holds both signs). NaN stays NaN where the
        format can say so (fp8; an int8 row, int4 or KIVI-value group of its token reads back NaN), else it
        is stored as 0 (KIVI keys: the code nearest 0); +-Inf saturates to the largest code of its sign.
        Huge finite values enter the scales, which never overflow (int4 and KIVI keep fp16 metadata and
        saturate values at +-65504). Full-precision pools store what they are given. See the README.
        """
        cached = self._cached()
        planned = isinstance(slot_mapping, ops.StepPlanTensors)
        taken = []  # fp8 scales set by this call: put back if the op refuses it, so a refused call changes nothing
        for role in cached[4]:  # fp8 sides
            x, f = (key, self.format.k) if role == "k" else (value, self.format.v)
            if self._scales_set[role] or not x.numel():
                continue
            x = x.detach()
            if not planned and slot_mapping.shape == x.shape[:1] + x.shape[2:3]:  # only the tokens stored
                x = x.transpose(1, 2)[slot_mapping.to(x.device) >= 0].unsqueeze(0).transpose(1, 2)
                if not x.numel():
                    continue
            x = rotate(x) if f.hadamard else x
            scale = fp8_scale_for(x, f.kind.removeprefix("fp8_"), dim=(0, 2, 3))
            target = getattr(self, f"{role}_scale")
            taken.append((role, target.clone()))
            target.copy_(scale)
            self._scales_set[role] = True
        try:
            if planned:
                ops.append_planned(slot_mapping, key, value, self.k, self.v, **cached[2])
            else:
                ops.append(key, value, self.k, self.v, slot_mapping, **cached[2])
        except BaseException:
            for role, old in taken:
                getattr(self, f"{role}_scale").copy_(old)
                self._scales_set[role] = False
            raise

    def gather(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int | None = None,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized padded K/V ``[batch, kv_heads, max_len, head_dim]`` (V: ``v_head_dim``) in ``dtype``:
        by default the dtype of the pool's full-precision side (a full-precision pool's own dtype, or V's in
        ``k=int8,v=bf16``), float32 when both sides are quantized. Any other float ``dtype`` is converted to
        from that one (the op writes a full-precision side in its own dtype)."""
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"gather: dtype must be a floating-point torch.dtype, got {dtype!r}")
        full = [t.dtype for t, f in ((self.k, self.format.k), (self.v, self.format.v)) if not f.quantized]
        # (the op dequantizes to float32, bf16 or fp16 only; other dtypes are converted to from float32)
        native = full[0] if full else dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32
        if max_len is None:
            max_len = int(seq_lens.max()) if seq_lens.numel() else 0
            if torch.compiler.is_compiling():  # (a data-dependent length: `if` on it would end a fullgraph trace)
                torch._check(max_len >= 0)
            elif max_len < 0:
                raise ValueError(f"gather: seq_lens holds a negative length ({max_len}); lengths are >= 0")
        elif not torch.compiler.is_compiling() and (isinstance(max_len, bool) or not hasattr(max_len, "__index__")
                                                     or max_len < 0):
            # (eager only: traced, these checks on the layer's symbolic length break the graph, and torch 2.13's
            # inductor then loses the symbol, a NameError in its generated code; the op checks the length anyway)
            raise ValueError(f"gather: max_len must be a non-negative int, got {max_len!r}")
        shape = (seq_lens.shape[0], self.num_kv_heads, max_len)
        out = (torch.empty(shape + (self.head_dim,), dtype=native, device=self.k.device),
               torch.empty(shape + (self.v_head_dim,), dtype=native, device=self.k.device))
        k, v = ops.paged_gather(self.k, self.v, block_tables, seq_lens, out=out, **self.op_kwargs())
        if dtype is not None and dtype != native:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def copy_blocks(self, block_mapping: torch.Tensor) -> None:
        """Copies whole blocks within this pool (copy-on-write), codes and the per-row / per-group scales that
        travel with them: ``block_mapping`` ``[n, 2]`` of (src, dst) pairs, destinations distinct and never also
        sources. Full-precision pools go through :func:`kvcache.copy_blocks`; quantized ones (whose codes that
        op does not take) are checked the same way before anything is written. int32 or int64 ids, for every
        format."""
        mapping = torch.as_tensor(block_mapping)
        if not (self.format.k.quantized or self.format.v.quantized):
            ops.copy_blocks(self.k, self.v, mapping.long() if mapping.dtype == torch.int32 else mapping)
            return
        if mapping.dim() != 2 or mapping.shape[1] != 2 or mapping.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block_mapping must be an [n, 2] integer tensor of (src, dst) pairs, got "
                             f"{mapping.dtype} of shape {tuple(mapping.shape)}")
        pairs = mapping.cpu().tolist()
        written: dict[int, int] = {}
        for i, (src, dst) in enumerate(pairs):  # (the op's checks and words: core/index_checks.h)
            for col, b, what in ((0, src, "source"), (1, dst, "destination")):
                if not 0 <= b < self.num_blocks:
                    raise IndexError(f"block_mapping[{i}, {col}] = {b} is not a {what} block id in "
                                     f"[0, {self.num_blocks})")
            if dst in written:
                raise IndexError(f"block_mapping writes destination block {dst} twice (rows {written[dst]} and {i})")
            written[dst] = i
        for i, (src, _) in enumerate(pairs):
            if src in written:
                raise IndexError(f"block_mapping reads block {src} (row {i}) that it also writes (row "
                                 f"{written[src]}); the result would depend on the copy order")
        if not pairs:
            return
        src = mapping[:, 0].to(device=self.k.device, dtype=torch.int64)
        dst = mapping[:, 1].to(device=self.k.device, dtype=torch.int64)
        for t in (self.k, self.v, self.k_scale, self.v_scale):
            if t is not None and t.dim() >= 3:  # (fp8's per-head scale is the whole pool's)
                t.index_copy_(0, dst, t.index_select(0, src))

    def attention(self, query: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  cu_q_lens: torch.Tensor, scale: float | None = None, **kwargs):
        """:func:`kvcache.paged_attention` over this pool (K/V dequantized in registers). Pools that mix a
        full-precision side with a quantized one (``k=int8,v=bf16``) store and gather, but attention reads K and V
        both full precision or both quantized, and refuses them. No backward (inference only)."""
        return ops.paged_attention(query, self.k, self.v, block_tables, seq_lens, cu_q_lens, scale,
                                   **kwargs, **self._cached()[2])

    def attention_planned(self, query: torch.Tensor, plan: "ops.StepPlanTensors", scale: float | None = None, *,
                          window_left: int = -1, sink_tokens: int = 0, softcap: float = 0.0, return_lse: bool = False,
                          out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
        """:func:`kvcache.paged_attention_planned` over this pool, on a step's :func:`kvcache.plan_step`."""
        k_scale, v_scale, fmt = self._cached()[:3]
        return ops.paged_attention_planned(plan, query, self.k, self.v, scale, window_left=window_left,
                                           sink_tokens=sink_tokens, softcap=softcap, return_lse=return_lse, out=out,
                                           lse=lse, k_scale=k_scale, v_scale=v_scale, k_format=fmt["k_format"],
                                           v_format=fmt["v_format"])

    def mla_attention(self, q_latent: torch.Tensor, q_rope: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, cu_q_lens: torch.Tensor, scale: float, **kwargs):
        """:func:`kvcache.mla_attention` over this pool of MLA latents (K rows) and rotary keys (V rows)."""
        return ops.mla_attention(q_latent, q_rope, self.k, self.v, block_tables, seq_lens, cu_q_lens, scale,
                                 **kwargs, **self.op_kwargs())

    def plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_q_lens: torch.Tensor,
             slot_mapping: torch.Tensor | None = None, *, q_heads: int) -> "ops.StepPlanTensors":
        """:func:`kvcache.plan_step` for this pool (and every pool of its shape and format)."""
        return ops.plan_step(self.k, self.v, block_tables, seq_lens, cu_q_lens, slot_mapping, q_heads=q_heads,
                             **self.op_kwargs())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None)

    def __repr__(self) -> str:  # (the dataclass's would print every page)
        widths = f"head_dim={self.head_dim}" + ("" if self.v_head_dim == self.head_dim else
                                               f", v_head_dim={self.v_head_dim}")
        return (f"KVPool(format={self.format}, num_blocks={self.num_blocks}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, {widths}, device={self.k.device}, "
                f"{_html.human_bytes(self.nbytes)})")

    def _repr_html_(self) -> str:
        slots = self.num_blocks * self.page_size
        values = slots * self.num_kv_heads * (self.head_dim + self.v_head_dim)
        return _html.table("kvcache.KVPool", {
            "format": str(self.format),
            "blocks x page_size": f"{self.num_blocks} x {self.page_size} = {slots} token slots",
            "kv heads x head_dim": f"{self.num_kv_heads} x {self.head_dim}" + (
                "" if self.v_head_dim == self.head_dim else f" (V rows: {self.v_head_dim})"),
            "bytes": _html.human_bytes(self.nbytes),
            # (an empty pool, num_blocks=0, holds no values: its display raised ZeroDivisionError)
            "bits per value (scales included)": f"{8 * self.nbytes / values:.2f}" if values else "- (no blocks)",
            "bytes in bf16": _html.human_bytes(2 * values),
        }, "one layer")
