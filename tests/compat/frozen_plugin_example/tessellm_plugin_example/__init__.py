"""An example tessellm plugin package: see attention.py."""
