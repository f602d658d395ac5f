"""The error a user can cause while building, evaluating or optimising a graph."""

from __future__ import annotations


class GraphError(ValueError):
    """Invalid user input: the message names the op, the shapes or dtypes, and what is valid."""
