"""Tests of the graph layer: builder, shapes, reference evaluator, JSON, ``ck.nn``, examples."""
