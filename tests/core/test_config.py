"""The pipeline config: YAML, TOML and JSON files, ``--set`` overrides, and one-line
ConfigErrors naming the field (or file) and the bad value for everything malformed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tessellm.core.config import (PipelineConfig, PluginSection, apply_overrides, config_from_dict,
                                  default_config_data, load_config, read_config_file)
from tessellm.core.errors import ConfigError, TessellmError
from tessellm.core.plugin import CONFIG_KINDS as KINDS  # the kinds with a config section

FIELDS = list(PipelineConfig.model_fields)

CONFIG = {
    "model": "/models/tiny",
    "device": "cpu",
    "dtype": "float32",
    "max_model_len": 128,
    "seed": 7,
    "attention": {"name": "sdpa"},
    "cache": {"name": "contiguous", "options": {"max_seqs": 4}},
    "scheduler": {"name": "static", "options": {"max_batch_size": 2}},
    "decoding": {"name": "greedy"},
    "quant": {"name": "none"},
}

YAML_TEXT = """\
model: /models/tiny
device: cpu
dtype: float32
max_model_len: 128
seed: 7
attention: {name: sdpa}
cache:
  name: contiguous
  options: {max_seqs: 4}
scheduler: {name: static, options: {max_batch_size: 2}}
decoding: {name: greedy}
quant: {name: none}
"""

TOML_TEXT = """\
model = "/models/tiny"
device = "cpu"
dtype = "float32"
max_model_len = 128
seed = 7

[attention]
name = "sdpa"

[cache]
name = "contiguous"
options = { max_seqs = 4 }

[scheduler]
name = "static"
[scheduler.options]
max_batch_size = 2

[decoding]
name = "greedy"

[quant]
name = "none"
"""


def one_line_config_error(excinfo) -> str:
    message = str(excinfo.value)
    assert isinstance(excinfo.value, ConfigError)
    assert isinstance(excinfo.value, TessellmError)
    assert message and "\n" not in message, f"not one line: {message!r}"
    return message


def check_full_config(config: PipelineConfig) -> None:
    assert isinstance(config, PipelineConfig)
    assert config.model == "/models/tiny"
    assert config.device == "cpu" and config.dtype == "float32"
    assert config.max_model_len == 128 and config.seed == 7
    assert config.attention == PluginSection(name="sdpa")
    assert config.cache.name == "contiguous" and config.cache.options == {"max_seqs": 4}
    assert config.scheduler.options == {"max_batch_size": 2}
    assert config.decoding.name == "greedy" and config.quant.name == "none"


# ---------------------------------------------------------------------------- file formats


@pytest.mark.parametrize("suffix,text", [
    (".yaml", YAML_TEXT),
    (".yml", YAML_TEXT),
    (".toml", TOML_TEXT),
    (".json", json.dumps(CONFIG, indent=2)),
])
def test_load_config_from_each_format(tmp_path, suffix, text):
    path = tmp_path / f"pipeline{suffix}"
    path.write_text(text)
    check_full_config(load_config(path))
    check_full_config(load_config(str(path)))
    assert read_config_file(path) == CONFIG


def test_formats_agree(tmp_path):
    configs = []
    for suffix, text in [(".yaml", YAML_TEXT), (".toml", TOML_TEXT), (".json", json.dumps(CONFIG))]:
        path = tmp_path / f"c{suffix}"
        path.write_text(text)
        configs.append(load_config(path))
    assert configs[0] == configs[1] == configs[2] == PipelineConfig.model_validate(CONFIG)


def test_partial_file_gets_defaults(tmp_path):
    path = tmp_path / "partial.yaml"
    path.write_text("decoding: {name: sample}\n")
    config = load_config(path)
    assert config.decoding.name == "sample"
    assert config.attention.name == "auto" and config.cache.options == {}
    assert config.seed == 0 and config.device == "auto" and config.max_model_len is None


def test_empty_yaml_file_is_the_all_defaults_config(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert load_config(path) == PipelineConfig()


# ---------------------------------------------------------------------------- default config


def test_default_config_validates():
    config = load_config()
    assert isinstance(config, PipelineConfig)
    assert config.device == "auto" and config.dtype == "auto"
    assert all(config.section(kind).name == "auto" for kind in KINDS)
    for kind in KINDS:
        assert isinstance(config.section(kind), PluginSection)
    assert config == config_from_dict(default_config_data())


def test_default_config_file_is_plain_yaml_with_known_fields():
    data = default_config_data()
    assert isinstance(data, dict) and data
    assert set(data) <= set(FIELDS)


def test_every_field_has_a_default():
    config = PipelineConfig()
    assert all(config.section(kind).name == "auto" for kind in KINDS)


# ---------------------------------------------------------------------------- overrides


def test_override_plugin_name():
    config = load_config(overrides=["decoding.name=sample"])
    assert config.decoding.name == "sample"


def test_override_option_is_parsed_as_int():
    config = load_config(overrides=["cache.options.max_seqs=4"])
    assert config.cache.options["max_seqs"] == 4
    assert type(config.cache.options["max_seqs"]) is int


def test_override_model_path_stays_a_string():
    assert load_config(overrides=["model=/some/path"]).model == "/some/path"
    # even when it looks like a number, a bool or null
    for raw in ("123", "1.5", "true", "~/models/x", "C:/models", "a=b"):
        assert load_config(overrides=[f"model={raw}"]).model == raw


def test_override_plugin_name_stays_a_string():
    assert load_config(overrides=["attention.name=1"]).attention.name == "1"
    assert load_config(overrides=["decoding.name=yes"]).decoding.name == "yes"


def test_override_seed_is_an_int():
    config = load_config(overrides=["seed=3"])
    assert config.seed == 3 and type(config.seed) is int


def test_overrides_combine_and_apply_in_order(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(YAML_TEXT)
    config = load_config(path, overrides=["decoding.name=sample", "cache.options.max_seqs=4", "model=/some/path",
                                          "seed=3", "seed=5", "cache.options.extra=[1, 2]",
                                          "attention.options.batch_decode=false"])
    assert config.decoding.name == "sample"
    assert config.cache.name == "contiguous"  # untouched part of the section stays
    assert config.cache.options == {"max_seqs": 4, "extra": [1, 2]}
    assert config.attention.options == {"batch_decode": False}
    assert config.model == "/some/path" and config.seed == 5
    assert config.device == "cpu"  # from the file


def test_apply_overrides_returns_a_new_mapping():
    data = {"cache": {"name": "contiguous", "options": {"max_seqs": 2}}}
    out = apply_overrides(data, ["cache.options.max_seqs=4", "seed=3"])
    assert out == {"cache": {"name": "contiguous", "options": {"max_seqs": 4}}, "seed": 3}
    assert data == {"cache": {"name": "contiguous", "options": {"max_seqs": 2}}}


def test_apply_overrides_creates_missing_sections():
    assert apply_overrides({}, ["scheduler.options.max_batch_size=8"]) == \
        {"scheduler": {"options": {"max_batch_size": 8}}}
    assert apply_overrides({"cache": None}, ["cache.name=contiguous"]) == {"cache": {"name": "contiguous"}}


def test_override_value_with_equals_sign_keeps_the_rest():
    assert apply_overrides({}, ["model=/path/with=sign"]) == {"model": "/path/with=sign"}


def test_override_max_model_len_and_null():
    assert load_config(overrides=["max_model_len=512"]).max_model_len == 512
    assert load_config(overrides=["max_model_len=512", "max_model_len=null"]).max_model_len is None


@pytest.mark.parametrize("item", ["seed", "decoding.name", "", "=3", " =sample"])
def test_override_without_key_value_is_an_error(item):
    with pytest.raises(ConfigError) as info:
        apply_overrides({}, [item])
    message = one_line_config_error(info)
    assert "KEY=VALUE" in message
    assert repr(item) in message  # names what was given


@pytest.mark.parametrize("item,field", [("bogus=1", "bogus"), ("modle=/x", "modle"), ("attn.name=sdpa", "attn"),
                                        ("Seed=3", "Seed")])
def test_override_of_unknown_top_level_field_is_an_error(item, field):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[item])
    message = one_line_config_error(info)
    assert repr(field) in message
    assert "allowed:" in message
    for name in FIELDS:
        assert name in message


def test_override_into_a_non_section_is_an_error():
    with pytest.raises(ConfigError) as info:
        apply_overrides({"attention": "sdpa"}, ["attention.name=sdpa"])
    assert "'attention'" in one_line_config_error(info)


@pytest.mark.parametrize("item,field,value", [
    ("seed=abc", "seed", "'abc'"),
    ("seed=-1", "seed", "-1"),
    ("max_model_len=0", "max_model_len", "0"),
    ("dtype=fp8", "dtype", "'fp8'"),
    ("device=tpu", "device", "'tpu'"),
    ("cache.nam=contiguous", "cache.nam", "'contiguous'"),
])
def test_override_with_bad_value_is_an_error(item, field, value):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[item])
    message = one_line_config_error(info)
    assert f"{field}:" in message and value in message


# ---------------------------------------------------------------------------- bad files


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "model: [unclosed\nseed: 3\n"),
    (".yaml", "seed: 3\n  device: : cpu\n"),
    (".yml", "attention: {name: sdpa\n"),
    (".toml", "model = \n"),
    (".toml", "[cache\nname = 'x'\n"),
    (".json", '{"model": }'),
    (".json", '{"model": "x",}'),
])
def test_malformed_file_is_a_one_line_config_error(tmp_path, suffix, text):
    path = tmp_path / f"broken{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line_config_error(info)
    assert str(path) in message and "malformed" in message


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "model: [unclosed\nseed: 3\n"),
    (".toml", "model = \n"),
    (".json", '{"model": }'),
])
def test_malformed_file_error_says_where(tmp_path, suffix, text):
    path = tmp_path / f"broken{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "line 1" in one_line_config_error(info)


def test_binary_file_is_a_config_error(tmp_path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00model: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in one_line_config_error(info)


def test_missing_file_is_a_config_error(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line_config_error(info)
    assert str(path) in message and "does not exist" in message


def test_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(tmp_path) in one_line_config_error(info)


@pytest.mark.parametrize("name", ["pipeline.ini", "pipeline.txt", "pipeline", "pipeline.YAML.bak"])
def test_unknown_extension_is_a_config_error(tmp_path, name):
    path = tmp_path / name
    path.write_text("model: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line_config_error(info)
    assert str(path) in message
    assert "extension" in message and ".yaml" in message and ".toml" in message and ".json" in message


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "bogus_field: 1\n"),
    (".toml", "bogus_field = 1\n"),
    (".json", '{"bogus_field": 1}'),
])
def test_unknown_field_in_file_is_a_config_error(tmp_path, suffix, text):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line_config_error(info)
    assert str(path) in message
    assert "bogus_field" in message and "unknown field" in message
    assert "(got 1)" in message
    for name in FIELDS:
        assert name in message


def test_unknown_field_in_a_section_names_it_and_allowed_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("cache: {nme: contiguous}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line_config_error(info)
    assert "cache.nme" in message and "'contiguous'" in message
    assert "name" in message and "options" in message


@pytest.mark.parametrize("text,field,value", [
    ('seed: "abc"\n', "seed", "'abc'"),
    ("seed: -3\n", "seed", "-3"),
    ("seed: 1.5\n", "seed", "1.5"),
    ("max_model_len: -1\n", "max_model_len", "-1"),
    ("max_model_len: lots\n", "max_model_len", "'lots'"),
    ("dtype: fp8\n", "dtype", "'fp8'"),
    ("device: gpu\n", "device", "'gpu'"),
    ("device: cuda:x\n", "device", "'cuda:x'"),
    ("model: [a, b]\n", "model", "['a', 'b']"),
    ("attention: sdpa\n", "attention", "'sdpa'"),
    ("cache: {name: 3}\n", "cache.name", "3"),
    ("cache: {options: [1]}\n", "cache.options", "[1]"),
])
def test_wrong_type_in_file_is_a_config_error(tmp_path, text, field, value):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line_config_error(info)
    assert str(path) in message
    assert f"{field}:" in message and f"(got {value})" in message


def test_several_errors_are_reported_on_one_line(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"seed": "abc", "dtype": "fp8", "bogus": True}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line_config_error(info)
    assert "seed:" in message and "dtype:" in message and "bogus:" in message


@pytest.mark.parametrize("suffix,text,kind", [
    (".yaml", "- model: x\n", "list"),
    (".yaml", "just a string\n", "str"),
    (".json", "[1, 2]", "list"),
    (".json", "3", "int"),
])
def test_file_that_is_not_a_mapping_is_a_config_error(tmp_path, suffix, text, kind):
    path = tmp_path / f"c{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = one_line_config_error(info)
    assert str(path) in message and kind in message


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:3"])
def test_valid_devices(device):
    assert config_from_dict({"device": device}).device == device


def test_config_error_is_a_value_error():
    """Callers catching ValueError (pydantic habits) still catch config errors."""
    with pytest.raises(ValueError):
        config_from_dict({"seed": "abc"})


def test_yaml_and_json_files_round_trip_a_dumped_config(tmp_path):
    config = load_config(overrides=["decoding.name=sample", "cache.options.max_seqs=4", "seed=3"])
    dumped = config.model_dump()
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(dumped))
    (tmp_path / "a.json").write_text(json.dumps(dumped))
    assert load_config(tmp_path / "a.yaml") == config == load_config(Path(tmp_path / "a.json"))


def test_set_strips_spaces_around_key_and_value():
    config = load_config(None, ["decoding.name = sample", " cache.options.max_seqs= 4"])
    assert config.decoding.name == "sample" and config.cache.options["max_seqs"] == 4


@pytest.mark.parametrize("value", ["true", "yes", "3.5"])
def test_seed_must_be_an_integer(value):
    with pytest.raises(ConfigError, match="seed"):
        load_config(None, [f"seed={value}"])
