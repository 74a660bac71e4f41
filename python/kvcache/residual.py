"""Full-precision residual pages for quantized paged caches.

Recent tokens carry most of the attention weight, so quantized caches keep them in the model's dtype:
HF's QuantizedCache keeps a ``residual_length`` of tokens, KIVI a window (and its keys, quantized per
channel over a page's tokens, cannot be quantized before the page is complete anyway). Here that is a
property of *pages*: a page is either **sealed** (in the quantized pool, at its block id) or **open**
(in a small full-precision pool, at a residual slot). Open pages are the ones that are still being
written, the ``window`` newest tokens' pages, and the first ``sink_pages`` pages of each sequence.

:class:`ResidualPages` keeps which blocks are open and where, for every layer at once (all layers use
the same block tables), and plans each forward once: which pages to seal (complete, older than the
window as of *before* the forward, so the tokens a forward attends with are never quantized by it),
which sealed pages get new tokens and must be reopened (after a crop, or a prefix match that ends inside
a sealed page: the page is dequantized into a residual slot), where the new tokens go, and the tables
of the two attention passes. :func:`apply` carries the plan out for one layer; :func:`attention` attends
over both pools (two :func:`kvcache.paged_attention` calls merged by their log-sum-exp, exact for what is
stored) and :func:`gather` reads a dense copy.

Sealing quantizes a page with :meth:`kvcache.KVPool.append`, so a bad value (NaN, +-Inf) held in full
precision in an open page costs the page's other tokens nothing when it is sealed (README: "Bad values").

Every sealed token precedes every query of the forward (sealing only takes pages older than its
start, and a page that receives tokens is open), so the sealed pass needs no causal mask: each query is
its own row there and sees all of its sequence's sealed tokens; the open pass is causal, bottom-right.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import ops
from .pool import KVPool


@dataclass
class ResidualPlan:
    """One forward's residual work, the same for every layer (tensors on one device)."""

    seal_slots: torch.Tensor      # [n] int64: residual slots of the pages to quantize now
    seal_targets: torch.Tensor    # [n, page] int64: their token slots in the quantized pool
    reopen_blocks: torch.Tensor   # [m, 1] int32: sealed pages that get new tokens (one-page tables)
    reopen_slots: torch.Tensor    # [m, page] int64: the residual token slots they are dequantized into
    slot_mapping: torch.Tensor    # [batch, q_len] int64: residual token slots of the new tokens, -1 = skip
    open_tables: torch.Tensor     # [batch, w] int32: each row's open pages (residual slots), in order
    open_lens: torch.Tensor       # [batch] int32: tokens in them
    page_slots: torch.Tensor      # [batch, max_pages] int32: every page's residual slot (0 where sealed)
    page_open: torch.Tensor       # [batch, max_pages] bool
    sealed_rows: torch.Tensor     # [r] int64: queries (stored-query index) that see sealed tokens
    sealed_tables: torch.Tensor   # [r, w'] int32: their sequence's sealed blocks, in order
    sealed_lens: torch.Tensor     # [r] int32
    num_slots: int                # residual pool blocks needed
    first_open_page: int = 0      # no row has an open page before this one (the dense gather reads from there)
    _copies: dict = field(default_factory=dict, repr=False)
    _kernel_plans: dict = field(default_factory=dict, repr=False)
    _host: "ResidualPlan | None" = field(default=None, repr=False)  # this plan with its tensors on the host
    _host_cu_q_lens: torch.Tensor | None = field(default=None, repr=False)  # the step's, on the host
    # layers whose pages this plan sealed / reopened (shared by the plan's copies on other devices): see
    # PagedStore.move_residual_pages
    _moved_layers: set = field(default_factory=set, repr=False)

    def on(self, device: torch.device) -> "ResidualPlan":
        if self.slot_mapping.device == device:
            return self
        if device not in self._copies:
            moved = {name: getattr(self, name).to(device) for name in self.__dataclass_fields__
                     if name not in ("num_slots", "first_open_page") and not name.startswith("_")}
            self._copies[device] = ResidualPlan(num_slots=self.num_slots, first_open_page=self.first_open_page,
                                                _kernel_plans=self._kernel_plans,
                                                _moved_layers=self._moved_layers,
                                                _host=self._host or self, _host_cu_q_lens=self._host_cu_q_lens,
                                                **moved)
        return self._copies[device]

    def kernel_plans(self, sealed: KVPool, residual: KVPool, q_heads: int):
        """The kernels' plans of this step (:func:`kvcache.plan_step`) for the open pass over ``residual``
        (its slot mapping included: the new tokens' writes) and the sealed pass over ``sealed`` (``None``
        when no query sees a sealed page), made on first use from the host copies and shared by every layer
        of the same shapes and formats: per layer, no index values are read on the host. ``None`` for
        both when the plan was not made by :func:`kvcache.step.plan_step` (it has no host copies)."""
        if self._host_cu_q_lens is None:
            return None, None
        key = (sealed.plan_key, residual.plan_key, q_heads)
        plans = self._kernel_plans.get(key)
        return plans if plans is not None else self._new_kernel_plans(key, sealed, residual, q_heads)

    @torch.compiler.disable
    def _new_kernel_plans(self, key: tuple, sealed: KVPool, residual: KVPool, q_heads: int):
        # (host reads and an op of data-dependent shape: one clean graph break where a step's first layer makes them,
        # as StepPlan._new_kernel_plan; traced, torch 2.13's dynamo broke inside the op)
        host = self._host or self
        open_plan = residual.plan(host.open_tables, host.open_lens, self._host_cu_q_lens, host.slot_mapping,
                                  q_heads=q_heads)
        sealed_plan = None
        if host.sealed_rows.numel():
            cu = torch.arange(host.sealed_rows.numel() + 1, dtype=torch.int32)
            sealed_plan = sealed.plan(host.sealed_tables, host.sealed_lens, cu, q_heads=q_heads)
        plans = self._kernel_plans[key] = (open_plan, sealed_plan)
        return plans

    @property
    def moves_pages(self) -> bool:
        """Whether the plan seals or reopens pages (work for every layer, not only the ones a forward reaches)."""
        return bool(self.seal_slots.numel() or self.reopen_blocks.numel())

    def seal_plan(self, sealed: KVPool):
        """The kernels' plan of this step's sealing writes into ``sealed`` (one row per page to seal, its
        tokens at ``seal_targets``), or ``None`` without host copies or pages to seal."""
        if self._host_cu_q_lens is None or not self.seal_slots.numel():
            return None
        key = (sealed.plan_key, "seal")
        plan = self._kernel_plans.get(key)
        if plan is None:
            targets = (self._host or self).seal_targets
            n, P = targets.shape
            blocks = (targets[:, :1] // P).to(torch.int32)
            lens = torch.full((n,), P, dtype=torch.int32)
            cu = torch.arange(0, (n + 1) * P, P, dtype=torch.int32)
            plan = self._kernel_plans[key] = sealed.plan(blocks, lens, cu, targets, q_heads=sealed.num_kv_heads)
        return plan


# Residual pools shrink (ResidualPages.compact) only from this many slots up: below it, regrowing costs more
# than the memory saved.
COMPACT_MIN_SLOTS = 64


class ResidualPages:
    """Which blocks are open (held in full precision) and at which residual slot; plans each forward.

    Args:
        page_size: tokens per page.
        window: the newest ``window`` tokens of every sequence stay in full precision (their pages do).
        sink_pages: the first pages of every sequence are never sealed.
        max_slots: the residual pools' fixed size; a plan that needs more slots raises before it changes
            anything. By default slots are numbered on (the pools grow).
    """

    def __init__(self, page_size: int, window: int = 0, sink_pages: int = 0, max_slots: int | None = None):
        if window < 0 or sink_pages < 0:
            raise ValueError(f"window={window} and sink_pages={sink_pages} must be >= 0")
        self.page_size, self.window, self.sink_pages = int(page_size), int(window), int(sink_pages)
        self.max_slots = max_slots          # a fixed residual pool's size (None: the pools grow)
        self.slot_of: dict[int, int] = {}   # open block id -> residual slot
        self._free: list[int] = []
        self.num_slots = 0                  # slots ever handed out (the residual pools' size)
        self.is_live = None                 # block id -> bool (in use); lets full pools reclaim slots
        self._takes_before_collect = 0      # slots _take hands out before it asks about every open block again

    # ---- slots -------------------------------------------------------------------------------------
    def _take(self) -> int:
        full = self.max_slots is not None and self.num_slots >= self.max_slots  # (a collect frees, never adds)
        if not self._free and self.is_live is not None:
            # A collect asks the allocator about every open block. Run on every take that finds no free slot
            # (each page of a long prompt, each request of an Engine whose cached prompts keep pages open), it
            # cost O(open blocks) per page: a 16k-token int8 prefill 2-3x a full-precision one. So a growing
            # pool collects again only after as many takes as it had open blocks (amortized O(1) per take, at
            # most ~2x the slots in use); a full fixed-size pool always collects before it gives up.
            if full or self._takes_before_collect <= 0:
                self.collect()
            else:
                self._takes_before_collect -= 1
        if not self._free and full:
            raise RuntimeError(f"out of residual blocks: all {self.max_slots} are in use")
        if self._free:
            return self._free.pop()
        self.num_slots += 1
        return self.num_slots - 1

    def open(self, block: int) -> int:
        """The block's residual slot, taking one if it has none."""
        slot = self.slot_of.get(block)
        if slot is None:
            slot = self.slot_of[block] = self._take()
        return slot

    def close(self, block: int) -> None:
        """The block no longer needs a slot (sealed, or freed)."""
        slot = self.slot_of.pop(block, None)
        if slot is not None:
            self._free.append(slot)

    def collect(self) -> int:
        """Gives back the slots of blocks that are no longer in use; returns how many."""
        dead = [b for b in self.slot_of if not self.is_live(b)]
        for b in dead:
            self.close(b)
        self._takes_before_collect = max(len(self.slot_of), 16)
        return len(dead)

    def compact(self) -> list[tuple[int, int]] | None:
        """When at most a quarter of the slots handed out hold open pages (after a long prompt's pages were
        sealed, say), renumbers those pages' slots ``0 .. n - 1`` so that the residual pools can shrink to them.
        Returns the (old slot, new slot) page moves to apply to every residual pool, or ``None`` when nothing
        changes (fewer than ``COMPACT_MIN_SLOTS`` slots, a fixed-size pool, or a quarter or more in use). Moves
        go from slots ``>= n`` to free slots ``< n``: no move reads a page another one writes."""
        if self.max_slots is not None or self.num_slots < COMPACT_MIN_SLOTS:
            return None
        # (no collect() here: it asks the allocator about every open block, a cost on every step; the slots of
        # freed blocks are collected when _take runs out, and until then only make this shrink less)
        used = len(self.slot_of)
        if 4 * used > self.num_slots:
            return None
        taken = set(self.slot_of.values())
        free_low = iter(s for s in range(used) if s not in taken)
        moves = []
        for blk, slot in self.slot_of.items():
            if slot >= used:
                new = next(free_low)
                moves.append((slot, new))
                self.slot_of[blk] = new
        self._free.clear()
        self.num_slots = used
        return moves

    def copy_on_write(self, copies: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Blocks copied to new ids (a shared partial page before its write): the copy is open iff the
        source is. Returns the (src slot, dst slot) pairs whose residual pages must be copied."""
        moves = []
        for src, dst in copies:
            if src in self.slot_of:
                moves.append((self.slot_of[src], self.open(dst)))
            else:
                self.close(dst)
        return moves

    # ---- planning ----------------------------------------------------------------------------------
    def plan(self, tables: list[list[int]], before: list[int], after: list[int],
             query_positions: torch.Tensor, valid: torch.Tensor) -> ResidualPlan:
        """Plans a forward in which row ``b`` (blocks ``tables[b]``) goes from ``before[b]`` to
        ``after[b]`` stored tokens. ``query_positions`` ``[batch, q_len]`` are the stored positions of the
        forward's tokens and ``valid`` says which are stored. Updates the bookkeeping: the plan must then
        be applied (:func:`apply`) to every layer before the next plan. A slot freed by sealing may take
        new tokens in the same plan: :func:`apply` copies a page out before it writes."""
        P = self.page_size
        seal, sealed_now = [], set()
        for row, n in zip(tables, before):
            for p in range(self.sink_pages, max(self.sink_pages, (n - self.window) // P)):
                blk = row[p]
                if blk in self.slot_of and blk not in sealed_now:
                    seal.append((self.slot_of[blk], blk))
                    sealed_now.add(blk)
        touched = list(dict.fromkeys((row[p], p * P < n) for row, n, m in zip(tables, before, after)
                                     for p in range(n // P, -(-m // P))))
        needed = len({blk for blk, _ in touched if blk not in self.slot_of})
        if self.max_slots is not None:
            def available() -> int:
                return len(self._free) + len(seal) + self.max_slots - self.num_slots
            if needed > available() and self.is_live is not None:
                # slots of freed blocks not collected yet (_take collects only now and then) count too;
                # a sealed block is live, so collecting cannot drop this plan's seals
                self.collect()
            if needed > available():
                raise RuntimeError(f"out of residual blocks: this append needs {needed}, {available()} are free "
                                   f"(allocate more residual blocks)")
        for _, blk in seal:
            self.close(blk)
        reopen = []
        for blk, partly_filled in touched:
            if blk not in self.slot_of and partly_filled:  # a sealed page that gets more tokens: reopen it
                reopen.append((blk, self.open(blk)))
            else:
                self.open(blk)
        plan = self.view(tables, after, valid.sum(dim=1).tolist())
        pos = torch.where(valid, query_positions, 0)
        slots = plan.page_slots.to(torch.int64).gather(1, pos // P) * P + pos % P
        arange_p = torch.arange(P, dtype=torch.int64)
        plan.seal_slots = torch.tensor([s for s, _ in seal], dtype=torch.int64)
        plan.seal_targets = torch.tensor([blk for _, blk in seal], dtype=torch.int64).view(-1, 1) * P + arange_p
        plan.reopen_blocks = torch.tensor([blk for blk, _ in reopen], dtype=torch.int32).view(-1, 1)
        plan.reopen_slots = torch.tensor([s for _, s in reopen], dtype=torch.int64).view(-1, 1) * P + arange_p
        plan.slot_mapping = torch.where(valid, slots, torch.full_like(slots, -1))
        return plan

    def view(self, tables: list[list[int]], lengths: list[int], q_counts: list[int]) -> ResidualPlan:
        """The tables that read row ``b``'s first ``lengths[b]`` tokens (its last ``q_counts[b]`` being the
        queries, packed row after row) from both pools, without changing anything (nothing to write)."""
        P, batch = self.page_size, len(tables)
        max_pages = max([-(-m // P) for m in lengths] + [1])
        page_slots = torch.zeros(batch, max_pages, dtype=torch.int32)
        page_open = torch.zeros(batch, max_pages, dtype=torch.bool)
        open_rows, open_lens, sealed_rows, sealed_lens = [], [], [], []
        first_open = max_pages
        for b, (row, m) in enumerate(zip(tables, lengths)):
            pages = -(-m // P)
            slots = [self.slot_of.get(blk, -1) for blk in row[:pages]]
            is_open = [s >= 0 for s in slots]
            first_open = min(first_open, next((p for p, o in enumerate(is_open) if o), max_pages))
            page_open[b, :pages] = torch.tensor(is_open, dtype=torch.bool)
            page_slots[b, :pages] = torch.tensor([max(s, 0) for s in slots], dtype=torch.int32)
            tokens = [min(P, m - p * P) for p in range(pages)]
            open_rows.append([s for s, o in zip(slots, is_open) if o])
            open_lens.append(sum(t for t, o in zip(tokens, is_open) if o))
            sealed_rows.append([blk for blk, o in zip(row[:pages], is_open) if not o])
            sealed_lens.append(sum(t for t, o in zip(tokens, is_open) if not o))
        # sealed pass: every query of a row with sealed tokens is its own row
        starts = [sum(q_counts[:b]) for b in range(batch)]
        rows = [(starts[b] + i, b) for b in range(batch) if sealed_lens[b] for i in range(q_counts[b])]
        nothing = torch.zeros(0, dtype=torch.int64)
        return ResidualPlan(
            seal_slots=nothing, seal_targets=nothing.view(0, P), reopen_blocks=nothing.to(torch.int32).view(0, 1),
            reopen_slots=nothing.view(0, P), slot_mapping=nothing.view(0, 0),
            open_tables=_table(open_rows),
            open_lens=torch.tensor(open_lens, dtype=torch.int32),
            page_slots=page_slots,
            page_open=page_open,
            sealed_rows=torch.tensor([r for r, _ in rows], dtype=torch.int64),
            sealed_tables=_table([sealed_rows[b] for _, b in rows]),
            sealed_lens=torch.tensor([sealed_lens[b] for _, b in rows], dtype=torch.int32),
            num_slots=self.num_slots,
            first_open_page=first_open,
        )

    def sealed_pages(self, table: list[int], length: int) -> int:
        """Sealed pages among a sequence's first ``length`` tokens."""
        return sum(blk not in self.slot_of for blk in table[: -(-length // self.page_size)])

    def reset(self) -> None:
        self.slot_of.clear()
        self._free.clear()
        self.num_slots = 0


def _table(rows: list[list[int]]) -> torch.Tensor:
    width = max([len(r) for r in rows] + [1])
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).view(len(rows), width)


# ---- one layer ---------------------------------------------------------------------------------------
def apply(plan: ResidualPlan, sealed: KVPool, residual: KVPool, key: torch.Tensor, value: torch.Tensor,
          q_heads: int | None = None) -> None:
    """Carries out ``plan`` on one layer: quantizes the pages to seal, reopens pages, writes the new K/V (through
    the step's kernel plan for ``q_heads`` query heads when the plan has one: no host reads)."""
    move_pages(plan, sealed, residual)
    write_tokens(plan, sealed, residual, key, value, q_heads)


def move_pages(plan: ResidualPlan, sealed: KVPool, residual: KVPool) -> None:
    """The plan's page moves on one layer: quantizes the pages to seal, then dequantizes the pages to reopen into
    their slots (a slot freed by a seal may be reopened into: in that order). Once per layer and plan: not
    idempotent, a second run would seal a reopened page."""
    if plan.seal_slots.numel():  # (sealing and reopening happen once per page, not per step)
        seal_plan = plan.seal_plan(sealed)
        sealed.append(residual.k[plan.seal_slots], residual.v[plan.seal_slots],
                      plan.seal_targets if seal_plan is None else seal_plan)
    if plan.reopen_blocks.numel():
        m, P = plan.reopen_blocks.shape[0], sealed.page_size
        k, v = sealed.gather(plan.reopen_blocks, torch.full((m,), P, dtype=torch.int32, device=residual.k.device),
                             max_len=P, dtype=residual.k.dtype)
        residual.append(k, v, plan.reopen_slots)


def write_tokens(plan: ResidualPlan, sealed: KVPool, residual: KVPool, key: torch.Tensor, value: torch.Tensor,
                 q_heads: int | None = None) -> None:
    """The forward's new K/V of one layer into its open pages (after :func:`move_pages`)."""
    # each cast on its own (no copy when it has the pool's dtype): a value of another dtype than its key was refused
    # by the op after the pages had been sealed
    key, value = key.to(residual.k.dtype), value.to(residual.v.dtype)
    open_plan, _ = plan.kernel_plans(sealed, residual, q_heads or residual.num_kv_heads)
    residual.append(key, value, plan.slot_mapping if open_plan is None else open_plan)


def attention(plan: ResidualPlan, sealed: KVPool, residual: KVPool, query: torch.Tensor,
              cu_q_lens: torch.Tensor, scale: float, softcap: float = 0.0, return_lse: bool = False):
    """Attention of the stored queries ``[total_q, q_heads, head_dim]`` over both pools."""
    open_plan, sealed_plan = plan.kernel_plans(sealed, residual, query.shape[1])
    if open_plan is not None:
        out, lse = residual.attention_planned(query, open_plan, scale, softcap=softcap, return_lse=True)
    else:
        out, lse = residual.attention(query, plan.open_tables, plan.open_lens, cu_q_lens, scale, softcap=softcap,
                                      return_lse=True)
    if plan.sealed_rows.numel():
        rows = plan.sealed_rows
        q = query.index_select(0, rows)
        if sealed_plan is not None:
            s_out, s_lse = sealed.attention_planned(q, sealed_plan, scale, softcap=softcap, return_lse=True)
        else:
            cu = torch.arange(rows.numel() + 1, dtype=torch.int32, device=query.device)
            s_out, s_lse = sealed.attention(q, plan.sealed_tables, plan.sealed_lens, cu, scale, softcap=softcap,
                                            return_lse=True)
        if rows.numel() == out.shape[0]:  # every query sees sealed pages (decode): rows are 0 .. n - 1
            full_out, full_lse = s_out.to(out.dtype), s_lse
        else:
            full_out = torch.zeros_like(out).index_copy_(0, rows, s_out.to(out.dtype))
            full_lse = torch.full_like(lse, float("-inf")).index_copy_(0, rows, s_lse)
        out, lse = ops.merge_states(out, lse, full_out, full_lse)
    return (out, lse) if return_lse else out


def mla_attention(plan: ResidualPlan, sealed: KVPool, residual: KVPool, q_latent: torch.Tensor, q_rope: torch.Tensor,
                  cu_q_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`kvcache.mla_attention` of the stored queries ``[total_q, q_heads, kv_lora_rank]`` over both pools
    (as :func:`attention`: the open pages, then the sealed ones, merged by their log-sum-exp)."""
    out, lse = residual.mla_attention(q_latent, q_rope, plan.open_tables, plan.open_lens, cu_q_lens, scale,
                                      return_lse=True)
    if plan.sealed_rows.numel():
        rows = plan.sealed_rows
        cu = torch.arange(rows.numel() + 1, dtype=torch.int32, device=q_latent.device)
        s_out, s_lse = sealed.mla_attention(q_latent.index_select(0, rows), q_rope.index_select(0, rows),
                                            plan.sealed_tables, plan.sealed_lens, cu, scale, return_lse=True)
        if rows.numel() == out.shape[0]:  # every query sees sealed pages (decode): rows are 0 .. n - 1
            full_out, full_lse = s_out, s_lse
        else:
            full_out = torch.zeros_like(out).index_copy_(0, rows, s_out)
            full_lse = torch.full_like(lse, float("-inf")).index_copy_(0, rows, s_lse)
        out, lse = ops.merge_states(out, lse, full_out, full_lse)
    return out


def gather(plan: ResidualPlan, sealed: KVPool, residual: KVPool, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K/V ``[batch, kv_heads, max_len, head_dim]``: each page from the pool that holds it."""
    return _gather(plan.page_slots, plan.page_open, sealed, residual, block_tables, seq_lens, max_len, dtype,
                   plan.first_open_page)


def gather_now(pages: ResidualPages, sealed: KVPool, residual: KVPool, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, max_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gather` outside a step: which pages are open, and where, read from ``pages``' bookkeeping as it
    stands (every block of ``block_tables`` up to ``seq_lens``; no plan, nothing changed)."""
    tables = block_tables.cpu()
    slots = torch.tensor([[pages.slot_of.get(int(b), -1) for b in row] for row in tables.tolist()],
                         dtype=torch.int32).view(tables.shape)
    is_open = slots >= 0
    if not bool(is_open.any()):
        return sealed.gather(block_tables, seq_lens, max_len=max_len, dtype=dtype)
    first_open = int(is_open.any(dim=0).nonzero()[0])
    return _gather(slots.clamp(min=0).to(block_tables.device), is_open.to(block_tables.device), sealed, residual,
                   block_tables, seq_lens, max_len, dtype, first_open)


def _gather(page_slots: torch.Tensor, page_open: torch.Tensor, sealed: KVPool, residual: KVPool,
            block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
            dtype: torch.dtype, first_open_page: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    sk, sv = sealed.gather(block_tables, seq_lens, max_len=max_len, dtype=dtype)
    # The residual pool is read from the first page any row holds open (the window is the sequences' tails):
    # over every position it was a second full-length gather and select, which made an int8 decode step under
    # sdpa 2.3x DynamicCache's at 8k tokens. Traced (torch.compile), from 0: the page is a Python int that
    # changes as pages seal, and each value would be a recompile.
    P = sealed.page_size
    start = 0 if torch.compiler.is_compiling() else min(first_open_page * P, max_len)
    if start >= max_len:  # nothing open
        return sk, sv
    if start:
        page_slots = page_slots[:, start // P:].contiguous()
        seq_lens = (seq_lens - start).clamp(min=0)
    rk, rv = residual.gather(page_slots, seq_lens, max_len=max_len - start)
    pos = torch.arange(start, max_len, device=sk.device) // P
    is_open = page_open.index_select(1, pos.clamp(max=page_open.shape[1] - 1))[:, None, :, None]
    if not start:
        return torch.where(is_open, rk.to(dtype), sk), torch.where(is_open, rv.to(dtype), sv)
    sk[:, :, start:] = torch.where(is_open, rk.to(dtype), sk[:, :, start:])
    sv[:, :, start:] = torch.where(is_open, rv.to(dtype), sv[:, :, start:])
    return sk, sv
