"""gpusched accounting: applies usage records exactly once and answers usage queries."""
