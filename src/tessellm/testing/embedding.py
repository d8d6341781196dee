"""Tiny random embedding and reranking checkpoints that load like real ones, for tests of the
pooling kind and its models: encoders (BERT, RoBERTa, XLM-RoBERTa, ModernBERT) and decoder
base models (Qwen3-Embedding's shape) made with transformers' own classes, with word-level
tokenizers that encode pairs as their families do, and wrapped as sentence-transformers
checkpoints (modules.json, 1_Pooling, Normalize, prompts) by sentence-transformers itself.
Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tessellm.testing.models import TINY_SHAPES, _save_random, save_word_tokenizer

_ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
TINY_ENCODERS: dict[str, dict[str, Any]] = {
    # BERT: segment embeddings for pairs, the exact GELU
    "bert": dict(_ENCODER, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0),
    # positions start after the padding id (1): 130 positions hold 128 tokens
    "roberta": dict(_ENCODER, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1, hidden_act="gelu_new"),
    "xlm-roberta": dict(_ENCODER, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1),
    # symmetric windows of 4 tokens each way on every other layer, their own RoPE theta
    "modernbert": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       max_position_embeddings=256, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
                       global_rope_theta=160000.0, local_rope_theta=10000.0, cls_token_id=2, sep_token_id=3),
}
"""Tiny shapes of the encoder families, each varying what its family varies."""

SPECIALS = {"roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"], "xlm-roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]}
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def save_pair_tokenizer(target: Path, vocab_size: int, model_type: str) -> None:
    """A word-level tokenizer (ids 5.. are ``t5``, ``t6``, ...) with its family's special
    tokens and pair layout: BERT's ``[CLS] a [SEP] b [SEP]`` with segment ids, RoBERTa's
    ``<s> a </s></s> b </s>`` without."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    roberta = model_type in SPECIALS
    specials = SPECIALS.get(model_type, BERT_SPECIALS)
    vocab = {word: i for i, word in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=specials[3] if roberta else "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    cls, sep = ("<s>", "</s>") if roberta else ("[CLS]", "[SEP]")
    pair = f"{cls} $A {sep} {sep} $B {sep}" if roberta else f"{cls} $A {sep} $B:1 {sep}:1"
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=pair, special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])])
    names = ["input_ids", "attention_mask"] if roberta or model_type == "modernbert" else \
        ["input_ids", "token_type_ids", "attention_mask"]
    roles = dict(zip(("bos_token", "pad_token", "eos_token", "unk_token", "mask_token"), specials)) if roberta else \
        dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), specials))
    if roberta:
        roles.update(cls_token="<s>", sep_token="</s>")
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_input_names=names, **roles).save_pretrained(target)


def build_tiny_encoder(model_type: str, target: Path, *, head: bool = False, num_labels: int = 1, seed: int = 0,
                       vocab_size: int = 256, weight_std: float = 0.1, **shapes: Any) -> Path:
    """A random ``model_type`` encoder (a key of ``TINY_ENCODERS``; ``shapes`` override),
    the bare model (what sentence-transformers saves) or, with ``head``, its
    ``*ForSequenceClassification`` with ``num_labels`` (a cross-encoder), made with
    transformers' own classes and saved in ``target`` with ``save_pair_tokenizer``'s tokenizer."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, num_labels=num_labels,
                                  **{**TINY_ENCODERS[model_type], **shapes})
    make = (lambda: AutoModelForSequenceClassification.from_config(config)) if head else \
        (lambda: AutoModel.from_config(config))
    _save_random(make, target, seed, weight_std, vocab_size, {"bias": 0.1})
    for stale in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (target / stale).unlink(missing_ok=True)
    save_pair_tokenizer(target, vocab_size, model_type)
    return target


def build_tiny_decoder_base(model_type: str, target: Path, *, seed: int = 0, vocab_size: int = 512,
                            weight_std: float = 0.15, **shapes: Any) -> Path:
    """A random decoder base model (``AutoModel``: Qwen3Model, Qwen2Model, LlamaModel; no LM
    head, names without ``model.``), as sentence-transformers saves Qwen3-Embedding, with a
    word-level tokenizer (ids ``t0``, ``t1``, ...)."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                  **{**TINY_SHAPES.get(model_type, {}), **shapes})
    return _save_random(lambda: AutoModel.from_config(config), target, seed, weight_std, vocab_size)


def build_sentence_transformer(source: Path, target: Path, *, pooling: str, normalize: bool = True,
                               prompts: dict[str, str] | None = None, default_prompt_name: str | None = None,
                               include_prompt: bool = True, dense_features: int | None = None,
                               max_seq_length: int | None = None, seed: int = 0) -> Path:
    """``source`` (a model folder) wrapped as a sentence-transformers checkpoint in ``target``
    by sentence-transformers itself: Transformer, Pooling (``pooling``: "mean", "cls",
    "lasttoken", ...), an optional Dense to ``dense_features`` (tanh, seeded weights) and
    Normalize; ``prompts`` and ``default_prompt_name`` as its config keeps them."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers 6 moved its modules; 5 keeps them in models
        from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    except ImportError:  # pragma: no cover
        from sentence_transformers.models import Dense, Normalize, Pooling, Transformer

    transformer = Transformer(str(source), max_seq_length=max_seq_length)
    width = transformer.get_embedding_dimension() if hasattr(transformer, "get_embedding_dimension") else \
        transformer.get_word_embedding_dimension()
    modules = [transformer, Pooling(width, pooling_mode=pooling, include_prompt=include_prompt)]
    if dense_features is not None:
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            modules.append(Dense(width, dense_features, activation_function=torch.nn.Tanh()))
        finally:
            torch.random.set_rng_state(generator_state)
    if normalize:
        modules.append(Normalize())
    model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts, default_prompt_name=default_prompt_name)
    model.save(str(target))
    return target


__all__ = ["TINY_ENCODERS", "build_tiny_encoder", "build_tiny_decoder_base", "build_sentence_transformer",
           "save_pair_tokenizer", "save_word_tokenizer"]
