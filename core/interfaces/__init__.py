"""The plugin interfaces, one module per kind (attention, cache, scheduler, decoder,
quantizer), and the data they exchange: sequences (sequence.py), batch metadata (batch.py),
KV layouts and storage (kv.py). Plugin authors import these names from ``tessellm``."""
