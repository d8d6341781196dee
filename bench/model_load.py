"""Time to load the embedded model: the one-time GGUF conversion, then a pipeline built from
the cached safetensors. Run with an empty cache to see the first-time cost:

    TESSELLM_CACHE_DIR=$(mktemp -d) .venv/bin/python bench/model_load.py
"""

from __future__ import annotations

import time

from tessellm import LLM
from tessellm.core.model.loader import model_folder, resolve_model


def main() -> None:
    start = time.perf_counter()
    model_folder(resolve_model("smollm2-135m"))  # converts only if the cache lacks it
    conversion = time.perf_counter() - start
    start = time.perf_counter()
    LLM({"device": "cpu"})
    print(f"conversion (or cache lookup) {conversion:.1f} s; pipeline load from the cache "
          f"{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
