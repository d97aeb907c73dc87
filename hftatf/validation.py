"""Checks on user input: see `hftatf.core.validation`."""

from hftatf.core.validation import (  # noqa: F401  re-exported until callers move
    check_model_axis,
    check_num_models,
    shared,
)
