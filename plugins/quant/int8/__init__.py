"""Quant plugins with int8 weights."""
