"""Built-in plugins, one sub-package per kind."""
