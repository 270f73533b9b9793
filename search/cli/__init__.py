"""The `hpsearch` command line and its commands."""
