"""The quantizers' own CPU kernels (C++, built at first use with this machine's compiler).

int8_dot.cpp: int8 activations times int4 or int8 weights, summed in int32 by the CPU's
integer dot-product instructions (AVX2, AVX-VNNI or AVX-512 VNNI, chosen by CPUID when the
library loads). ``kernels()`` builds and loads it once per process and returns its ops
(``torch.ops.tessellm_cpu``), or None, with one log line, where it cannot be had (no C++
compiler, a non-x86 CPU, a CPU without AVX2): callers then keep torch's kernels.
int8_dot.py holds the Python side: the float64 reference of the same arithmetic and the
wrappers the quantized linears call.
"""
