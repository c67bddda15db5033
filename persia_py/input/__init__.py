"""Reading training data: file readers, the streaming reader and its CSV parser, and
the share of a file each loader reads."""
