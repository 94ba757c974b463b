"""The commerce team: customer models trained on features from a Feast feature store."""
