"""The dense tower across NN-worker ranks: collectives, DDP/FSDP wrapping and its
memory limiter, gradient control, graceful stop, the process group and device."""
