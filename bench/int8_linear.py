"""int8 linears: each path of `int8-weight` and `w8a8` against the float linear, per layer.

On the CPU (``--device cpu``, float32, SmolLM2-135M's shapes by default) it times float32
``F.linear`` against int8 weights with one scale per output channel through (a) the
``torch.compile``'d multiply-and-sum that dequantizes inside the reduction (``int8-weight``'s
few-rows path), (b) dequantizing one tile of output channels at a time before the BLAS (its
many-rows path), (c) `w8a8`'s int8 x int8 product (``torch._int_mm``, activations quantized
per token inside the timing), (d) torch's ``_weight_int8pack_mm``, (e) an eager dequantize to
a whole float copy then ``F.linear`` (what the plugin must not do per step). On CUDA
(``--device cuda``, bfloat16, Llama-3.2-1B's shapes by default) it times bf16 ``F.linear``
against the Triton kernel, the tiled path and `w8a8`'s path (``torch._int_mm`` above 16
rows, the Triton kernel at or below).

``--low-bit`` adds `int4-weight` at groups of 32 and 128 (the Triton kernel on CUDA; on the CPU
torch's int4 kernel, bfloat16 inside, and the tiled path) and `fp8` per channel, both ways
(`fp8`: dequantized tiles before the BLAS; `fp8_scaled_mm`: activations quantized to e4m3 per
row, then `torch._scaled_mm`, the FP8 tensor cores on a GPU of compute capability 8.9+).

Each timing runs ``--layers`` distinct copies of the weight one after another, as a forward
runs its layers, so the weights stream from memory rather than sit in a cache (one SmolLM2
layer fits in a CPU's L2/L3; thirty do not). Prints one row per shape and batch with each
path's median time per layer and its speed-up over the float linear.

    python bench/int8_linear.py [--device cpu|cuda] [--model smollm2|llama-3.2-1b]
        [--threads 1] [--batches 1,16,64] [--layers 30] [--low-bit] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn.functional as F

MODELS = {  # (out_features, in_features) of each linear of one decoder layer, and lm_head
    "smollm2": {"qkv": (576 + 2 * 192, 576), "o": (576, 576), "gate_up": (2 * 1536, 576), "down": (576, 1536)},
    "llama-3.2-1b": {"qkv": (2048 + 2 * 512, 2048), "o": (2048, 2048), "gate_up": (2 * 8192, 2048),
                     "down": (2048, 8192), "lm_head": (128256, 2048)},
}


def median_ms(fn, device: torch.device, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def paths(device: torch.device) -> dict:
    """name -> fn(x, weight, q, scale) of every path timed on this device."""
    from tessellm.plugins.quant.int8.cpu import int8_weight_matmul, tiled_matmul
    from tessellm.plugins.quant.int8.w8a8 import w8a8_matmul

    if device.type == "cuda":
        from tessellm.plugins.quant.int8.triton_matmul import triton_int8_weight_matmul

        def w8a8(x, w, q, s):  # torch._int_mm on CUDA takes more than 16 rows only
            return w8a8_matmul(x, q, s) if x.shape[0] > 16 else triton_int8_weight_matmul(x, q, s)

        return {"triton": lambda x, w, q, s: triton_int8_weight_matmul(x, q, s),
                "tiled": lambda x, w, q, s: tiled_matmul(x, q, s), "w8a8": w8a8}

    def int8pack(x, w, q, s):
        return torch._weight_int8pack_mm(x, q, s)

    return {"compiled": lambda x, w, q, s: int8_weight_matmul(x, q, s),
            "tiled": lambda x, w, q, s: tiled_matmul(x, q, s),
            "w8a8": lambda x, w, q, s: w8a8_matmul(x, q, s),
            "int8pack": int8pack,
            "copy": lambda x, w, q, s: F.linear(x, (q.to(x.dtype) * s[:, None].to(x.dtype)))}


def low_bit_layers(weight: torch.Tensor, device: torch.device) -> dict:
    """name -> fn(x) of each low-bit form of ``weight`` timed on this device (--low-bit)."""
    from tessellm.plugins.quant.fp8.linear import Fp8Linear, quantize_fp8
    from tessellm.plugins.quant.int4 import cpu as int4_cpu
    from tessellm.plugins.quant.int4.quantize import quantize_int4

    fp8 = quantize_fp8(weight, "channel")
    forms = {"fp8": Fp8Linear(*fp8, None, None),  # weights dequantized inside the matmul
             "fp8_scaled_mm": Fp8Linear(*fp8, None, None, use_scaled_mm=True)}  # e4m3 activations too
    for group in (32, 128):
        int4 = quantize_int4(weight, group)
        if device.type == "cuda":
            from tessellm.plugins.quant.int4.triton_matmul import triton_int4_weight_matmul

            forms[f"int4_g{group}"] = lambda x, w=int4: triton_int4_weight_matmul(x, w.packed, w.scale, w.offset,
                                                                                 w.group_size)
        else:
            pack = int4_cpu.to_int4pack(int4)
            forms[f"int4_g{group}"] = lambda x, p=pack: int4_cpu.int4pack_matmul(x, p)
            forms[f"int4_g{group}_tiled"] = lambda x, w=int4: int4_cpu.tiled_matmul(x, w)
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default=None, choices=sorted(MODELS),
                        help="whose shapes (default: smollm2 on cpu, llama-3.2-1b on cuda)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--batches", default="1,16,64", help="token rows per matmul (default 1,16,64)")
    parser.add_argument("--layers", type=int, default=None, help="distinct weight copies per timing (default 30 "
                        "on cpu, 8 on cuda)")
    parser.add_argument("--low-bit", action="store_true", help="time int4-weight and fp8 too")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = args.model or ("llama-3.2-1b" if device.type == "cuda" else "smollm2")
    layers = args.layers or (8 if device.type == "cuda" else 30)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from tessellm.plugins.quant.int8.quantize import quantize_per_channel

    timed = paths(device)
    rows = []
    for name, (n, k) in MODELS[model].items():
        count = 1 if name == "lm_head" else layers
        weights = [(torch.randn(n, k, device=device) * 0.05).to(dtype) for _ in range(count)]
        quantized = [quantize_per_channel(w, group_size=None) for w in weights]
        low_bit = [low_bit_layers(w, device) for w in weights] if args.low_bit else None
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device=device, dtype=dtype)

            def per_layer(fn) -> float:
                return median_ms(lambda: [fn(x, weights[i], *quantized[i]) for i in range(count)], device) / count

            row = {"shape": name, "n": n, "k": k, "m": m, "float_ms": per_layer(lambda x, w, q, s: F.linear(x, w))}
            for path in low_bit[0] if low_bit else ():
                row[f"{path}_ms"] = median_ms(lambda: [low_bit[i][path](x) for i in range(count)], device) / count
            for path, fn in timed.items():
                try:
                    row[f"{path}_ms"] = per_layer(fn)
                except (RuntimeError, AttributeError) as exc:  # e.g. an op not built for this CPU
                    row[f"{path}_ms"] = None
                    row[f"{path}_error"] = str(exc).splitlines()[0]
            rows.append(row)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            (platform.processor() or platform.machine()), "dtype": str(dtype), "model": model,
            "torch": torch.__version__, "threads": args.threads, "layers": layers, "date": time.strftime("%Y-%m-%d")}
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
        return
    print(f"# {meta}")
    names = [key[:-3] for key in rows[0] if key.endswith("_ms") and key != "float_ms"]
    print(f"{'shape':>8} {'m':>3}  {'float':>8}" + "".join(f"  {p:>8} {'x':>5}" for p in names))
    for r in rows:
        cells = ""
        for p in names:
            value = r.get(f"{p}_ms")
            cells += f"  {'-':>8} {'-':>5}" if value is None else f"  {value:8.3f} {r['float_ms'] / value:5.2f}"
        print(f"{r['shape']:>8} {r['m']:>3}  {r['float_ms']:8.3f}{cells}")


if __name__ == "__main__":
    main()
