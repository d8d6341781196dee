"""Every built-in model plugin passes the model conformance suite, on every model type it
declares (tiny random checkpoints built with transformers' own classes)."""

from tessellm.testing.conformance import ModelConformance


class TestLlama(ModelConformance):
    plugin = "llama"  # llama, mistral (sliding window 8), qwen2 (q/k/v biases)


class TestQwen3(ModelConformance):
    plugin = "qwen3"  # qwen3 (per-head q/k norms), qwen3_moe


class TestQwen2Moe(ModelConformance):
    plugin = "qwen2-moe"


class TestMixtral(ModelConformance):
    plugin = "mixtral"


class TestDeepseek(ModelConformance):
    plugin = "deepseek"  # deepseek_v2, deepseek_v3 (MLA through the mla attention backend)
