"""Shared contracts, topics, settings and wiring for every gpusched service.

Services import from here and never from each other.
"""
