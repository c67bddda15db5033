"""Checkpoints: the on-disk layout, the coordinator that dumps and loads a job, the dense
model's files and exports, and rewinding to the data positions a checkpoint recorded."""
