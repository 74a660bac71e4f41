"""Argument checks shared by the public classes: a wrong type is a TypeError naming the argument."""

from __future__ import annotations

import numbers

import torch


def integer_arg(name: str, value, what: str) -> int:
    """``value`` as an int: ints and numpy / torch integer scalars pass. A bool, a float (even ``2.0``) or
    anything else is a TypeError naming the argument: a float would be truncated silently, a bool read as 0 / 1."""
    if torch.is_tensor(value) and value.dim() == 0 and not (value.is_floating_point() or value.is_complex()
                                                             or value.dtype == torch.bool):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int ({what}), not {type(value).__name__}")
    return int(value)
