"""The examples in the docstrings and the README's op example run and print what they claim."""

from __future__ import annotations

import doctest
import pathlib
import re

import pytest
import torch

import kvcache
import kvcache.formats
import kvcache.kivi
import kvcache.layout
import kvcache.ops
import kvcache.pool
import kvcache.quant
import kvcache.viz


@pytest.mark.parametrize("module", [kvcache, kvcache.ops, kvcache.layout, kvcache.formats, kvcache.quant,
                                    kvcache.pool, kvcache.kivi, kvcache.hf, kvcache.engine, kvcache.viz,
                                    kvcache.tiers],
                         ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


def test_readme_ops_example():
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Using the ops\n\n```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(block, scope)
    assert scope["k"].shape == (1, 8, 20, 128)
    assert torch.equal(scope["k"], scope["key"]) and torch.equal(scope["v"], scope["value"])


def test_readme_plan_example():
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    ops_block = re.search(r"## Using the ops\n\n```python\n(.*?)```", readme, re.S).group(1)
    plan_block = re.search(r"\*\*Plan once per step, run per layer\.\*\*.*?```python\n(.*?)```", readme, re.S).group(1)
    scope: dict = {}
    exec(ops_block, scope)
    reads = kvcache.ops.host_index_reads()
    exec(plan_block, scope)
    assert kvcache.ops.host_index_reads() == reads + 4  # the plan's reads; none per layer
    assert scope["out"].shape == (1, 32, 128) and bool(torch.isfinite(scope["out"]).all())
