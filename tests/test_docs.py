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


@pytest.mark.parametrize("module", [kvcache, kvcache.ops, kvcache.layout, kvcache.formats, kvcache.quant,
                                    kvcache.pool, kvcache.kivi, kvcache.hf, kvcache.engine],
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
