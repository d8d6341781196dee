"""tessellm's core: the five plugin interfaces, the registry, config, model runner and engine."""
