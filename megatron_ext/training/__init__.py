"""Training: run configuration, data pipeline, optimizer, metrics and the loop."""
