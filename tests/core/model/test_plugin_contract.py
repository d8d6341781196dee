"""A broken attention plugin is named on its first call (core/model/contract.py): one
``tessellm: error:`` line naming the plugin and its module, not a traceback from inside the
model, whether its forward raises or returns the wrong shape or dtype."""

from __future__ import annotations

import pytest

import tessellm
from tessellm import LLM
from tessellm.cli import main
from tessellm.core.errors import PluginCallError
from tessellm.core.model.decoder import Attention
from tessellm.plugins.attention.sdpa import SdpaAttention


class Raising(SdpaAttention):
    name = "contract-raises"
    api_version = "1.1"

    def forward(self, layer, q, k, v, kv, plan):
        raise ValueError("the author's bug")


class WrongShape(SdpaAttention):
    name = "contract-shape"
    api_version = "1.1"

    def forward(self, layer, q, k, v, kv, plan):
        return super().forward(layer, q, k, v, kv, plan)[:, :1]


class Float64(SdpaAttention):
    name = "contract-dtype"
    api_version = "1.1"

    def forward(self, layer, q, k, v, kv, plan):
        return super().forward(layer, q, k, v, kv, plan).double()


@tessellm.hookimpl
def register_attention(register):
    for cls in (Raising, WrongShape, Float64):
        register(cls)


@pytest.mark.parametrize("name, expected", [
    ("contract-raises", "forward raised ValueError: the author's bug"),
    ("contract-shape", "forward returned (4, 1, 16) torch.float32; the contract is q's shape and dtype, "
                       "(4, 4, 16) torch.float32"),
    ("contract-dtype", "forward returned (4, 4, 16) torch.float64"),
])
def test_a_broken_forward_is_named_in_one_line(authors_plugins, tiny_model, cpu_config, capsys, name, expected):
    config = cpu_config(tiny_model("llama"), attention={"name": name})
    with pytest.raises(PluginCallError) as info:
        LLM(config).generate([[5, 6, 7, 8]], {"max_tokens": 2})
    message = str(info.value)
    assert message.startswith(f"attention plugin {name!r} (module {__name__})") and expected in message

    path = tiny_model("llama")
    code = main(["generate", "t5 t6", "--max-tokens", "2", "--set", f"model={path}", "--set", "device=cpu",
                 "--set", "dtype=float32", "--set", f"attention.name={name}", "--set", "cache.name=contiguous"])
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("tessellm: error:")]
    assert len(lines) == 1 and f"attention plugin {name!r}" in lines[0] and "Traceback" not in err


def test_a_correct_backend_is_checked_once_per_layer(tiny_model, cpu_config):
    llm = LLM(cpu_config(tiny_model("llama"), attention={"name": "sdpa"}))
    layers = [m for m in llm.pipeline.model.modules() if isinstance(m, Attention)]
    assert len(layers) == 2 and not any(a.backend_checked for a in layers)
    llm.generate([[5, 6, 7]], {"max_tokens": 2})
    assert all(a.backend_checked for a in layers)
