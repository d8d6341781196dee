"""GPT-NeoX (EleutherAI's Pythia and GPT-NeoX-20B) as a tessellm model plugin, written by a
third party from tessellm's plugin docs: ``model`` holds the plugin. transformers ships the
reference implementation (``GPTNeoXForCausalLM``), so the conformance suite needs nothing else."""
