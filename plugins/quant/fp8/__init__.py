"""Quant `fp8`: float8 (e4m3) weights with tensor, channel or block scales, dequantized in the matmul."""
