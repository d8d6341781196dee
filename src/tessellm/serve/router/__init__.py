"""Data parallelism behind one endpoint: ``tessellm router`` (replicas started elsewhere) and
``tessellm serve --data-parallel N`` (N replicas started here), and the live A/B of ``tessellm
ab --serve`` (every request mirrored to two replicas).

config.py (what a router is given: replicas, policy), prompt.py (the text a policy routes by),
replicas.py (each replica's state and health, the policy's calls), proxy.py (forwarding a
request: retries before the first byte, an error event after it), metrics.py (/metrics of
every replica relabelled, the router's own), mirror.py (the live A/B), launcher.py (replica
processes), app.py (the FastAPI app), cli.py (the commands)."""
