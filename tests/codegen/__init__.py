"""Tests of cherenkov.codegen: layouts, generated source, compilation, and GPU runs."""
