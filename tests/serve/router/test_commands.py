"""The data-parallel commands' refusals, each one line and exit status 2 before anything
starts (an unknown policy or option, --data-parallel below 1, tensor or pipeline parallelism
inside a replica, a live A/B given one config), and a replica that cannot start: the error
names it and shows its last output, and no replica process is left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tessellm.cli import main


@pytest.mark.parametrize("argv, message", [
    (["router", "--replica", "http://127.0.0.1:9", "--policy", "fastest"],
     "unknown routing policy 'fastest'; valid choices: least-load, prefix-aware, round-robin"),
    (["router", "--replica", "http://127.0.0.1:9", "--policy-option", "block_chars=0"],
     "invalid for routing policy 'prefix-aware': block_chars"),
    (["router", "--replica", "127.0.0.1:9"], "must start with http:// or https://"),
    (["serve", "--data-parallel", "0"], "--data-parallel must be at least 1"),
    (["serve", "--data-parallel", "2", "--set", "parallel.tensor=2"],
     "parallel.tensor > 1 needs torchrun per replica"),
    (["serve", "--data-parallel", "2", "--policy", "fastest"], "unknown routing policy 'fastest'"),
    (["ab", "--serve", "only-one.yaml"], "give exactly two config files"),
])
def test_a_bad_command_is_one_line_and_starts_nothing(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessellm: error:") and message in err[0], err


def test_a_replica_that_cannot_start_is_named_with_its_output(tmp_path):
    """Two replicas of a model folder that does not exist: the command stops with the first
    replica's exit, its last lines shown, and stops the other."""
    missing = tmp_path / "no-such-model"
    done = subprocess.run([sys.executable, "-m", "tessellm", "serve", "--data-parallel", "2", "--set",
                           f"model={missing}", "--port", "9"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    error = [line for line in done.stderr.splitlines() if line.startswith("tessellm: error:")]
    assert len(error) == 1 and "replica" in error[0] and "exited with status 2 while starting" in error[0], \
        done.stderr[-3000:]
    tail = done.stderr[done.stderr.index("its last output:"):]
    assert str(missing) in tail  # the replica's own error, about the model it could not find
