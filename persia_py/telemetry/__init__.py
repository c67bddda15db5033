"""What a job reports: Prometheus metrics per role and the training log's records."""
