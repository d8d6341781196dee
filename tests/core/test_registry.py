"""The plugin registry: built-in and out-of-tree plugins load through the ``tessellm``
entry-point group; broken, conflicting or mis-versioned plugins are reported, not fatal
(except a conflict, which names both packages); ``tessellm plugins --json`` lists them.

Out-of-tree plugins are real distributions: a ``<name>-1.0.dist-info`` folder with METADATA
and entry_points.txt plus the plugin module, written to tmp_path and put on sys.path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import tessellm
from tessellm.core import registry as registry_module
from tessellm.core.interfaces.attention import AttentionBackend
from tessellm.core.errors import PluginConflictError
from tessellm.core.plugin import KINDS
from tessellm.core.registry import DISABLE_ENV, ENTRY_POINT_GROUP, PluginRegistry
from tessellm.core.version import PLUGIN_API_VERSION, __version__

BUILTINS = {
    "attention": ["sdpa"],
    "cache": ["contiguous"],
    "scheduler": ["static"],
    "decoding": ["greedy", "sample"],
    "quant": ["none"],
    "model": ["llama", "qwen3", "qwen2-moe", "mixtral", "deepseek"],
    "logits": ["min_tokens", "logit_bias"],
    "lora": ["torch", "triton"],
}
BUILTIN_ENTRY_POINTS = [f"{kind}.{name}" for kind, names in BUILTINS.items() for name in names]
MODULE_PREFIX = "tessellm_testplug_"  # every module this file writes to disk starts with this


# ---------------------------------------------------------------------------- helpers


def plugin_source(name: str, *, kind: str = "attention", api_version: str | None = "1.0",
                  hook: str | None = None, extra: str = "") -> str:
    """Source of a plugin module registering one trivial plugin class of ``kind``."""
    base = {"attention": ("tessellm", "AttentionBackend"),
            "cache": ("tessellm", "CacheManager"),
            "scheduler": ("tessellm", "Scheduler"),
            "decoding": ("tessellm", "Decoder"),
            "quant": ("tessellm", "Quantizer"),
            "grammar": ("tessellm", "GrammarBackend"),
            "model": ("tessellm", "ModelArchitecture"),
            "logits": ("tessellm", "LogitsProcessor"),
            "lora": ("tessellm", "LoraKernel"),
            "routing": ("tessellm", "RoutingPolicy")}[kind]
    version_line = "" if api_version is None else f"api_version = {api_version!r}"
    return textwrap.dedent(f"""\
        import tessellm
        from {base[0]} import {base[1]}

        class FakePlugin({base[1]}):
            \"\"\"A fake {kind} plugin for the registry tests.\"\"\"
            name = {name!r}
            {version_line}
            description = "fake {kind} plugin {name}"
            auto_priority = None
            {"spec = build = lambda self, arg: None  # what a model plugin must implement" if kind == "model" else ""}
            {"apply = lambda self, logits, rows: None  # what a logits processor must implement" if kind == "logits" else ""}
            {"choose = lambda self, request, replicas: replicas[0].index  # a routing policy's" if kind == "routing" else ""}

        @tessellm.hookimpl
        def {hook or "register_" + kind}(register):
            register(FakePlugin)
        """) + extra


@pytest.fixture
def fake_dist(tmp_path, monkeypatch):
    """Factory: ``fake_dist("fakepkg", {"attention.fake": ("tessellm_testplug_x", source)})``
    writes a real installed distribution with ``[tessellm]`` entry points and its modules
    into tmp_path (on sys.path). Modules it imports are removed from sys.modules afterwards."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    before = set(sys.modules)

    def make(dist: str, entry_points: dict[str, tuple[str, str]]) -> Path:
        info = root / f"{dist}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        lines = [f"[{ENTRY_POINT_GROUP}]"]
        for ep_name, (module, source) in entry_points.items():
            assert module.startswith(MODULE_PREFIX)
            (root / f"{module}.py").write_text(source)
            lines.append(f"{ep_name} = {module}")
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        return root

    yield make
    for name in set(sys.modules) - before:
        if name.startswith(MODULE_PREFIX):
            del sys.modules[name]


def module_with(name: str, *hooks) -> types.ModuleType:
    """A module-like object holding the given hookimpl functions."""
    module = types.ModuleType(name)
    for fn in hooks:
        setattr(module, fn.__name__, fn)
    return module


def attention_class(name: str | None, api_version=PLUGIN_API_VERSION, *, version_attr: bool = True):
    ns = {"description": f"throwaway {name}", "forward": lambda self, *a: None}
    if name is not None:
        ns["name"] = name
    if version_attr:
        ns["api_version"] = api_version
    return type(f"Throwaway_{name}", (AttentionBackend,), ns)


def registering(cls, kind: str = "attention"):
    """A hookimpl function named register_<kind> that registers ``cls``."""
    def hook(register):
        register(cls)

    hook.__name__ = f"register_{kind}"
    return tessellm.hookimpl(hook)


def empty_registry() -> PluginRegistry:
    return PluginRegistry(entry_points=False)


# ---------------------------------------------------------------------------- built-ins


def test_builtin_plugins_load_through_entry_points():
    registry = PluginRegistry()
    assert registry.failures == []
    for kind, names in BUILTINS.items():
        for name in names:
            entry = registry.get(kind, name)
            assert entry is not None, f"{kind}.{name} missing; have {registry.names(kind)}"
            assert entry.package == "tessellm"
            assert entry.kind == kind and entry.name == name
            assert entry.cls.api_version == PLUGIN_API_VERSION


def test_builtins_are_declared_as_entry_points_not_hardcoded():
    """The registry finds built-ins only through the entry-point group, like third-party
    plugins: without entry points it is empty."""
    import importlib.metadata

    declared = {ep.name for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
                if ep.dist is not None and ep.dist.name == "tessellm"}
    assert set(BUILTIN_ENTRY_POINTS) <= declared
    registry = empty_registry()
    assert all(registry.names(kind) == [] for kind in KINDS)
    assert registry.failures == []


def test_entries_describe_and_auto_order():
    registry = PluginRegistry()
    entries = registry.entries()
    assert [(e.kind, e.name) for e in entries] == sorted(
        [(e.kind, e.name) for e in entries], key=lambda kn: (KINDS.index(kn[0]), kn[1]))
    for entry in entries:
        described = entry.describe()
        assert {"kind", "name", "package", "description", "api_version", "auto_priority", "options"} <= set(described)
        json.dumps(described)
    sample = registry.get("decoding", "sample").describe()
    assert sample["package"] == "tessellm" and sample["description"]
    # decoding.sample (priority 10) ranks before decoding.greedy (priority 5)
    order = [e.name for e in registry.auto_order("decoding")]
    assert order.index("sample") < order.index("greedy")
    for kind in KINDS:
        priorities = [e.cls.auto_priority for e in registry.auto_order(kind)]
        assert None not in priorities and priorities == sorted(priorities, reverse=True)


# ---------------------------------------------------------------------------- out of tree


def test_out_of_tree_plugin_loads_from_a_real_entry_point(fake_dist):
    fake_dist("fakepkg", {"attention.fake": (MODULE_PREFIX + "fake", plugin_source("fake"))})
    registry = PluginRegistry()
    assert registry.failures == []
    entry = registry.get("attention", "fake")
    assert entry is not None
    assert entry.package == "fakepkg"
    assert entry.describe()["package"] == "fakepkg"
    assert entry.describe()["description"] == "fake attention plugin fake"
    # built-ins are untouched
    assert registry.get("attention", "sdpa").package == "tessellm"


def test_out_of_tree_plugin_of_every_kind(fake_dist):
    fake_dist("fakepkg", {f"{kind}.fake": (f"{MODULE_PREFIX}{kind}", plugin_source(f"fake_{kind}", kind=kind))
                          for kind in KINDS})
    registry = PluginRegistry()
    assert registry.failures == []
    for kind in KINDS:
        assert registry.get(kind, f"fake_{kind}").package == "fakepkg"


def test_plugin_raising_on_import_is_recorded_and_others_still_load(fake_dist):
    fake_dist("brokenpkg", {
        "attention.broken": (MODULE_PREFIX + "broken", "raise RuntimeError('boom: cannot find libfoo.so')\n"),
    })
    fake_dist("fakepkg", {"attention.fake": (MODULE_PREFIX + "fake", plugin_source("fake"))})
    registry = PluginRegistry()
    assert len(registry.failures) == 1
    failure = registry.failures[0]
    assert failure.package == "brokenpkg"
    assert failure.source == "attention.broken"
    assert "RuntimeError" in failure.error and "boom: cannot find libfoo.so" in failure.error
    assert "brokenpkg" in str(failure) and "boom" in str(failure)
    # every other plugin still loads, the built-ins and the other out-of-tree one
    for kind, names in BUILTINS.items():
        assert set(names) <= set(registry.names(kind))
    assert registry.get("attention", "fake").package == "fakepkg"
    assert registry.failures_for("attention", "broken") == [failure]


def test_plugin_with_import_error_of_missing_dependency(fake_dist):
    fake_dist("fakepkg", {"attention.needsdep": (MODULE_PREFIX + "needsdep",
                                                 "import tessellm_no_such_module_xyz\n")})
    registry = PluginRegistry()
    [failure] = registry.failures
    assert failure.package == "fakepkg"
    assert "ModuleNotFoundError" in failure.error and "tessellm_no_such_module_xyz" in failure.error
    assert registry.get("attention", "sdpa") is not None


# ---------------------------------------------------------------------------- conflicts


def test_two_packages_with_same_kind_and_name_conflict(fake_dist):
    fake_dist("fakepkg", {"fake_dup": (MODULE_PREFIX + "dup_a", plugin_source("dup"))})
    fake_dist("otherpkg", {"other_dup": (MODULE_PREFIX + "dup_b", plugin_source("dup"))})
    with pytest.raises(PluginConflictError) as info:
        PluginRegistry()
    message = str(info.value)
    assert "fakepkg" in message and "otherpkg" in message
    assert "'dup'" in message and "attention" in message
    assert "\n" not in message


def test_conflict_when_both_packages_use_the_conventional_entry_point_name(fake_dist):
    fake_dist("fakepkg", {"attention.dup": (MODULE_PREFIX + "dup_a", plugin_source("dup"))})
    fake_dist("otherpkg", {"attention.dup": (MODULE_PREFIX + "dup_b", plugin_source("dup"))})
    with pytest.raises(PluginConflictError) as info:
        PluginRegistry()
    assert "fakepkg" in str(info.value) and "otherpkg" in str(info.value)


def test_same_entry_point_name_in_two_packages_is_no_conflict(fake_dist):
    fake_dist("fakepkg", {"plugins": (MODULE_PREFIX + "ep_a", plugin_source("alpha"))})
    fake_dist("otherpkg", {"plugins": (MODULE_PREFIX + "ep_b", plugin_source("beta"))})
    registry = PluginRegistry()
    assert registry.failures == []
    assert registry.get("attention", "alpha").package == "fakepkg"
    assert registry.get("attention", "beta").package == "otherpkg"


def test_out_of_tree_plugin_shadowing_a_builtin_conflicts(fake_dist):
    fake_dist("fakepkg", {"attention.mysdpa": (MODULE_PREFIX + "shadow", plugin_source("sdpa"))})
    with pytest.raises(PluginConflictError) as info:
        PluginRegistry()
    message = str(info.value)
    assert "fakepkg" in message and "tessellm" in message and "'sdpa'" in message
    assert DISABLE_ENV in message  # says how to resolve it


def test_add_module_conflict_names_both_packages():
    registry = PluginRegistry()
    with pytest.raises(PluginConflictError) as info:
        registry.add_module(module_with("dup_mod", registering(attention_class("sdpa"))), package="testpkg")
    assert "tessellm" in str(info.value) and "testpkg" in str(info.value)
    assert registry.get("attention", "sdpa").package == "tessellm"  # the first one stays


def test_same_name_in_different_kinds_is_no_conflict():
    from tessellm.core.interfaces.quantizer import Quantizer

    registry = PluginRegistry()
    quant = type("SdpaQuant", (Quantizer,), {"name": "sdpa", "api_version": "1.0"})
    registry.add_module(module_with("q_mod", registering(quant, "quant")), package="testpkg")
    assert registry.failures == []
    assert registry.get("quant", "sdpa").cls is quant
    assert registry.get("attention", "sdpa").package == "tessellm"


# ---------------------------------------------------------------------------- api_version


_NEXT_MINOR = "1.%d" % (int(PLUGIN_API_VERSION.split(".")[1]) + 1)


@pytest.mark.parametrize("version", [
    "2.0", _NEXT_MINOR, "0.9", "3",
    ("abc"),
])
def test_incompatible_api_version_is_a_load_failure(version):
    registry = empty_registry()
    registry.add_module(module_with("vmod", registering(attention_class("vplug", version))), package="testpkg")
    assert registry.get("attention", "vplug") is None
    [failure] = registry.failures
    assert failure.package == "testpkg"
    assert "vplug" in failure.error
    assert version in failure.error  # what it targets
    assert PLUGIN_API_VERSION in failure.error  # what tessellm provides


def test_incompatible_api_version_message_is_explicit():
    registry = empty_registry()
    registry.add_module(module_with("vmod", registering(attention_class("vplug", "2.0"))), package="testpkg")
    [failure] = registry.failures
    assert "targets plugin API 2.0" in failure.error
    assert f"provides plugin API {PLUGIN_API_VERSION}" in failure.error
    assert __version__ in failure.error


def test_missing_api_version_is_a_load_failure():
    registry = empty_registry()
    registry.add_module(module_with("vmod", registering(attention_class("nover", version_attr=False))),
                        package="testpkg")
    assert registry.get("attention", "nover") is None
    [failure] = registry.failures
    assert failure.package == "testpkg"
    assert "api_version" in failure.error and "does not state" in failure.error
    assert PLUGIN_API_VERSION in failure.error


def test_api_version_must_be_set_on_the_concrete_class():
    """Inheriting a base plugin's api_version does not count: the concrete class states it."""
    registry = empty_registry()
    parent = attention_class("parent")
    child = type("Child", (parent,), {"name": "child"})
    registry.add_module(module_with("vmod", registering(child)), package="testpkg")
    assert registry.get("attention", "child") is None
    assert "does not state" in registry.failures[0].error


def test_none_api_version_is_missing():
    registry = empty_registry()
    registry.add_module(module_with("vmod", registering(attention_class("nover", None))), package="testpkg")
    assert registry.get("attention", "nover") is None and len(registry.failures) == 1


@pytest.mark.parametrize("version", ["1.0", "1", PLUGIN_API_VERSION])
def test_compatible_api_version_loads(version):
    registry = empty_registry()
    registry.add_module(module_with("vmod", registering(attention_class("vplug", version))), package="testpkg")
    assert registry.failures == []
    assert registry.get("attention", "vplug").package == "testpkg"


def test_api_version_failure_from_entry_point(fake_dist):
    fake_dist("fakepkg", {"attention.future": (MODULE_PREFIX + "future", plugin_source("future", api_version="2.0"))})
    registry = PluginRegistry()
    [failure] = registry.failures
    assert failure.package == "fakepkg" and failure.source == "attention.future"
    assert "2.0" in failure.error and PLUGIN_API_VERSION in failure.error
    assert registry.get("attention", "future") is None
    assert registry.get("attention", "sdpa") is not None


@pytest.mark.parametrize("version, shown", [(1.5, "1.5 (float)"), (1, "1 (int)"), (True, "True (bool)"),
                                            (b"1.0", "b'1.0' (bytes)")])
def test_a_non_string_api_version_is_a_load_failure(version, shown):
    registry = empty_registry()
    registry.add_module(module_with("vmod", registering(attention_class("numver", version))), package="testpkg")
    assert registry.get("attention", "numver") is None
    [failure] = registry.failures
    assert "attention plugin 'numver'" in failure.error  # the plugin
    assert f"api_version is {shown}" in failure.error  # what it got
    assert "must be a string" in failure.error and repr(PLUGIN_API_VERSION) in failure.error  # what is allowed


def test_a_float_api_version_that_loses_a_digit_fails_from_an_entry_point(fake_dist, monkeypatch, capsys):
    """``api_version = 1.10`` is the float 1.1: it must not load as if it said "1.1"."""
    from tessellm import cli

    source = plugin_source("float-ten", api_version="1.6").replace("api_version = '1.6'", "api_version = 1.10")
    assert "api_version = 1.10" in source
    fake_dist("floatpkg", {"attention.float-ten": (MODULE_PREFIX + "float_ten", source)})
    registry = PluginRegistry()
    [failure] = registry.failures
    assert failure.source == "attention.float-ten" and failure.package == "floatpkg"
    assert "api_version is 1.1 (float)" in failure.error and "1.10 reads as 1.1" in failure.error
    assert registry.get("attention", "float-ten") is None
    monkeypatch.setattr(registry_module, "_default", None)
    assert cli.main(["plugins"]) == 0
    err = capsys.readouterr().err
    assert "plugin 'attention.float-ten' from package 'floatpkg' failed to load" in err and "must be a string" in err


def test_api_version_problem_takes_strings_only():
    from tessellm.core.version import api_version_problem

    assert api_version_problem(PLUGIN_API_VERSION) is None and api_version_problem("1") is None
    assert "must be a string" in api_version_problem(1.0)
    assert "does not state" in api_version_problem(None)
    assert "not of the form" in api_version_problem("1.x")


# ---------------------------------------------------------------------------- bad registrations


def test_misspelled_hook_name_is_a_load_failure():
    registry = empty_registry()
    registry.add_module(module_with("typo_mod", registering(attention_class("typo"), kind="atention")),
                        package="testpkg")
    [failure] = registry.failures
    assert failure.package == "testpkg"
    assert "register_atention" in failure.error
    assert registry.get("attention", "typo") is None
    assert not registry.pm.get_plugins()  # the bad module is not left registered
    # the registry keeps working after the failure
    registry.add_module(module_with("good_mod", registering(attention_class("good"))), package="testpkg")
    assert registry.get("attention", "good") is not None
    assert len(registry.failures) == 1


def test_misspelled_hook_from_entry_point(fake_dist):
    fake_dist("fakepkg", {"attention.typo": (MODULE_PREFIX + "typo",
                                             plugin_source("typo", hook="register_atention"))})
    registry = PluginRegistry()
    [failure] = registry.failures
    assert failure.package == "fakepkg" and "register_atention" in failure.error
    assert registry.get("attention", "typo") is None
    assert set(BUILTINS["decoding"]) <= set(registry.names("decoding"))


@pytest.mark.parametrize("thing", [int, object(), "sdpa", None, dict])
def test_registering_a_non_plugin_is_a_load_failure(thing):
    registry = empty_registry()
    registry.add_module(module_with("np_mod", registering(thing)), package="testpkg")
    [failure] = registry.failures
    assert failure.package == "testpkg"
    assert "not a subclass of AttentionBackend" in failure.error
    assert registry.names("attention") == []


def test_registering_a_plugin_of_another_kind_is_a_load_failure():
    from tessellm.core.interfaces.quantizer import Quantizer

    quant = type("Q", (Quantizer,), {"name": "q", "api_version": "1.0"})
    registry = empty_registry()
    registry.add_module(module_with("wk_mod", registering(quant, "attention")), package="testpkg")
    assert "not a subclass of AttentionBackend" in registry.failures[0].error
    assert registry.names("attention") == [] and registry.names("quant") == []


@pytest.mark.parametrize("name", [None, "", "auto", 42])
def test_registering_a_class_without_a_name_is_a_load_failure(name):
    cls = attention_class(None)
    if name is not None:
        cls.name = name
    registry = empty_registry()
    registry.add_module(module_with("nn_mod", registering(cls)), package="testpkg")
    [failure] = registry.failures
    assert failure.package == "testpkg"
    assert "name" in failure.error
    assert registry.names("attention") == []


def test_hook_raising_is_a_load_failure_and_registers_nothing_from_that_module():
    good = attention_class("first")

    @tessellm.hookimpl
    def register_attention(register):
        register(good)
        raise ValueError("hook exploded")

    registry = empty_registry()
    registry.add_module(module_with("boom_mod", register_attention), package="testpkg")
    [failure] = registry.failures
    assert "ValueError" in failure.error and "hook exploded" in failure.error
    assert registry.names("attention") == []


def test_one_bad_class_fails_its_whole_module_only():
    registry = empty_registry()

    @tessellm.hookimpl
    def register_attention(register):
        register(attention_class("ok_in_bad_module"))
        register(attention_class("too_new", "2.0"))

    registry.add_module(module_with("mixed_mod", register_attention), package="badpkg")
    registry.add_module(module_with("fine_mod", registering(attention_class("fine"))), package="goodpkg")
    assert [f.package for f in registry.failures] == ["badpkg"]
    assert registry.names("attention") == ["fine"]


def test_registry_from_modules_argument():
    class Namespace:
        register_attention = registering(attention_class("ns_attention"))

    registry = PluginRegistry(entry_points=False, modules=[Namespace])
    assert registry.failures == []
    entry = registry.get("attention", "ns_attention")
    assert entry is not None and entry.package == "Namespace"


# ---------------------------------------------------------------------------- disabling


def test_disable_env_skips_an_entry_point(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "decoding.greedy")
    registry = PluginRegistry()
    assert "greedy" not in registry.names("decoding") and "sample" in registry.names("decoding")
    assert registry.get("attention", "sdpa") is not None
    assert registry.failures == []


def test_disable_env_takes_a_comma_separated_list(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, " decoding.greedy , quant.none,")
    registry = PluginRegistry()
    assert "greedy" not in registry.names("decoding") and "sample" in registry.names("decoding")
    assert "none" not in registry.names("quant")


def test_disable_env_skips_a_broken_or_conflicting_out_of_tree_plugin(fake_dist, monkeypatch):
    fake_dist("brokenpkg", {"attention.broken": (MODULE_PREFIX + "broken", "raise RuntimeError('boom')\n")})
    fake_dist("fakepkg", {"attention.mysdpa": (MODULE_PREFIX + "shadow", plugin_source("sdpa"))})
    monkeypatch.setenv(DISABLE_ENV, "attention.broken,attention.mysdpa")
    registry = PluginRegistry()
    assert registry.failures == []
    assert registry.get("attention", "sdpa").package == "tessellm"
    assert sys.modules.get(MODULE_PREFIX + "broken") is None  # not even imported


def test_disable_env_accepts_a_distribution_name(fake_dist, monkeypatch):
    fake_dist("fakepkg", {"attention.fake": (MODULE_PREFIX + "fake", plugin_source("fake"))})
    monkeypatch.setenv(DISABLE_ENV, "fakepkg")
    registry = PluginRegistry()
    assert registry.get("attention", "fake") is None
    assert registry.get("attention", "sdpa") is not None


# ---------------------------------------------------------------------------- CLI


def _check_rows(rows):
    assert isinstance(rows, list) and rows
    for row in rows:
        assert isinstance(row, dict)
        for key in ("kind", "name", "package", "description"):
            assert key in row, f"{key} missing from {row}"
        assert isinstance(row["description"], str) and row["description"]


def test_cli_plugins_json_subprocess(fake_dist, tmp_path):
    root = fake_dist("fakepkg", {"attention.fake": (MODULE_PREFIX + "fake", plugin_source("fake"))})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    env.pop(DISABLE_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "tessellm", "plugins", "--json"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    _check_rows(rows)
    have = {(r["kind"], r["name"]): r["package"] for r in rows}
    for kind, names in BUILTINS.items():
        for name in names:
            assert have[(kind, name)] == "tessellm"
    assert have[("attention", "fake")] == "fakepkg"


def test_cli_plugins_json_in_process_reports_failures_on_stderr(fake_dist, monkeypatch, capsys):
    from tessellm import cli

    fake_dist("brokenpkg", {"attention.broken": (MODULE_PREFIX + "broken", "raise RuntimeError('boom')\n")})
    monkeypatch.setattr(registry_module, "_default", None)  # a fresh process-wide registry
    assert cli.main(["plugins", "--json"]) == 0
    out, err = capsys.readouterr()
    rows = json.loads(out)
    _check_rows(rows)
    assert {(r["kind"], r["name"]) for r in rows} >= {tuple(ep.split(".")) for ep in BUILTIN_ENTRY_POINTS}
    assert "brokenpkg" in err and "boom" in err


def test_cli_plugins_table(monkeypatch, capsys):
    from tessellm import cli

    monkeypatch.setattr(registry_module, "_default", None)
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    for ep in BUILTIN_ENTRY_POINTS:
        assert ep in out
    assert "tessellm" in out


def test_cli_plugins_conflict_is_a_one_line_error(fake_dist, monkeypatch, capsys):
    from tessellm import cli

    fake_dist("fakepkg", {"attention.mysdpa": (MODULE_PREFIX + "shadow", plugin_source("sdpa"))})
    monkeypatch.setattr(registry_module, "_default", None)
    assert cli.main(["plugins", "--json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tessellm: error:") and "\n" not in err
    assert "fakepkg" in err and "tessellm" in err


def test_subclass_must_declare_its_own_name():
    """A subclass of a built-in that forgets ``name`` must not pass as the built-in."""
    from tessellm.plugins.attention.sdpa import SdpaAttention

    class Forgetful(SdpaAttention):
        api_version = "1.0"

    registry = empty_registry()
    registry.add_module(module_with("forgetful", registering(Forgetful)), package="forgetpkg")
    assert any("must set its own class attribute name" in str(f) for f in registry.failures)
    assert registry.get("attention", "sdpa") is None or registry.get("attention", "sdpa").package != "forgetpkg"


# ---------------------------------------------------------------------------- the mistakes authors make


def test_a_hook_without_hookimpl_is_a_load_failure_that_says_so(fake_dist):
    source = plugin_source("unmarked").replace("@tessellm.hookimpl\n", "")
    assert "@tessellm.hookimpl" not in source
    fake_dist("fakepkg", {"attention.unmarked": (MODULE_PREFIX + "unmarked", source)})
    registry = PluginRegistry()
    [failure] = registry.failures
    assert "register_attention is not decorated with @tessellm.hookimpl" in failure.error
    from tessellm.core.config import PipelineConfig
    from tessellm.core.errors import ConfigError
    from tessellm.core.resolve import precheck

    with pytest.raises(ConfigError) as info:  # selecting it names the reason, not only "unknown"
        precheck(PipelineConfig.model_validate({"attention": {"name": "unmarked"}}), registry)
    assert "not decorated with @tessellm.hookimpl" in str(info.value)


def test_a_misspelt_hook_gets_a_suggestion():
    registry = empty_registry()
    registry.add_module(module_with("typo_mod", registering(attention_class("typo"), kind="atention")),
                        package="testpkg")
    assert "did you mean register_attention?" in registry.failures[0].error


def test_an_unknown_plugin_name_gets_a_suggestion():
    from tessellm.core.config import PipelineConfig
    from tessellm.core.errors import ConfigError
    from tessellm.core.resolve import precheck

    with pytest.raises(ConfigError) as info:
        precheck(PipelineConfig.model_validate({"attention": {"name": "sdp"}}), PluginRegistry())
    assert "unknown attention plugin 'sdp' (did you mean 'sdpa'?)" in str(info.value)


def test_one_class_registered_twice_in_one_hook_is_a_load_failure():
    cls = attention_class("twice")

    @tessellm.hookimpl
    def register_attention(register):
        register(cls)
        register(cls)

    registry = empty_registry()
    registry.add_module(module_with("twice_mod", register_attention), package="testpkg")
    [failure] = registry.failures
    assert "'twice'" in failure.error and "registered twice by this module" in failure.error
    assert registry.names("attention") == []


def test_every_name_clash_is_reported_at_once(fake_dist):
    fake_dist("fakepkg", {"attention.mysdpa": (MODULE_PREFIX + "clash_a", plugin_source("sdpa")),
                          "decoding.mygreedy": (MODULE_PREFIX + "clash_b", plugin_source("greedy", kind="decoding"))})
    with pytest.raises(PluginConflictError) as info:
        PluginRegistry()
    message = str(info.value)
    assert message.startswith("2 plugin name clashes") and "'sdpa'" in message and "'greedy'" in message


@pytest.mark.parametrize("options, expected", [
    (dict, "Options is <class 'dict'>; it must be a subclass of tessellm.PluginOptions"),
    (type("Plain", (__import__("pydantic").BaseModel,), {"__annotations__": {"k": int}, "k": 1}),
     "must be a subclass of tessellm.PluginOptions"),
])
def test_options_that_are_not_plugin_options_are_a_load_failure(options, expected):
    cls = attention_class("badopts")
    cls.Options = options
    registry = empty_registry()
    registry.add_module(module_with("opts_mod", registering(cls)), package="testpkg")
    [failure] = registry.failures
    assert "'badopts'" in failure.error and expected in failure.error


def test_options_whose_defaults_break_their_own_types_blame_the_plugin():
    from pydantic import Field

    class WrongDefault(tessellm.PluginOptions):
        block: int = Field("sixty-four")  # the author's mistake, not the user's

    cls = attention_class("defaults-wrong")
    cls.Options = WrongDefault
    registry = empty_registry()
    registry.add_module(module_with("defaults_mod", registering(cls)), package="testpkg")
    [failure] = registry.failures
    assert "'defaults-wrong'" in failure.error
    assert "defaults do not validate against their own declared types" in failure.error


def test_an_option_without_a_default_is_a_load_failure_naming_the_plugin_and_the_field():
    """A field without a default would load, then fail every config that names the plugin
    without giving that option, far from the plugin's code: it fails at load instead."""
    from pydantic import Field

    class Required(tessellm.PluginOptions):
        path: str
        """Where the tables are."""
        block: int = Field(..., ge=1)
        scale: float = 1.0

    cls = attention_class("needs-path")
    cls.Options = Required
    registry = empty_registry()
    registry.add_module(module_with("required_mod", registering(cls)), package="testpkg")
    assert registry.get("attention", "needs-path") is None
    [failure] = registry.failures
    assert failure.package == "testpkg"
    assert "attention plugin 'needs-path'" in failure.error
    assert "'path', 'block'" in failure.error and "'scale'" not in failure.error
    assert "no default" in failure.error


def test_an_option_without_a_default_from_an_entry_point_is_listed_by_tessellm_plugins(
        fake_dist, monkeypatch, capsys):
    from tessellm import cli

    source = plugin_source("needs-path", api_version=PLUGIN_API_VERSION, extra=textwrap.dedent("""\
        class NeedsPath(tessellm.PluginOptions):
            path: str

        FakePlugin.Options = NeedsPath
        """))
    fake_dist("needspkg", {"attention.needs-path": (MODULE_PREFIX + "needs_path", source)})
    monkeypatch.setattr(registry_module, "_default", None)
    assert cli.main(["plugins", "--json"]) == 0
    out, err = capsys.readouterr()
    assert ("attention", "needs-path") not in {(r["kind"], r["name"]) for r in json.loads(out)}
    assert "'attention.needs-path' from package 'needspkg' failed to load" in err
    assert "'path' has no default" in err


def test_a_boolean_for_a_number_is_an_error_in_options_and_sampling():
    from typing import Optional

    from pydantic import ValidationError

    class MinP(tessellm.PluginOptions):
        min_p: float = 0.0
        top: Optional[int] = None
        on: bool = False

    with pytest.raises(ValidationError, match="min_p: expected a number, got true"):
        MinP(min_p=True)
    with pytest.raises(ValidationError, match="top: expected a number"):
        MinP(top=False)
    assert MinP(on=True, min_p=0.5).on is True
    with pytest.raises(ValidationError, match="temperature: expected a number, got true"):
        tessellm.SamplingParams(temperature=True)


def test_an_option_without_a_default_still_loads_for_a_plugin_written_before_api_1_7(caplog):
    """Plugin API 1.6 allowed required options: such a plugin keeps loading (a config must
    then give the option), with a warning naming the field."""

    class Required(tessellm.PluginOptions):
        path: str

    cls = attention_class("old-needs-path", api_version="1.6")
    cls.Options = Required
    registry = empty_registry()
    with caplog.at_level("WARNING", logger="tessellm.core.registry"):
        registry.add_module(module_with("old_required_mod", registering(cls)), package="testpkg")
    assert registry.get("attention", "old-needs-path") is not None and not registry.failures
    assert "'path'" in caplog.text and "have no default" in caplog.text
