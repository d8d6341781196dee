"""``tessellm new-plugin KIND NAME``: a ready plugin package for the five kinds of the forward and decode path, for model architectures, logits processors, LoRA kernels, routing policies and poolers.

The package holds a plugin class whose body is a correct plain-torch implementation of its
kind (attention: explicit softmax attention; cache: one region per sequence; scheduler: FCFS
continuous batching; decoding: argmax; quant: int8 per-channel weights; model: Llama's
decoder from tessellm's building blocks; logits: a per-request cap on repeated tokens; lora:
rows grouped by adapter slot, a gather and two matmuls per slot; routing: the power of two
choices; pooling: sentence-transformers' "max" pooling, which no built-in implements), its
options model,
a pyproject.toml with the ``tessellm`` entry point, a tests/ module subclassing the kind's
conformance suite, and a README. It imports only ``tessellm``, the plugin API.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from string import Template

from tessellm.core.errors import ConfigError
from tessellm.core.plugin import KINDS
from tessellm.core.version import PLUGIN_API_VERSION, __version__

NAME_PATTERN = re.compile(r"[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
"""Plugin names the scaffold accepts: lowercase words of letters and digits joined by hyphens."""

CLASS_SUFFIX = {"attention": "Attention", "cache": "Cache", "scheduler": "Scheduler", "decoding": "Decoder",
                "quant": "Quantizer", "model": "Architecture", "logits": "Processor", "lora": "Lora",
                "routing": "Policy", "pooling": "Pooler"}
SCAFFOLD_KINDS = tuple(CLASS_SUFFIX)
"""The kinds ``new-plugin`` has templates for (every kind but the optional grammar kind)."""
SECTION = {"model": "architecture"}
"""A kind's config section where it is not named after the kind."""
BUILTIN_TO_COMPARE = {"attention": "sdpa", "cache": "paged", "scheduler": "continuous", "decoding": "greedy",
                      "quant": "none", "model": "llama", "lora": "torch", "pooling": "mean"}
"""The built-in ``tessellm ab`` compares a generated plugin with (a logits processor has no
config section: its README compares requests with and without it instead)."""


@dataclass(frozen=True)
class Scaffold:
    """What ``new_plugin`` wrote: the package folder, its files, and the commands to go on."""

    directory: Path
    files: list[Path]
    next_steps: list[str]


def requirement() -> str:
    """The tessellm releases providing this plugin API: this one up to the next minor."""
    major, minor, *_ = (int(part) for part in re.findall(r"\d+", __version__)[:3])
    return f"tessellm>={__version__},<{major}.{minor + 1}"


def check_name(kind: str, name: str) -> None:
    """ConfigError unless ``kind`` is a plugin kind and ``name`` a name the scaffold accepts."""
    if kind not in KINDS:
        raise ConfigError(f"new-plugin: unknown kind {kind!r}; the kinds are {', '.join(KINDS)}")
    if kind not in SCAFFOLD_KINDS:
        raise ConfigError(f"new-plugin: there is no template for a {kind} plugin yet (templates: "
                          f"{', '.join(SCAFFOLD_KINDS)}); subclass tessellm.GrammarBackend and run GrammarConformance "
                          f"(docs/plugins.md)")
    if name == "auto" or not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"new-plugin: plugin name {name!r} is not allowed; use lowercase letters, digits and "
                          f"hyphens, starting with a letter (e.g. my-{kind}), and not 'auto'")


def substitutions(kind: str, name: str) -> dict[str, str]:
    camel = "".join(part.capitalize() for part in name.split("-"))
    suffix = CLASS_SUFFIX[kind]
    class_name = camel if camel.endswith(suffix) else camel + suffix
    package = "tessellm_" + name.replace("-", "_")
    section = SECTION.get(kind, kind)
    run = (f'tessellm generate --set {section}.name={name} --max-tokens 16 "Hello"' if kind != "decoding"
           else f'tessellm generate --set decoding.name={name} --temperature 0 --max-tokens 16 "Hello"')
    if kind == "model":  # it serves Llama checkpoints as written
        run = f'tessellm generate --set model=A_LLAMA_FOLDER --set architecture.name={name} --max-tokens 16 "Hello"'
    values = {"kind": kind, "name": name, "class_name": class_name, "options_class": f"{class_name}Options",
              "args_class": f"{class_name}Args", "plan_class": f"{camel}Plan", "linear_class": f"{camel}Int8Linear",
              "package": package, "layer_class": f"{camel}Layer", "module_class": f"{camel}ForCausalLM",
              "section": section, "dist": f"tessellm-{name}", "suite": f"{kind.capitalize()}Conformance",
              "api_version": PLUGIN_API_VERSION, "requirement": requirement(), "run_hint": run, "suite_settings": "",
              "compare": ("Then compare it with a built-in on the same workload, outputs checked for equivalence:\n"
                          f"`tessellm ab --a {section}.name={BUILTIN_TO_COMPARE.get(kind)} --b {section}.name={name}` "
                          "(see tessellm's\ndocs/plugins.md).")}
    if kind == "logits":
        values.update(_per_request(name))
    if kind == "lora":
        values.update(_under_an_adapter(name))
    if kind == "routing":
        values.update(_in_front_of_replicas(name))
    if kind == "pooling":
        values.update(_after_the_model(name))
    return values


def _after_the_model(name: str) -> dict[str, str]:
    """A pooler serves an embedding model's checkpoint: what its README runs and compares."""
    model = "--set model=AN_EMBEDDING_MODEL_FOLDER"
    return {"run_hint": f"tessellm serve {model} --set pooling.name={name}   # then POST /v1/embeddings",
            "compare": ("Then compare it with sentence-transformers on the same texts (its throughput and how far the\n"
                        "embeddings agree; a checkpoint whose 1_Pooling/config.json says \"max\" is what it serves):\n"
                        f"`tessellm bench --workload embed {model} --set pooling.name={name}`\n"
                        "(see tessellm's docs/plugins.md, 'Writing a pooler').")}


def _in_front_of_replicas(name: str) -> dict[str, str]:
    """A routing policy serves a router, not a pipeline: what its README runs and compares."""
    return {"run_hint": f"tessellm serve --data-parallel 2 --policy {name}",
            "compare": ("Then compare it with a built-in under the same load: the same replicas behind\n"
                        f"`tessellm router --policy {name}` and behind `tessellm router --policy least-load`,\n"
                        "each measured with `tessellm bench --serve URL` (see tessellm's docs/plugins.md,\n"
                        "'Writing a routing policy').")}


def _under_an_adapter(name: str) -> dict[str, str]:
    """A LoRA kernel only runs for requests under an adapter: what its README runs and
    compares registers one (a PEFT folder) and names it."""
    adapter = f"--set lora.name={name} --set lora.adapters.mine=ADAPTER_FOLDER"
    return {"run_hint": f'tessellm generate {adapter} --lora mine --max-tokens 16 "Hello"',
            "compare": ("Then compare it with the built-in `torch` kernel on the same workload, every request under\n"
                        "the adapter:\n"
                        f"`tessellm ab --a lora.name=torch,lora.adapters.mine=ADAPTER_FOLDER --b lora.name={name},"
                        "lora.adapters.mine=ADAPTER_FOLDER --params lora=mine`\n(see tessellm's docs/plugins.md).")}


def _per_request(name: str) -> dict[str, str]:
    """A logits processor has no config section: each request turns it on, by name, with its
    arguments; what its README runs and compares, and the requests its test gives the suite."""
    request = f'{{"logits_processors": [{{"name": "{name}", "args": {{"max_repeats": 1}}}}]}}'
    return {"run_hint": f"tessellm generate --sampling '{request}' --max-tokens 16 \"Hello\"",
            "compare": ("Then compare what a request gets with it and without it: the same prompts, with\n"
                        f"`--sampling '{request}'` and without (see tessellm's docs/plugins.md)."),
            "suite_settings": ("\n    # SamplingParams keyword arguments of the requests the suite runs (each turns it on)"
                               f'\n    requests = [{{"logits_processors": [{{"name": "{name}", "args": {{"max_repeats": 1}}}}]}},'
                               f'\n                {{"logits_processors": [{{"name": "{name}", "args": {{"max_repeats": 3}}}}]}}]')}


def _render(template: str, values: dict[str, str]) -> str:
    text = resources.files(__package__).joinpath("templates", template).read_text(encoding="utf-8")
    return Template(text).substitute(values)


def new_plugin(kind: str, name: str, directory: Path | str | None = None) -> Scaffold:
    """Write the package for ``kind`` plugin ``name`` into ``directory`` (default
    ./tessellm-NAME), which must not exist or be empty. Raises ConfigError for a bad kind,
    name or directory."""
    check_name(kind, name)
    values = substitutions(kind, name)
    root = Path(directory) if directory is not None else Path(values["dist"])
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"new-plugin: {root} already exists and is not an empty folder; "
                          f"choose another --dir or remove it")
    package = root / values["package"]
    files = {
        root / "pyproject.toml": _render("pyproject.toml.tmpl", values),
        root / "README.md": _render("README.md.tmpl", values),
        package / "__init__.py": _render("package_init.py.tmpl", values),
        package / f"{kind}.py": _render(f"{kind}.py.tmpl", values),
        root / "tests" / f"test_{values['package'].removeprefix('tessellm_')}.py": _render("test_plugin.py.tmpl", values),
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    steps = [f"cd {root}", "pip install -e '.[test]'", "pytest", f"tessellm plugins --check {kind}:{name}",
             values["run_hint"]]
    return Scaffold(root, list(files), steps)
