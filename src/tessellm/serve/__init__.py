"""``tessellm serve``: the OpenAI-compatible HTTP server (app.py), the engine thread that
batches every connection's requests (engine_thread.py), its Prometheus metrics (metrics.py)
and request schemas (schema.py). Needs the ``[serve]`` extra."""
