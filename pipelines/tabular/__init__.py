"""The tabular team: gradient-boosted trees on tabular data."""
