"""What an equivalent transformers ``DynamicCache`` holds: the figure ``PagedCache.stats()`` and
``Engine.stats()`` report as ``dynamic_cache_bytes``.

``DynamicCache(config=config)`` keeps every token in a full-attention layer but only the newest
``sliding_window - 1`` in a sliding-window (or chunked) layer (``DynamicSlidingWindowLayer``), while
kvcache's pages hold every token of every layer. Which layers slide, and their windows, are read from a
``DynamicCache`` the installed transformers builds for the config (it holds no tensors), so the figure
follows that version's own rules (4.57 and 5.x read ``layer_types`` / ``sliding_window`` /
``attention_chunk_size`` differently)."""

from __future__ import annotations


def layer_windows(config) -> list[int | None]:
    """Per layer, the window of the layer ``DynamicCache(config=config)`` makes for it (``None``: it keeps
    every token). An empty list (every layer keeps every token) without a config, without transformers or
    for a config DynamicCache cannot read (then DynamicCache() without a config is the equivalent)."""
    if config is None:
        return []
    try:
        from transformers import DynamicCache

        cache = DynamicCache(config=config)
    except ImportError:
        return []
    except (AttributeError, TypeError, ValueError, KeyError):  # e.g. a namespace, not a transformers config
        return []
    windows = []
    for layer in cache.layers:
        window = getattr(layer, "sliding_window", None) if getattr(layer, "is_sliding", False) else None
        windows.append(int(window) if window is not None else None)
    return windows


def held_tokens(length: int, window: int | None) -> int:
    """Tokens a DynamicCache layer of this window holds for a row of ``length`` tokens: all of them in a full
    layer, the newest ``window - 1`` in a sliding one (its ``keys[:, :, -window + 1:]``; at ``window=1`` that
    slice keeps every token, and so does this)."""
    if window is None:
        return length
    return len(range(length)[1 - window:])
