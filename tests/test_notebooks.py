"""The notebooks run top to bottom in a fresh kernel (and are committed without outputs).

Each runs with ``KVCACHE_NOTEBOOK_QUICK=1`` (the small settings its first cell describes) and saves its
figures as PNG files into ``$KVCACHE_FIGURES_DIR`` when that is set, else into a temporary directory:
never into the repository.
"""

from __future__ import annotations

import json
import os
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
# what each notebook must print when its checks hold
EXPECTED = {
    "01_quickstart.ipynb": ["same tokens as DynamicCache: True | bit-identical logits: True",
                            "kvcache attention, same tokens as DynamicCache: True", "identical to what went in: True",
                            " -> 0 bytes"],
    "02_memory.ipynb": ["equal: True", "reproduces the claim: True"],
    "03_paging.ipynb": ["fork shares the prompt pages: True", "copy-on-write copied 1 block(s); full pages still shared: True",
                        "fork sees the same 10 tokens: True | original untouched: True",
                        "equals kvcache.memory's: True", "deepcopy shares the prompt pages: True",
                        "beam search over pages gives DynamicCache's beams: True"],
    "04_prefix_caching.ipynb": ["same tree: True", "prefix hits:"],
    "05_quantization.ipynb": ["bits/value", "HF QuantizedCache"],
    "06_kernels.ipynb": ["ridge at", "paged kernel"],
}
SAVED = re.compile(r"viz\.save\(fig, \"([^\"]+)\"\)")
# no private name of kvcache (module, attribute or import) in a notebook's code
PRIVATE = re.compile(r"\bkvcache\._|from kvcache\.\w*\s+import\s+_|\b(?:viz|assets|memory)\._")


def _need(module: str):
    # CI installs everything the notebooks need in both environments: there a missing module fails
    if os.environ.get("CI"):
        return __import__(module)
    return pytest.importorskip(module)


def _code(path: pathlib.Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_the_six_notebooks_are_there_and_the_readme_links_each():
    assert [p.name for p in NOTEBOOKS] == sorted(EXPECTED)
    readme = (REPO / "README.md").read_text()
    for path in NOTEBOOKS:
        assert readme.count(f"](notebooks/{path.name})") == 1, path.name


@pytest.fixture(scope="session")
def figures_dir(tmp_path_factory) -> pathlib.Path:
    path = pathlib.Path(os.environ.get("KVCACHE_FIGURES_DIR") or tmp_path_factory.mktemp("figures")).resolve()
    assert REPO not in path.parents and path != REPO, f"figures must be saved outside the repository, not in {path}"
    return path


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, figures_dir, monkeypatch):
    nbformat = _need("nbformat")
    nbclient = _need("nbclient")
    _need("matplotlib")
    if any("transformers" in code or "load_smollm2" in code for code in _code(path)):
        _need("transformers")
    monkeypatch.setenv("KVCACHE_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("KVCACHE_FIGURES_DIR", str(figures_dir))
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
    for expected in EXPECTED[path.name]:
        assert expected in printed
    names = [n for code in _code(path) for n in SAVED.findall(code)]
    assert names, "every notebook saves at least one figure"
    for name in names:
        png = figures_dir / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_clean(path):
    cells = json.loads(path.read_text())["cells"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in cells if c["cell_type"] == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_uses_the_public_api(path):
    for code in _code(path):
        assert not PRIVATE.search(code), PRIVATE.search(code).group(0)
