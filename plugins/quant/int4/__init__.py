"""Quant `int4-weight`: group-wise asymmetric 4-bit weights, dequantized inside the matmul."""
