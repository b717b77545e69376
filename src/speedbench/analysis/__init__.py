"""Decide: paired statistics, summaries, claims. pandas/numpy only, no torch."""
