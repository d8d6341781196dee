"""GPT-NeoX passes tessellm's model conformance suite against transformers' own GPTNeoXForCausalLM,
with the plugin's tiny checkpoint (parallel residual, a quarter of each head rotated) and with
the sequential layer and half of each head rotated."""

from tessellm.testing.conformance import ModelConformance


class TestGPTNeoX(ModelConformance):
    plugin = "gpt-neox"


class TestSequentialGPTNeoX(ModelConformance):
    plugin = "gpt-neox"
    shapes = {"gpt_neox": {"use_parallel_residual": False, "num_hidden_layers": 2,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                               "partial_rotary_factor": 0.5}}}
