"""Process plumbing every role shares: memory-allocator settings, background threads,
private (0600) files, the checks that refuse a bad configuration at start, and the exit
code that makes a config error final (a user's script's too: :mod:`.final_errors`)."""
