"""``tessellm plugins --check KIND:NAME``: a built-in passes with a table of its properties;
each deliberately broken plugin (tests/conformance/broken_*.py, installed as a real
distribution) fails, with the property it breaks named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tessellm.cli import main

HERE = Path(__file__).resolve().parent

BROKEN = {  # module -> (KIND:NAME, the property the check must name as failed)
    "broken_attention": ("attention:broken-scale", "test_batches_match_the_reference"),
    "broken_cache": ("cache:broken-fork", "test_a_fork_child_never_writes_into_its_parent"),
    # --examples 5 runs 5 of the 8 sampling cases (spread over the list): two of them set top_p
    "broken_decoding": ("decoding:broken-top-p", "test_sampling_follows_the_target_distribution[top_k=5,top_p=0.8]"),
    "broken_model": ("model:broken-mixtral", "test_prefill_logits_match_the_reference_in_float64[mixtral]"),
}


def install(tmp_path: Path, module: str, target: str) -> dict[str, str]:
    """An environment in which ``module`` (a file beside this one) is an installed plugin
    distribution whose entry point is ``target``'s KIND.NAME."""
    kind, name = target.split(":")
    info = tmp_path / f"tessellm_{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tessellm-{module.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[tessellm]\n{kind}.{name} = {module}\n")
    path = os.pathsep.join([str(tmp_path), str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "TRITON_INTERPRET": "1"}


def test_a_builtin_passes_with_its_table(capsys):
    assert main(["plugins", "--check", "attention:sdpa", "--examples", "3"]) == 0
    out = capsys.readouterr().out
    assert "test_batches_match_the_reference[chunked]" in out and "test_head_dims[80]" in out
    assert "attention plugin 'sdpa' passes" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("test_")]
    assert rows and all(0 < int(row[1]) <= 3 and row[2].startswith("pass") for row in rows)
    assert out.startswith("property"), "pytest's own output came before the table"


WIDER = {"broken_cache", "broken_decoding", "broken_model"}
"""Broken plugins whose suites their kinds' built-in conformance classes exercise too (and
broken_cache, which the shrunk-case test below fails by its property): make test-all."""


@pytest.mark.parametrize("module", [pytest.param(m, marks=pytest.mark.extended) if m in WIDER else m
                                    for m in sorted(BROKEN)])
def test_a_broken_plugin_fails_with_the_property_named(tmp_path, module):
    if not (HERE / f"{module}.py").exists():
        pytest.skip(f"{module}.py is not written yet")
    target, prop = BROKEN[module]
    env = install(tmp_path, module, target)
    done = subprocess.run([sys.executable, "-m", "tessellm", "plugins", "--check", target, "--examples", "5"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    assert failed and any(prop in line for line in failed), done.stdout
    assert f"{target.split(':')[0]} plugin {target.split(':')[1]!r} fails" in done.stdout


def test_bad_check_arguments_are_one_line_errors(capsys):
    assert main(["plugins", "--check", "attention"]) == 2
    assert main(["plugins", "--check", "attention:sdpa", "--options", "[1]"]) == 2
    err = capsys.readouterr().err
    assert err.count("tessellm: error:") == 2 and "KIND:NAME" in err and "JSON object" in err


def test_checks_in_one_process_each_run_their_own_suite():
    from tessellm.testing.conformance.check import run_check

    first = run_check("attention", "sdpa", examples=2)
    second = run_check("quant", "none", examples=2)
    assert first.ok and second.ok
    assert {r.name for r in second.results} == {"test_forward_error_within_the_declared_bound",
                                                  "test_linears_keep_their_names_and_shapes",
                                                  "test_linears_equal_the_reference_of_their_own_arithmetic"}


def test_examples_bound_every_property_parametrized_ones_included(capsys):
    assert main(["plugins", "--check", "grammar:xgrammar", "--examples", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("test_")]
    assert rows and all(int(row[1]) <= 2 for row in rows), out
    per_property: dict[str, int] = {}
    for row in rows:
        per_property[row[0].split("[")[0]] = per_property.get(row[0].split("[")[0], 0) + 1
    assert max(per_property.values()) == 2, per_property
    assert "parameter sets run (--examples): test_random_walks_match_the_spec 2 of 6" in out


def test_a_failure_is_its_reason_and_shrunk_case_and_verbose_adds_the_traceback(monkeypatch, capsys):
    from tessellm.core import registry as registry_module
    from tessellm.core.registry import PluginRegistry

    from . import broken_cache

    monkeypatch.setattr(registry_module, "_default", PluginRegistry(modules=[broken_cache]))
    assert main(["plugins", "--check", "cache:broken-fork", "--examples", "2"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("property") and "Traceback" not in out and "test session starts" not in out, out
    detail = out[out.index("FAILED test_a_fork_child_never_writes_into_its_parent:"):].splitlines()
    assert detail[1].strip().startswith("AssertionError: cache plugin 'broken-fork'")
    assert detail[2].strip().startswith("shrunk case: run(n=") and detail[2].strip().endswith(")")
    assert main(["plugins", "--check", "cache:broken-fork", "--examples", "2", "--verbose"]) == 1
    out = capsys.readouterr().out
    assert "test session starts" in out and "def run(n: int, rewrite: int, seed: int)" in out


def test_a_plugin_that_does_not_load_is_one_line_and_runs_nothing(tmp_path):
    env = install(tmp_path, "tessellm_module_that_is_not_there", "cache:gone")
    done = subprocess.run([sys.executable, "-m", "tessellm", "plugins", "--check", "cache:gone"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("\n") == 1 and "test_" not in done.stdout, done.stdout
    assert done.stdout.startswith("cache plugin 'gone' cannot be checked: ") and "No module named" in done.stdout
