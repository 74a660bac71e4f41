"""kvcache: a paged, quantizable, prefix-shareable KV cache with C++/CUDA kernels.

>>> import torch, kvcache
>>> layout = kvcache.PageLayout(num_blocks=4, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.float16)
>>> k_cache, v_cache = layout.allocate()
>>> k_cache.shape
torch.Size([4, 2, 16, 64])
"""

from __future__ import annotations

import torch  # libtorch must be loaded before the extension that links against it

from ._build import load_extension

_C = load_extension()  # registers torch.ops.kvcache.*; must precede any Python-side registration

from . import formats, memory, ops, quant, reference  # noqa: E402
from .formats import CacheFormat, KVFormat  # noqa: E402
from .layout import PageLayout  # noqa: E402
from .pool import KVPool  # noqa: E402
from .kivi import KIVIPool  # noqa: E402
from .prefix import (  # noqa: E402
    BlockAllocator, Insert, Match, MatchInto, Namespace, OutOfBlocksError, PrefixCache, RaggedMatch, RaggedMatchInto,
    Sequence,
)
from .residual import ResidualPlan  # noqa: E402
from .hf import PagedCache, PagedLayer, PagedStore, StepPlan, install_registration as _install_registration  # noqa: E402
from .engine import Engine, Result  # noqa: E402
from . import tiers  # noqa: E402
from .tiers import BlobError, CostModel, DiskTier, PrefixTiers, RedisTier  # noqa: E402
from .ops import (  # noqa: E402
    append, append_planned, copy_blocks, merge_states, mla_attention, paged_attention, paged_attention_planned,
    paged_gather, paged_gather_ragged, plan_step, StepPlanTensors, swap_blocks,
)

_install_registration()  # attn_implementation="kvcache", as soon as transformers is imported

__version__ = "0.1.0"
build_info: dict = dict(_C.build_info)


def cpu_isa() -> str:
    """The build of the CPU attention kernel this process runs: "generic", "avx2", "avx512" or "avx512bf16"
    (the best the CPU supports, chosen at import; write it beside every CPU timing)."""
    return _C.cpu_isa()


__all__ = [
    "BlobError",
    "BlockAllocator",
    "CacheFormat",
    "CostModel",
    "DiskTier",
    "Engine",
    "Insert",
    "KVFormat",
    "KIVIPool",
    "KVPool",
    "Match",
    "MatchInto",
    "Namespace",
    "OutOfBlocksError",
    "PageLayout",
    "PagedCache",
    "PagedLayer",
    "PagedStore",
    "PrefixCache",
    "PrefixTiers",
    "RaggedMatch",
    "RaggedMatchInto",
    "RedisTier",
    "ResidualPlan",
    "Result",
    "Sequence",
    "StepPlan",
    "StepPlanTensors",
    "append",
    "append_planned",
    "build_info",
    "formats",
    "copy_blocks",
    "cpu_isa",
    "memory",
    "merge_states",
    "mla_attention",
    "ops",
    "paged_attention",
    "paged_attention_planned",
    "paged_gather",
    "paged_gather_ragged",
    "plan_step",
    "prefix",
    "quant",
    "reference",
    "swap_blocks",
    "tiers",
]
