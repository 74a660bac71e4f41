"""The notebooks run top to bottom in a fresh kernel (and are committed without outputs)."""

from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# what each notebook must print when its checks hold
EXPECTED = {
    "quickstart.ipynb": ["identical to what went in: True"],
    "transformers.ipynb": ["same tokens: True | bit-identical logits: True",
                           "kvcache attention, same tokens as DynamicCache: True", "fork shares the prompt pages: True",
                           "prefix hits: 192 of"],
}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nbformat = pytest.importorskip("nbformat")
    if path.name == "transformers.ipynb":
        pytest.importorskip("transformers")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
    for expected in EXPECTED[path.name]:
        assert expected in printed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_clean(path):
    cells = json.loads(path.read_text())["cells"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in cells if c["cell_type"] == "code")
