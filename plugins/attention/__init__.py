"""Built-in attention plugins. Each module registers one plugin through the `tessellm` entry-point group."""
