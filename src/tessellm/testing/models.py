"""Tiny random-weight models that load like any Hugging Face folder, for plugin tests that
need a whole pipeline (schedulers, decoders, quantizers): a few layers of real architecture
and a word-level tokenizer over every id (``t0``, ``t1``, ...), so nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY_LLAMA: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
                                  tie_word_embeddings=True)


def build_tiny_llama(target: Path, *, seed: int = 0, vocab_size: int = 512, **shapes: Any) -> Path:
    """A random Llama of ``TINY_LLAMA``'s shapes (``shapes`` override them) saved in ``target``
    with its tokenizer; weights drawn with ``seed`` at a scale that keeps logits far from ties,
    so greedy outputs do not flip on rounding. Token 1 is BOS, 2 is EOS."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                         **{**TINY_LLAMA, **shapes})
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.15)
    finally:
        torch.random.set_rng_state(generator_state)
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a text is one token per word (t0 if unknown)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2",
                            pad_token="t0").save_pretrained(target)
    return target


def noisy_copy(source: Path, target: Path, *, scale: float = 0.03, seed: int = 5) -> Path:
    """A copy of the model folder ``source`` in ``target`` whose every weight has seeded
    Gaussian noise of std ``scale`` added: a draft model that agrees with its source only some
    of the time, so speculative verification both accepts and rejects."""
    import shutil

    from safetensors.torch import load_file, save_file

    target.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file():
            shutil.copy(f, target / f.name)
    g = torch.Generator().manual_seed(seed)
    for f in sorted(target.glob("*.safetensors")):
        state = load_file(f)
        save_file({k: v + scale * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in state.items()}, f,
                  metadata={"format": "pt"})
    return target
