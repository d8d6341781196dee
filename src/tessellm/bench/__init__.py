"""``tessellm bench`` and ``tessellm ab``: offline and serving benchmarks (offline.py,
serving.py) over named workloads (workloads.py), A/B tests of two pipelines (ab.py), the
transformers baseline (hf_baseline.py) and plots (plots.py, the ``[bench]`` extra)."""
