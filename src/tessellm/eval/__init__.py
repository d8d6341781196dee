"""``tessellm eval``: quality of a pipeline, by config.

- perplexity.py: sliding-window perplexity of a text (bundled public-domain texts in texts/)
- passkey.py: passkey retrieval accuracy at a given context length
- lm_eval_adapter.py: the ``tessellm`` model for lm-evaluation-harness (the ``[eval]`` extra)
"""
