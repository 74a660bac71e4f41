"""kvcache.viz on small inputs: what each figure holds, the PNG it saves, and its errors."""

from __future__ import annotations

import builtins
import os
import subprocess
import sys

import pytest

if not os.environ.get("CI"):  # CI installs matplotlib in both environments: there a missing one fails
    pytest.importorskip("matplotlib")

from kvcache import viz  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def test_import_kvcache_does_not_import_matplotlib():
    code = "import sys, kvcache, kvcache.viz; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_missing_matplotlib_names_the_extra(monkeypatch):
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install kvcache\[viz\]"):
        viz.line_plot([1, 2], {"a": [1, 2]})


def test_line_plot_draws_each_series_and_reference_line():
    fig = viz.line_plot([1, 2, 4], {"bf16": [2, 4, 8], "int8": [1, 2, 4]}, hlines={"budget": 5}, logx=True,
                        xlabel="tokens", ylabel="bytes")
    ax = fig.axes[0]
    lines = {line.get_label(): line for line in ax.lines}
    assert set(lines) == {"bf16", "int8", "budget"}
    assert list(lines["int8"].get_ydata()) == [1, 2, 4]
    assert list(lines["budget"].get_ydata()) == [5, 5]
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "tokens"


def test_line_plot_rejects_a_series_of_the_wrong_length():
    with pytest.raises(ValueError, match=r"series\['b'\] has 1 values but x has 2"):
        viz.line_plot([1, 2], {"a": [1, 2], "b": [1]})
    with pytest.raises(ValueError, match="series must be a non-empty mapping"):
        viz.line_plot([1, 2], {})


def test_line_plot_takes_labels_as_x():
    fig = viz.line_plot(["1k", "8k", "32k"], {"a": [1, 2, 3]})
    ax = fig.axes[0]
    assert list(ax.lines[0].get_xdata()) == [0, 1, 2] and list(ax.lines[0].get_ydata()) == [1, 2, 3]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1k", "8k", "32k"]
    with pytest.raises(ValueError, match=r"x must be all numbers or all labels \(strings\), got '8k' among"):
        viz.line_plot([1, "8k"], {"a": [1, 2]})
    with pytest.raises(ValueError, match=r"logx=True needs numeric x, got labels \['1k', '8k'\]"):
        viz.line_plot(["1k", "8k"], {"a": [1, 2]}, logx=True)
    np = pytest.importorskip("numpy")
    fig = viz.line_plot(np.array([1.0, 2.0]), {"a": np.array([3.0, 4.0])})  # numpy x stays numeric
    assert list(fig.axes[0].lines[0].get_xdata()) == [1.0, 2.0]


def test_bar_chart_groups_bars():
    fig = viz.bar_chart(["a", "b", "c"], {"x": [1, 2, 3], "y": [3, 2, 1]}, logy=True)
    ax = fig.axes[0]
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights == [1, 1, 2, 2, 3, 3]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    fig = viz.bar_chart(["a", "b"], {"x": [4, 5]}, horizontal=True)
    assert sorted(p.get_width() for p in fig.axes[0].patches) == [4, 5]
    with pytest.raises(ValueError, match="has 1 values but labels has 2"):
        viz.bar_chart(["a", "b"], {"x": [1]})


def test_heatmap_shows_the_array():
    fig = viz.heatmap([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], log=True, colorbar="error")
    image = fig.axes[0].images[0]
    assert image.get_array().shape == (2, 3) and float(image.get_array()[1, 2]) == 6.0
    with pytest.raises(ValueError, match=r"2-D array, got shape \(3,\)"):
        viz.heatmap([1, 2, 3])
    with pytest.raises(ValueError, match="needs at least one positive value"):
        viz.heatmap([[0.0, -1.0]], log=True)


def test_heatmap_and_occupancy_take_torch_tensors_in_any_dtype():
    """numpy cannot read a bfloat16 tensor: a per-(layer, head) error computed in the model's dtype drew nothing."""
    torch = pytest.importorskip("torch")
    errors = torch.tensor([[0.5, 1.0, 2.0], [4.0, 8.0, 16.0]], dtype=torch.bfloat16, requires_grad=True)
    image = viz.heatmap(errors * 1, log=True).axes[0].images[0]
    assert image.get_array().shape == (2, 3) and float(image.get_array()[1, 2]) == 16.0
    data = viz.occupancy(torch.tensor([[-1, 0, 0], [1, 0, -1]], dtype=torch.int32)).axes[0].images[0].get_array()
    assert data.shape == (3, 2) and bool(data.mask[0, 0]) and not data.mask[1, 0]


def test_line_plot_and_bar_chart_take_tensors_as_values():
    """A tensor's elements are 0-d tensors: x = torch.tensor([1024, ...]) was drawn as labels 'tensor(1024)' (and
    logx=True refused it), bf16 values raised numpy's 'unsupported ScalarType BFloat16'."""
    torch = pytest.importorskip("torch")
    x = torch.tensor([1024, 2048, 4096])
    fig = viz.line_plot(x, {"ms": torch.tensor([1.0, 2.0, 4.0], dtype=torch.bfloat16)}, logx=True)
    line = fig.axes[0].lines[0]
    assert list(line.get_xdata()) == [1024.0, 2048.0, 4096.0] and list(line.get_ydata()) == [1.0, 2.0, 4.0]
    bars = viz.bar_chart(["a", "b"], {"v": torch.tensor([3.0, 5.0], dtype=torch.bfloat16)}).axes[0].patches
    assert [b.get_height() for b in bars] == [3.0, 5.0]


def test_occupancy_gives_every_request_its_own_colour():
    """owner % 20 on tab20 drew requests 0 and 20 (and 1 and 21, ...) in one colour, side by side."""
    owners = [list(range(48))]                  # one step, 48 blocks of 48 requests
    image = viz.occupancy(owners).axes[0].images[0]
    colours = {tuple(image.cmap(image.norm(i))) for i in range(48)}
    assert len(colours) == 48


def test_occupancy_masks_free_blocks():
    owners = [[-1, 0, 0], [1, 0, -1]]          # 2 steps x 3 blocks
    fig = viz.occupancy(owners)
    data = fig.axes[0].images[0].get_array()
    assert data.shape == (3, 2)                 # blocks drawn as rows
    assert bool(data.mask[0, 0]) and bool(data.mask[2, 1]) and not data.mask[1, 0]
    with pytest.raises(ValueError, match="owners must be a non-empty"):
        viz.occupancy([])
    with pytest.raises(ValueError, match="owners must have the same number of blocks at every step: step 0 "
                                         "has 2, step 2 has 1"):
        viz.occupancy([[0, 1], [0, -1], [0]])


def test_radix_tree_splits_where_sequences_diverge():
    # [1..6], [1,2,3,9] and [1,2,3,4,5,6,7]: edges 1-2-3 | 4-5-6 | 7, and 9
    fig = viz.radix_tree([[1, 2, 3, 4, 5, 6], [1, 2, 3, 9], [1, 2, 3, 4, 5, 6, 7]])
    assert fig.kvcache_nodes == 4
    texts = sorted(t.get_text() for t in fig.axes[0].texts)
    assert texts == ["1", "1", "3", "3"]
    assert viz.radix_tree([[5, 6], [7]]).kvcache_nodes == 2
    with pytest.raises(ValueError, match="non-empty token sequences"):
        viz.radix_tree([[1], []])


def test_radix_tree_draws_no_node_for_a_prefix_of_an_earlier_sequence():
    import kvcache

    for seqs, nodes in (([[1, 2, 3, 4], [1, 2]], 1), ([[1, 2], [1, 2, 3, 4]], 2), ([[1, 2, 3], [1, 2, 3]], 1)):
        alloc = kvcache.BlockAllocator(8, 1)
        cache = kvcache.PrefixCache(alloc)
        for s in seqs:
            cache.insert(s, alloc.allocate(len(s)))
        assert cache.stats()["nodes"] == nodes
        assert viz.radix_tree(seqs).kvcache_nodes == nodes


@pytest.mark.parametrize("seed", range(40))
def test_radix_tree_is_the_prefix_cache_tree_in_any_insert_order(seed):
    """Random sequences sharing prefixes (some a prefix of another, some repeated), inserted in a random order:
    the drawing has the cache's nodes, and its edge labels (token counts) add up to the cache's tokens."""
    import random

    import kvcache

    rng = random.Random(seed)
    page = rng.choice([1, 4, 16])
    base = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
    seqs = []
    for _ in range(rng.randint(1, 8)):
        k = rng.randint(0, len(base))
        seqs.append(base[:k] + [rng.randrange(4) for _ in range(rng.randint(0 if k else 1, 20))])
    rng.shuffle(seqs)
    alloc = kvcache.BlockAllocator(4096, page)
    cache = kvcache.PrefixCache(alloc)
    for s in seqs:
        blocks = alloc.allocate(-(-len(s) // page))
        cache.insert(s, blocks)
        alloc.free(blocks)
    fig = viz.radix_tree(seqs)
    s = cache.stats()
    assert fig.kvcache_nodes == s["nodes"]
    assert sum(int(t.get_text()) for t in fig.axes[0].texts) == s["device_tokens"]


def test_radix_tree_matches_the_prefix_cache():
    import random

    import kvcache

    rng = random.Random(0)
    system = [rng.randrange(100) for _ in range(20)]
    seqs = [system + [rng.randrange(100) for _ in range(rng.randrange(1, 12))] for _ in range(6)]
    seqs += [system[:7] + [rng.randrange(100) for _ in range(5)]]
    alloc = kvcache.BlockAllocator(64, 4)
    cache = kvcache.PrefixCache(alloc)
    for s in seqs:
        cache.insert(s, alloc.allocate(-(-len(s) // 4)))
    assert viz.radix_tree(seqs).kvcache_nodes == cache.stats()["nodes"]


def test_roofline_draws_the_roof_and_points():
    fig = viz.roofline([("decode", 1.0, 1e9), ("prefill", 50.0, 5e10)], peak_flops=1e11, peak_bandwidth=1e10)
    ax = fig.axes[0]
    roof = next(line for line in ax.lines if line.get_label() == "roof")
    assert max(roof.get_ydata()) == pytest.approx(1e11)
    assert roof.get_ydata()[0] == pytest.approx(roof.get_xdata()[0] * 1e10)
    assert len(ax.collections) == 2
    with pytest.raises(ValueError, match="peak_bandwidth must be a positive number, got 0"):
        viz.roofline([("a", 1.0, 1.0)], peak_flops=1.0, peak_bandwidth=0)
    with pytest.raises(ValueError, match="point 'a' needs a positive, finite intensity"):
        viz.roofline([("a", 0.0, 1.0)], peak_flops=1.0, peak_bandwidth=1.0)
    for bad in ((float("inf"), 1.0), (1.0, float("nan")), ("2", 1.0)):  # (inf drew a figure that could not be saved)
        with pytest.raises(ValueError, match="point 'a' needs a positive, finite intensity and FLOP/s"):
            viz.roofline([("a", *bad)], peak_flops=1.0, peak_bandwidth=1.0)
    np = pytest.importorskip("numpy")  # numpy scalars (e.g. a measured peak) are numbers too
    fig = viz.roofline([("a", 1.0, 1.0)], peak_flops=np.float32(1e9), peak_bandwidth=np.int64(10**9))
    roof = next(line for line in fig.axes[0].lines if line.get_label() == "roof")
    assert max(roof.get_ydata()) == pytest.approx(1e9)
    with pytest.raises(ValueError, match="peak_flops must be a positive number, got True"):
        viz.roofline([("a", 1.0, 1.0)], peak_flops=True, peak_bandwidth=1.0)


def test_save_writes_a_png_into_the_figures_dir(tmp_path, monkeypatch):
    fig = viz.line_plot([1, 2], {"a": [1, 2]})
    monkeypatch.delenv(viz.FIGURES_ENV, raising=False)
    assert viz.save(fig, "nothing") is None
    monkeypatch.setenv(viz.FIGURES_ENV, str(tmp_path / "figs"))
    path = viz.save(fig, "line")
    assert path == tmp_path / "figs" / "line.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert viz.save(fig, "other", tmp_path) == tmp_path / "other.png"
    with pytest.raises(ValueError, match="name must be a plain file name"):
        viz.save(fig, "../escape")

