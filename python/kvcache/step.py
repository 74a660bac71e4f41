"""One step (forward) of a paged cache, planned once and shared by every layer: :class:`StepPlan`.

:func:`plan_step` is the one place that turns the rows of a step (their sequences, where their new tokens
go) into the index tensors the ops take; :class:`kvcache.PagedCache` (a padded batch from ``generate``) and
:class:`kvcache.Engine` (a packed batch of requests) both use it. Per pool shape and format, the plan also
holds the kernels' own plan (:func:`kvcache.plan_step`: validated indices and the task list, uploaded once),
so the per-layer calls read no index values on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import ops
from .pool import KVPool
from .prefix import Sequence
from .residual import ResidualPlan

__all__ = ["StepPlan", "plan_step"]


@dataclass
class StepPlan:
    """Index tensors of one forward, shared by its layers.

    ``slot_mapping`` is ``[batch, q_len]`` for a padded batch (``-1`` for pads that are not stored) or
    ``[1, total]`` for a packed one; the other tensors are as :func:`kvcache.paged_attention` takes them."""

    length: int                  # slots per row before the step (pads included; 0 for packed steps)
    q_len: int                   # the model's K/V length per row this step (total tokens when packed)
    version: int                 # of the cache's rows when planned (a changed version means: plan again)
    slot_mapping: torch.Tensor   # int64, -1 for pads that are not stored
    block_tables: torch.Tensor   # [batch, max_blocks] int32
    seq_lens: torch.Tensor       # [batch] int32: stored tokens after the step
    cu_q_lens: torch.Tensor      # [batch + 1] int32: stored queries
    query_rows: torch.Tensor | None  # rows of the model's [batch * q_len] queries that are stored; None = all
    num_blocks: int              # 1 + the largest block id in the tables
    residual: ResidualPlan | None = None  # with residual pools: their part of the step
    _copies: dict = field(default_factory=dict, repr=False)
    _kernel_plans: dict = field(default_factory=dict, repr=False)
    _host: tuple | None = field(default=None, repr=False)  # the index tensors on the host, for kernel_plan

    def __repr__(self) -> str:  # (the dataclass's would print every index tensor)
        return (f"StepPlan(batch={self.seq_lens.shape[0]}, length={self.length}, q_len={self.q_len}, "
                f"slot_mapping={list(self.slot_mapping.shape)}, stored_queries={int(self.cu_q_lens[-1])}, "
                f"num_blocks={self.num_blocks}, version={self.version}"
                f"{', residual' if self.residual is not None else ''}, device={self.slot_mapping.device})")

    def on(self, device: torch.device) -> "StepPlan":
        """The plan with its tensors on ``device`` (layers may live on different devices)."""
        if self.slot_mapping.device == device:
            return self
        if device not in self._copies:
            move = {name: getattr(self, name) for name in ("slot_mapping", "block_tables", "seq_lens", "cu_q_lens",
                                                           "query_rows")}
            move = {k: None if v is None else v.to(device) for k, v in move.items()}
            self._copies[device] = StepPlan(self.length, self.q_len, self.version, num_blocks=self.num_blocks,
                                            residual=None if self.residual is None else self.residual.on(device),
                                            _kernel_plans=self._kernel_plans, _host=self._host, **move)
        return self._copies[device]

    def kernel_plan(self, pool: KVPool, q_heads: int) -> ops.StepPlanTensors:
        """The kernels' plan of this step for pools shaped and stored like ``pool`` and ``q_heads`` query
        heads (made on first use, then shared by every such layer): append and attention read their indices
        from it, with no host reads per layer."""
        key = (pool.plan_key, q_heads)
        plan = self._kernel_plans.get(key)
        return plan if plan is not None else self._new_kernel_plan(key, pool, q_heads)

    @torch.compiler.disable
    def _new_kernel_plan(self, key: tuple, pool: KVPool, q_heads: int) -> ops.StepPlanTensors:
        # (once per step and pool shape, at the first such layer: one graph break under torch.compile)
        fmt = pool.op_kwargs()
        # from the host copies: planning reads them, and on a GPU a read of device tensors is a sync
        tables, seq_lens, cu_q_lens, slots = self._host or (self.block_tables, self.seq_lens, self.cu_q_lens,
                                                            self.slot_mapping)
        plan = ops.plan_step(pool.k, pool.v, tables, seq_lens, cu_q_lens, slots, q_heads=q_heads, **fmt)
        self._kernel_plans[key] = plan
        return plan


def _upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to a GPU from pinned memory without blocking (a blocking copy from pageable memory
    would make the host wait for the device's queue: a synchronization per step)."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def plan_step(rows: list[Sequence], starts: list[int], widths: list[int], *, packed: bool, page_size: int,
              device: torch.device | str = "cpu", residual=None, length: int = 0, version: int = 0) -> StepPlan:
    """Plans a forward over ``rows`` (sequences whose blocks already cover their new tokens).

    Row ``b``'s new tokens sit at stored positions ``starts[b] + i`` for ``i < widths[b]``; a negative
    position is a leading pad, not stored. Padded (``packed=False``): the model's K/V are
    ``[batch, heads, max(widths), d]`` and every row has the same width. Packed: ``[1, heads, sum(widths), d]``
    (:class:`kvcache.Engine`'s ragged batches). ``residual``: the store's :class:`kvcache.residual.ResidualPages`,
    if it keeps residual pools (the plan then updates their bookkeeping)."""
    batch = len(rows)
    width = max(widths, default=0)
    max_blocks = max(1, max((len(s.blocks) for s in rows), default=1))
    tables = torch.zeros(batch, max_blocks, dtype=torch.int32)
    for b, seq in enumerate(rows):
        tables[b, : len(seq.blocks)] = seq.blocks
    start = torch.tensor(starts, dtype=torch.int64).view(-1, 1)
    stored_pos = start + torch.arange(width).view(1, -1)                           # [batch, width]
    valid = (stored_pos >= 0) & (torch.arange(width).view(1, -1) < torch.tensor(widths).view(-1, 1))
    pos = stored_pos.clamp(min=0)
    slots = tables.to(torch.int64).gather(1, (pos // page_size).clamp(max=max_blocks - 1)) * page_size + pos % page_size
    slot_mapping = torch.where(valid, slots, torch.full_like(slots, -1))
    q_counts = valid.sum(dim=1)
    seq_lens = (start.view(-1) + torch.tensor(widths)).clamp(min=0).to(torch.int32)
    cu_q = torch.zeros(batch + 1, dtype=torch.int32)
    torch.cumsum(q_counts, 0, out=cu_q[1:])
    query_rows = None
    if packed:
        slot_mapping = slot_mapping[valid].view(1, -1)
    elif not bool(valid.all()):
        query_rows = valid.reshape(-1).nonzero().squeeze(1)
    residual_plan = None
    if residual is not None:
        residual_plan = residual.plan([s.blocks.tolist() for s in rows], [max(0, s) for s in starts],
                                      seq_lens.tolist(), stored_pos, valid)
        if packed:
            residual_plan.slot_mapping = residual_plan.slot_mapping[valid].view(1, -1)
        residual_plan._host_cu_q_lens = cu_q  # with its own tensors (still on the host): its kernel plans
    num_blocks = int(tables.max()) + 1 if batch else 1
    device = torch.device(device)
    return StepPlan(length, int(valid.sum()) if packed else width, version, _upload(slot_mapping, device),
                    _upload(tables, device), _upload(seq_lens, device), _upload(cu_q, device),
                    None if query_rows is None else _upload(query_rows, device), num_blocks,
                    None if residual_plan is None else residual_plan.on(device),
                    _host=(tables, seq_lens, cu_q, slot_mapping))
