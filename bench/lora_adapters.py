"""Random PEFT LoRA adapters for a model folder, for the LoRA benchmarks (docs/benchmarks.md,
"LoRA adapters"): ``--count`` adapters of rank ``--rank`` on every attention and MLP
projection, each in its own folder under ``--out`` (adapter_config.json and
adapter_model.safetensors, made with PEFT's own classes).

    python bench/lora_adapters.py --out /tmp/smollm2-loras --count 4 --rank 16

prints the ``lora.adapters`` mapping as JSON (for a config file or ``--set``). The default
model is the embedded SmolLM2 (its converted folder)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tessellm.core.model.loader import model_folder, resolve_model
from tessellm.testing.lora import build_tiny_lora

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a model name or Hugging Face folder")
    parser.add_argument("--out", required=True, help="folder to write the adapters into")
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--std", type=float, default=0.02, help="std of the random A and B entries")
    args = parser.parse_args()
    base = model_folder(resolve_model(args.model))
    adapters = {}
    for i in range(args.count):
        folder = Path(args.out) / f"lora{i}"
        build_tiny_lora(base, folder, rank=args.rank, alpha=2 * args.rank, seed=i, target_modules=TARGETS,
                        std=args.std)
        adapters[f"lora{i}"] = str(folder)
    print(json.dumps(adapters))


if __name__ == "__main__":
    main()
