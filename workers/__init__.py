"""Worker roles: the embedding worker, the NN-worker runtime and the data-loader runtime."""
