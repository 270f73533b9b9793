"""A study: its spec, what is searched and how it is sampled, its objectives and budget."""
