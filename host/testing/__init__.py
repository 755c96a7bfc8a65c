"""Test machinery for tests and benchmarks (local clusters); not used by the product."""
