"""Benchmarks of the scheduler's pure domain code (``gpusched bench ...``)."""
