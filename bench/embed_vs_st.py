"""Embedding and reranking throughput against sentence-transformers, on random-weight models of
real shapes (nothing is downloaded): ``tessellm bench --workload embed`` on each.

Models, made with transformers' own classes and saved by sentence-transformers:

- ``minilm``: all-MiniLM-L6-v2's shape (BERT, 6 layers, hidden 384, 12 heads, vocabulary
  30522), mean pooling, normalised;
- ``bge-small``: bge-small-en-v1.5's (BERT, 12 layers, hidden 384), CLS pooling, normalised;
- ``reranker``: ms-marco-MiniLM-L-6-v2's (BERT, 6 layers, hidden 384) with a one-label
  classification head, scored against sentence-transformers' CrossEncoder.

Each is a word-level tokenizer over its vocabulary (``t5``, ``t6``, ...): lengths are what the
workload draws. The figures are ratios of interleaved rounds in one process.

How to run
----------
    python bench/embed_vs_st.py --model minilm --num-texts 256 --rounds 5
    python bench/embed_vs_st.py --smoke      # small sizes: the code path only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "minilm": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12,
                   max_position_embeddings=512, vocab_size=30522),
    "bge-small": dict(hidden_size=384, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=12,
                      max_position_embeddings=512, vocab_size=30522),
}
SHAPES["reranker"] = SHAPES["minilm"]
SMOKE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, vocab_size=256)


def build(model: str, folder: Path, smoke: bool) -> Path:
    from tessellm.testing.embedding import build_sentence_transformer, build_tiny_encoder

    shape = dict(SMOKE if smoke else SHAPES[model])
    vocab = shape.pop("vocab_size")
    if model == "reranker":
        return build_tiny_encoder("bert", folder, head=True, vocab_size=vocab, weight_std=0.05, **shape)
    base = build_tiny_encoder("bert", folder / "base", vocab_size=vocab, weight_std=0.05, **shape)
    return build_sentence_transformer(base, folder / "st", pooling="cls" if model == "bge-small" else "mean")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="minilm")
    parser.add_argument("--num-texts", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--length-median", type=int, default=64)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and few texts: the code path only")
    args = parser.parse_args()
    from tessellm.cli import main as tessellm_main

    with tempfile.TemporaryDirectory() as tmp:
        folder = build(args.model, Path(tmp), args.smoke)
        argv = ["bench", "--workload", "embed", "--set", f"model={folder}", "--set", "dtype=float32",
                "--num-requests", str(8 if args.smoke else args.num_texts),
                "--workload-set", f"rounds={2 if args.smoke else args.rounds}",
                "--workload-set", f"length_median={8 if args.smoke else args.length_median}", "--no-progress"]
        return tessellm_main(argv + (["--json"] if args.json else []))


if __name__ == "__main__":
    sys.exit(main())
