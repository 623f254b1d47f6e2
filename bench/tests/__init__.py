"""Tests of the benchmarks (not shipped in the wheel)."""
