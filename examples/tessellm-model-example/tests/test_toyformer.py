"""Toyformer passes tessellm's model conformance suite: logits and greedy tokens equal its
transformers implementation's, through every part of the default pipeline."""

from tessellm.testing.conformance import ModelConformance


class TestToyformer(ModelConformance):
    plugin = "toyformer"
    shapes = {"toyformer": {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 1}}
