"""Built-in grammar backends. Each module registers one plugin through the `tessellm` entry-point group."""
