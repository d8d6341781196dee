"""Helpers for testing tessellm plugins, built-in and third-party: plain-torch references
and random inputs a plugin's output can be compared against."""
