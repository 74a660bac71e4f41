"""Plotting helpers for the notebooks: small functions that each draw one kind of picture and return the
matplotlib ``Figure``.

matplotlib is an optional dependency (``pip install kvcache[viz]``): it is imported when a function here
is first called, never by ``import kvcache``. Without a display (a test run, a server) the non-interactive
``Agg`` backend is selected. :func:`save` writes a figure as a PNG file into ``$KVCACHE_FIGURES_DIR``
when that is set (the notebook tests set it to a directory outside the repository).

>>> from kvcache import viz
>>> fig = viz.line_plot([1, 2, 4], {"bf16": [2, 4, 8], "int8": [1, 2, 4]}, xlabel="tokens", ylabel="bytes")
>>> len(fig.axes[0].lines)
2
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["bar_chart", "heatmap", "line_plot", "occupancy", "radix_tree", "roofline", "save"]

FIGURES_ENV = "KVCACHE_FIGURES_DIR"


def _pyplot():
    """matplotlib.pyplot, imported on first use (Agg when there is no display)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("kvcache.viz needs matplotlib: pip install kvcache[viz]") from None
    # An interactive backend without a display fails at the first figure; Jupyter sets MPLBACKEND (inline).
    if "MPLBACKEND" not in os.environ and not os.environ.get("DISPLAY"):
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(figsize):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    return fig, ax


def _is_number(value) -> bool:
    """A real number: int, float, or a numpy scalar (bool excluded)."""
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _host_floats(values):
    """A torch tensor as float32 on the host (numpy has no bfloat16, and cannot read device memory)."""
    if hasattr(values, "detach") and hasattr(values, "float"):
        return values.detach().float().cpu()
    return values


def _host_list(values):
    """Values as a Python list: a torch tensor (any dtype, bfloat16 included) or numpy array via float32 on the
    host, so that its elements are numbers (a tensor's elements are 0-d tensors: drawn as labels, 'tensor(1024)')."""
    if hasattr(values, "detach") and hasattr(values, "float"):
        return [float(v) for v in _host_floats(values).reshape(-1).tolist()]
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple, str)):
        return list(values.tolist())
    return list(values)


def _check_series(x: Sequence, series: Mapping, x_name: str = "x") -> None:
    if not isinstance(series, Mapping) or not series:
        raise ValueError("series must be a non-empty mapping of label -> values")
    for label, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"series[{label!r}] has {len(ys)} values but {x_name} has {len(x)}")


def line_plot(x: Sequence, series: Mapping[str, Sequence[float]], *, xlabel: str = "", ylabel: str = "",
              title: str = "", logx: bool = False, logy: bool = False, markers: bool = True,
              hlines: Mapping[str, float] | None = None, figsize=(6.4, 4.0)):
    """One line per entry of ``series`` (label -> y values, one per ``x``); ``hlines`` adds labelled
    horizontal reference lines (e.g. a memory budget). ``x`` holds numbers, or labels (strings such as
    ``["1k", "8k"]``), which are drawn evenly spaced in their order, one tick each (no ``logx`` then). Tensors
    and numpy arrays are taken as their values."""
    x = _host_list(x)
    if isinstance(series, Mapping):
        series = {label: _host_list(ys) for label, ys in series.items()}
    _check_series(x, series)
    numeric = [_is_number(v) for v in x]
    categorical = len(numeric) > 0 and not any(numeric)
    if not categorical and not all(numeric):
        bad = next(v for v, ok in zip(x, numeric) if not ok)
        raise ValueError(f"x must be all numbers or all labels (strings), got {bad!r} among numbers")
    if categorical and logx:
        raise ValueError(f"logx=True needs numeric x, got labels {list(x)[:3]!r}")
    fig, ax = _figure(figsize)
    xs = list(range(len(x))) if categorical else list(x)
    for label, ys in series.items():
        ax.plot(xs, list(ys), marker="o" if markers else None, markersize=3, label=str(label))
    for i, (label, y) in enumerate((hlines or {}).items()):
        ax.axhline(y, color="0.4", linestyle=("--", ":", "-.")[i % 3], linewidth=1, label=str(label))
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if categorical:
        ax.set_xticks(xs, [str(v) for v in x])
    elif logx:
        ax.set_xscale("log", base=2)
    elif all(float(v).is_integer() for v in x):  # counts (requests, steps): no ticks between them
        from matplotlib.ticker import MaxNLocator
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def bar_chart(labels: Sequence[str], series: Mapping[str, Sequence[float]], *, ylabel: str = "", title: str = "",
              logy: bool = False, horizontal: bool = False, figsize=(6.4, 4.0)):
    """Grouped bars: one group per label, one bar per entry of ``series`` (name -> one value per label; tensors
    and numpy arrays are taken as their values)."""
    labels = _host_list(labels) if hasattr(labels, "tolist") else labels
    if isinstance(series, Mapping):
        series = {name: _host_list(values) for name, values in series.items()}
    _check_series(labels, series, "labels")
    fig, ax = _figure(figsize)
    n = len(series)
    width = 0.8 / n
    positions = range(len(labels))
    for i, (name, values) in enumerate(series.items()):
        offsets = [p - 0.4 + width * (i + 0.5) for p in positions]
        if horizontal:
            ax.barh(offsets, list(values), height=width, label=str(name))
        else:
            ax.bar(offsets, list(values), width=width, label=str(name))
    if horizontal:
        ax.set_yticks(list(positions), [str(label) for label in labels])
        ax.invert_yaxis()
        ax.set(xlabel=ylabel, title=title)
        if logy:
            ax.set_xscale("log")
    else:
        ax.set_xticks(list(positions), [str(label) for label in labels], rotation=30, ha="right")
        ax.set(ylabel=ylabel, title=title)
        if logy:
            ax.set_yscale("log")
    ax.grid(True, axis="x" if horizontal else "y", alpha=0.3)
    if n > 1:
        ax.legend(fontsize="small")
    return fig


def heatmap(values, *, xlabel: str = "", ylabel: str = "", title: str = "", colorbar: str = "", log: bool = False,
            cmap: str = "viridis", figsize=(6.4, 4.0)):
    """A 2-D array (rows drawn top to bottom) as a colour image, e.g. error per (layer, head)."""
    import numpy as np

    data = np.asarray(_host_floats(values), dtype=float)
    if data.ndim != 2 or 0 in data.shape:
        raise ValueError(f"values must be a non-empty 2-D array, got shape {tuple(data.shape)}")
    fig, ax = _figure(figsize)
    norm = None
    if log:
        from matplotlib.colors import LogNorm

        positive = data[data > 0]
        if positive.size == 0:
            raise ValueError("log=True needs at least one positive value")
        norm = LogNorm(vmin=positive.min(), vmax=positive.max())
    image = ax.imshow(data, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
    fig.colorbar(image, ax=ax, label=colorbar)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return fig


def occupancy(owners, *, title: str = "", xlabel: str = "step", ylabel: str = "block", figsize=(7.0, 4.0)):
    """Pool occupancy over time: ``owners[t][b]`` is the request holding block ``b`` at step ``t``
    (``-1`` = free). Each request gets a colour of its own (tab20's for the first 20, then hues a golden angle
    apart), free blocks are white."""
    import numpy as np

    rows = list(owners) if isinstance(owners, Sequence) and not isinstance(owners, str) else None
    if rows and all(isinstance(r, Sequence) and not isinstance(r, str) for r in rows):
        widths = [len(r) for r in rows]
        if len(set(widths)) > 1:
            step = next(t for t, w in enumerate(widths) if w != widths[0])
            raise ValueError(f"owners must have the same number of blocks at every step: step 0 has {widths[0]}, "
                             f"step {step} has {widths[step]}")
    grid = np.asarray(_host_floats(owners), dtype=float)
    if grid.ndim != 2 or 0 in grid.shape:
        raise ValueError(f"owners must be a non-empty [steps, blocks] array, got shape {tuple(grid.shape)}")
    plt = _pyplot()
    fig, ax = _figure(figsize)
    masked = np.ma.masked_less(grid.T, 0)
    import colorsys

    from matplotlib.colors import ListedColormap

    # one colour per request id (owner % 20 on tab20 gave requests 0 and 20 the same one, side by side)
    count = max(int(grid.max()) + 1, 1)
    colours = list(plt.get_cmap("tab20").colors)[:count]
    colours += [colorsys.hsv_to_rgb((i * 0.618033988749895) % 1.0, 0.55 + 0.45 * (i % 2), 0.65 + 0.35 * (i // 2 % 2))
                for i in range(count - len(colours))]
    cmap = ListedColormap(colours).with_extremes(bad="white")
    ax.imshow(masked, aspect="auto", interpolation="nearest", cmap=cmap, vmin=-0.5, vmax=count - 0.5, origin="lower")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    return fig


def _radix(sequences) -> dict:
    """The radix tree a :class:`kvcache.PrefixCache` builds from ``sequences`` inserted in this order: nested
    {edge tuple: children}. An edge is split only where a later sequence leaves it and goes on; a sequence
    that ends inside an edge (a prefix of an earlier one) adds nothing, as in the cache."""
    root: dict = {}
    for seq in sequences:
        node, rest = root, tuple(seq)
        while rest:
            for edge in list(node):
                n = 0
                while n < min(len(edge), len(rest)) and edge[n] == rest[n]:
                    n += 1
                if n == 0:
                    continue
                if n == len(rest):  # the sequence ends on this edge: the cache has it already, no split
                    rest = ()
                    break
                if n < len(edge):  # split the edge where the new sequence leaves it
                    node[edge[:n]] = {edge[n:]: node.pop(edge)}
                    edge = edge[:n]
                node, rest = node[edge], rest[n:]
                break
            else:
                node[rest] = {}
                rest = ()
    return root


def radix_tree(sequences, *, labels=None, title: str = "", figsize=(7.0, 4.5)):
    """Draws the radix tree of token ``sequences``: the tree a :class:`kvcache.PrefixCache` holds after
    inserting them in this order (one namespace, no eviction), node for node. The cache splits an edge only
    where a sequence leaves it and goes on, so the order matters: ``[[1, 2, 3, 4], [1, 2]]`` is one node
    (``[1, 2]`` ends inside the first edge), ``[[1, 2], [1, 2, 3, 4]]`` two. Each edge is labelled with its
    token count (or with ``labels(tokens)``); a node's width is its number of leaves. Returns the figure;
    ``fig.kvcache_nodes`` is the number of nodes drawn (the root excluded), the cache's
    ``stats()["nodes"]``."""
    seqs = [list(s) for s in sequences]
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ValueError("sequences must be a non-empty list of non-empty token sequences")
    tree = _radix(seqs)
    fig, ax = _figure(figsize)

    def leaves(node: dict) -> int:
        return sum(leaves(child) for child in node.values()) or 1

    count = 0
    depth_max = 0

    def draw(node: dict, x0: float, depth: int, xy: tuple[float, float]) -> None:
        nonlocal count, depth_max
        x = x0
        for i, (edge, child) in enumerate(node.items()):
            width = leaves(child)
            cx, cy = x + width / 2, -(depth + 1)
            ax.plot([xy[0], cx], [xy[1], cy], color="0.5", linewidth=1, zorder=1)
            ax.scatter([cx], [cy], s=40, color="C0" if child else "C1", zorder=2)
            text = labels(edge) if labels else f"{len(edge)}"
            # towards the child, where siblings are a whole leaf apart, alternately higher and lower so that
            # neighbouring labels do not overlap
            t = 0.62 if i % 2 == 0 else 0.82
            ax.annotate(text, (xy[0] + t * (cx - xy[0]), xy[1] + t * (cy - xy[1])), fontsize=7, ha="center",
                        va="center", bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))
            count += 1
            depth_max = max(depth_max, depth + 1)
            draw(child, x, depth + 1, (cx, cy))
            x += width

    total = leaves(tree)
    ax.scatter([total / 2], [0], s=60, color="k", zorder=2)
    draw(tree, 0.0, 0, (total / 2, 0))
    ax.set(title=title, xlim=(-0.5, total + 0.5), ylim=(-depth_max - 0.5, 0.5))
    ax.axis("off")
    fig.kvcache_nodes = count
    return fig


def roofline(points: Sequence[tuple[str, float, float]], *, peak_flops: float, peak_bandwidth: float,
             title: str = "", figsize=(6.4, 4.2)):
    """A roofline: measured ``(label, arithmetic intensity in FLOP/byte, achieved FLOP/s)`` points under
    the roof ``min(peak_flops, intensity * peak_bandwidth)`` (both measured or quoted, in FLOP/s and
    byte/s). Points left of the ridge are memory-bound, right of it compute-bound."""
    if not points:
        raise ValueError("points must hold at least one (label, intensity, flops) tuple")
    for name, value in (("peak_flops", peak_flops), ("peak_bandwidth", peak_bandwidth)):
        if not (_is_number(value) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    for label, intensity, flops in points:
        try:
            values = float(intensity), float(flops)
        except (TypeError, ValueError):
            values = (math.nan, math.nan)
        if isinstance(intensity, (bool, str)) or not all(0 < v < math.inf for v in values):
            raise ValueError(f"point {label!r} needs a positive, finite intensity and FLOP/s, got {intensity}, {flops}")
    import numpy as np

    fig, ax = _figure(figsize)
    lo = min(p[1] for p in points) / 4
    hi = max(max(p[1] for p in points) * 4, 4 * peak_flops / peak_bandwidth)
    xs = np.geomspace(lo, hi, 200)
    ax.plot(xs, np.minimum(peak_flops, xs * peak_bandwidth), color="k", linewidth=1.5, label="roof")
    ax.axvline(peak_flops / peak_bandwidth, color="0.6", linestyle=":", linewidth=1, label="ridge")
    for i, (label, intensity, flops) in enumerate(points):
        ax.scatter([intensity], [flops], s=30, color=f"C{i % 10}", zorder=3, label=str(label))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(xlabel="arithmetic intensity (FLOP / byte)", ylabel="FLOP / s", title=title)
    ax.grid(True, which="both", alpha=0.2)
    ax.legend(fontsize="x-small")
    return fig


def save(fig, name: str, directory: str | os.PathLike | None = None) -> Path | None:
    """Writes ``fig`` as ``<name>.png`` into ``directory`` (default ``$KVCACHE_FIGURES_DIR``) and returns the
    path; returns ``None`` and writes nothing when no directory is given or set. The figure stays open
    (a notebook still shows it)."""
    if not name or any(c in name for c in "/\\"):
        raise ValueError(f"name must be a plain file name without slashes, got {name!r}")
    directory = directory if directory is not None else os.environ.get(FIGURES_ENV)
    if not directory:
        return None
    path = Path(directory).expanduser() / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
