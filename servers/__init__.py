"""The embedding parameter server: storage, optimizers and its gRPC service."""
