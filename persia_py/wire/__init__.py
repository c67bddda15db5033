"""What crosses the network: the array codec, gRPC channels and servers with their
limits and deadlines, the raw-bytes methods, and authentication (tokens, TLS)."""
