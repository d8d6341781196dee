"""torchrun launches for tests of distributed pipelines (tensor and pipeline parallel) on
the CPU (gloo): run ``tessellm`` or a script under N ranks, and a config file for a tiny
model; a plugin's tests can check its plugin across ranks the same way."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

SEVERAL_PIPELINES = """\
import json, sys
from tessellm import LLM

configs, params = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for index, config in enumerate(configs):
    try:
        llm = LLM(config)
    except SystemExit as stop:  # a follower serves rank 0's pipeline inside LLM(), then leaves so
        if stop.code:
            raise
        continue
    sampling = params["sampling"][index] if isinstance(params["sampling"], list) else params["sampling"]
    print(json.dumps([o.token_ids for o in llm.generate(params["prompts"], sampling)]), flush=True)
    llm.pipeline.engine.sync.stop()  # the followers go on to the next pipeline (not at exit)
"""
"""A script for ``torchrun``: build each config's pipeline in turn on every rank, generate
``params["prompts"]`` with ``params["sampling"]`` (one for all, or a list: one per config)
and print rank 0's token ids, one JSON line per config (one launch for many pipelines: launches cost seconds each)."""


def torchrun(ranks: int, *args: str, script: list[str] | None = None, env: dict | None = None,
             timeout: float = 240) -> subprocess.CompletedProcess:
    """``tessellm args...`` (or ``script``) under torchrun with ``ranks`` processes on this
    machine, one thread each; its output captured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           *(script or ["-m", "tessellm"]), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def run_several_pipelines(ranks: int, configs: list[dict[str, Any]], params: dict[str, Any], folder: Path,
                          timeout: float = 400) -> subprocess.CompletedProcess:
    """``SEVERAL_PIPELINES`` over ``configs`` under ``ranks`` processes (script in ``folder``)."""
    script = folder / "several_pipelines.py"
    script.write_text(SEVERAL_PIPELINES)
    return torchrun(ranks, json.dumps(configs), json.dumps(params), script=[str(script)], timeout=timeout)


PROMPTS = ["t5 t6 t7", "t100 t3", "t9 t9 t9 t9 t41"]
"""Prompts for the tiny models' word tokenizer (tessellm.testing.models)."""


def generate_args(config: Path, *extra: str, prompts: list[str] = PROMPTS) -> list[str]:
    """``tessellm generate`` arguments: 12 greedy-or-configured tokens per prompt, EOS ignored,
    as JSON lines."""
    return ["generate", "--config", str(config), "--max-tokens", "12", "--ignore-eos", "--json", *extra, *prompts]


def one_rank(config: Path, capsys: Any, *extra: str) -> list[list[int]]:
    """The token ids ``tessellm generate`` gives in this process (``capsys``: pytest's)."""
    from tessellm.cli import main

    assert main(generate_args(config, *extra)) == 0
    return token_ids(capsys.readouterr().out)


def token_ids(stdout: str) -> list[list[int]]:
    """The token ids of ``tessellm generate --json``'s lines."""
    return [json.loads(line)["token_ids"] for line in stdout.strip().splitlines()]


def write_config(path: Path, model: Path, dtype: str = "float64", **extra: Any) -> Path:
    """A CPU pipeline config for ``model`` in ``path`` (paged cache of 64 blocks of 8,
    continuous scheduler, a 30 s collective timeout; ``extra`` fields on top)."""
    config = {"model": str(model), "device": "cpu", "dtype": dtype, "max_model_len": 128,
              "cache": {"name": "paged", "options": {"block_size": 8, "num_blocks": 64}},
              "scheduler": {"name": "continuous"}, "parallel": {"timeout_s": 30}, **extra}
    path.write_text(json.dumps(config))
    return path
