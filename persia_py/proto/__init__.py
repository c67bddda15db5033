"""Generated gRPC and protobuf modules (from ``proto/``; regenerate with scripts/gen_protos.sh)."""
