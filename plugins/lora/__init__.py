"""Batched LoRA kernels: the torch reference (rows grouped by adapter, then matmuls) and
Triton segmented shrink/expand (Punica's SGMV) on CUDA."""
