"""tessellm's core: the plugin interfaces, the registry, config, model runner and engine."""
