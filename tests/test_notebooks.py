"""The notebooks run top to bottom in a fresh kernel (and are committed without outputs)."""

from __future__ import annotations

import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3").execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
    assert "identical to what went in: True" in printed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_clean(path):
    cells = json.loads(path.read_text())["cells"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in cells if c["cell_type"] == "code")
