"""Process plumbing every role shares: memory-allocator settings, background threads,
private (0600) files, and the checks that refuse a bad configuration at start."""
