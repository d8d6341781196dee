"""Reading what a checkpoint says about pooling: sentence-transformers' files (new and legacy
pooling configs, Normalize, Dense, prompts, include_prompt, tokenizer settings), a
classification head's architecture and activation, an encoder's default, and nothing."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tessellm.core.errors import ModelLoadError
from tessellm.core.model.sentence_transformers import read_checkpoint_pooling


def write(folder, name, data):
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
CAUSAL = SimpleNamespace(architectures=["Qwen3Model"])


def test_a_sentence_transformers_folder(tmp_path):
    write(tmp_path, "modules.json", MODULES)
    write(tmp_path, "1_Pooling/config.json", {"embedding_dimension": 64, "pooling_mode": "lasttoken",
                                              "include_prompt": False})
    write(tmp_path, "config_sentence_transformers.json", {"prompts": {"query": "Q: ", "document": ""},
                                                          "default_prompt_name": "query", "similarity_fn_name": "dot"})
    write(tmp_path, "sentence_bert_config.json", {"max_seq_length": 256, "do_lower_case": True})
    said = read_checkpoint_pooling(tmp_path, CAUSAL)
    assert (said.mode, said.normalize, said.include_prompt, said.similarity) == ("lasttoken", True, False, "dot")
    assert said.prompts == {"query": "Q: ", "document": ""} and said.default_prompt_name == "query"
    assert (said.max_seq_length, said.do_lower_case, said.source) == (256, True, "1_Pooling/config.json")


@pytest.mark.parametrize("flags,mode", [({"pooling_mode_mean_tokens": True}, "mean"),
                                        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),
                                        ({"pooling_mode_lasttoken": True}, "lasttoken"),
                                        ({"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True}, "cls+max")])
def test_the_older_per_mode_flags(tmp_path, flags, mode):
    write(tmp_path, "modules.json", MODULES[:2])
    write(tmp_path, "1_Pooling/config.json", {"word_embedding_dimension": 64, **flags})
    said = read_checkpoint_pooling(tmp_path, CAUSAL)
    assert said.mode == mode and not said.normalize


def test_dense_modules_are_read_from_safetensors_and_a_pickle_is_refused(tmp_path):
    from safetensors.torch import save_file

    write(tmp_path, "modules.json", MODULES[:2] + [{"idx": 2, "name": "2", "path": "2_Dense",
                                                     "type": "sentence_transformers.models.Dense"}])
    write(tmp_path, "1_Pooling/config.json", {"pooling_mode": "mean"})
    write(tmp_path, "2_Dense/config.json", {"in_features": 4, "out_features": 2, "bias": True,
                                            "activation_function": "torch.nn.modules.activation.Tanh"})
    with pytest.raises(ModelLoadError, match="has no model.safetensors .*pickle"):
        read_checkpoint_pooling(tmp_path, CAUSAL)
    save_file({"linear.weight": torch.ones(2, 4), "linear.bias": torch.zeros(2)}, tmp_path / "2_Dense" / "model.safetensors")
    [dense] = read_checkpoint_pooling(tmp_path, CAUSAL).dense
    assert dense.weight.shape == (2, 4) and dense.activation == "tanh"
    write(tmp_path, "2_Dense/config.json", {"activation_function": "my.pkg.Custom"})
    with pytest.raises(ModelLoadError, match="activation 'my.pkg.Custom' is not supported"):
        read_checkpoint_pooling(tmp_path, CAUSAL)


def test_without_sentence_transformers_files():
    from pathlib import Path

    nowhere = Path("/nonexistent-folder")
    classifier = SimpleNamespace(architectures=["XLMRobertaForSequenceClassification"], num_labels=1,
                                 sentence_transformers={"activation_fn": "torch.nn.modules.linear.Identity"})
    said = read_checkpoint_pooling(nowhere, classifier)
    assert (said.mode, said.num_labels, said.activation) == ("classify", 1, "identity")
    assert "XLMRobertaForSequenceClassification" in said.source
    encoder = read_checkpoint_pooling(nowhere, SimpleNamespace(architectures=["BertModel"]), bidirectional=True)
    assert (encoder.mode, encoder.normalize) == ("cls", True)
    assert read_checkpoint_pooling(nowhere, SimpleNamespace(architectures=["LlamaForCausalLM"])).mode is None


def test_a_modules_file_without_pooling_says_nothing(tmp_path):
    write(tmp_path, "modules.json", MODULES[:1])
    assert read_checkpoint_pooling(tmp_path, CAUSAL).mode is None
