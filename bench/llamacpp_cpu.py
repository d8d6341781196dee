"""llama.cpp on the embedded SmolLM2 GGUF (Q4_1), batch-1 decode on the CPU, measured the way
bench/int4_cpu.py measures tessellm: the same 9-token prompt, then 64 greedy tokens (EOS not
checked), best of ``--repeats``, ``--threads`` threads. With ``--serve`` it loads the model,
prints its header line, then for each number N read from stdin decodes N tokens and prints
the seconds it took (bench/cpu_vs_llamacpp.py interleaves it with tessellm's variants so).

It runs in a virtual environment of its own with llama-cpp-python (the package registry has
it as source only). Built without AVX-512 and AMX (the native build uses AMX, which crashes on
multi-token prompts in these VMs), about 8 minutes on 2 cores:

    python3 -m venv /tmp/llamacpp/venv
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
      -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" /tmp/llamacpp/venv/bin/pip install llama-cpp-python
    /tmp/llamacpp/venv/bin/python bench/llamacpp_cpu.py --gguf \\
      "$(.venv/bin/python -c 'from tessellm.core.model.loader import resolve_model; print(resolve_model("smollm2-135m"))')"
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import datetime, timezone

PROMPT = [1, 504, 3458, 314, 260, 1345, 282, 4193, 30]  # bench/int4_cpu.py's


def cpu_model() -> str:
    """The CPU's model name (this venv has no tessellm to ask)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.machine())
    except OSError:
        return platform.machine()


def decode_seconds(llm, new_tokens: int) -> float:
    """Seconds for the prompt and ``new_tokens`` greedy steps."""
    llm.reset()
    start = time.perf_counter()
    llm.eval(PROMPT)
    for _ in range(new_tokens):
        llm.eval([llm.sample(temp=0.0)])
    return time.perf_counter() - start


def decode_tok_s(llm, new_tokens: int) -> float:
    """``decode_seconds`` as tokens per second of output."""
    return new_tokens / decode_seconds(llm, new_tokens)


def serve(llm, header: str) -> None:
    """The header, then one decode per number on stdin, its seconds on stdout."""
    print(header, flush=True)
    for line in sys.stdin:
        print(decode_seconds(llm, int(line)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="the GGUF file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help="decode once per number read from stdin")
    args = ap.parse_args()
    import llama_cpp

    llm = llama_cpp.Llama(model_path=args.gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=512,
                          verbose=False)
    decode_tok_s(llm, 8)  # warm-up
    header = (f"# {datetime.now(timezone.utc).isoformat(timespec='seconds')} {cpu_model()}, "
              f"{args.threads} threads, llama-cpp-python {llama_cpp.__version__}")
    if args.serve:
        return serve(llm, header)
    best = max(decode_tok_s(llm, 64) for _ in range(args.repeats))
    print(header)
    print(f"llama.cpp {args.gguf.rsplit('/', 1)[-1]}: {best:.1f} tok/s")


if __name__ == "__main__":
    main()
