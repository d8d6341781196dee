"""The `classify` pooler's activations: every one a checkpoint can name (sentence-transformers'
``activation_fn``, read by core/model/sentence_transformers.py) is applied as torch.nn's class
applies it, and each can also be named in the pooler's options."""

from __future__ import annotations

import typing

import pytest
import torch

from tessellm.core.model.sentence_transformers import ACTIVATION_PATHS
from tessellm.plugins.pooling.classify import ACTIVATIONS, ClassifyOptions


def test_every_activation_a_checkpoint_names_is_applied_and_can_be_set():
    assert set(ACTIVATIONS) == set(ACTIVATION_PATHS.values())
    assert set(typing.get_args(ClassifyOptions.model_fields["activation"].annotation)) == {"auto", *ACTIVATIONS}


@pytest.mark.parametrize("class_name", sorted(ACTIVATION_PATHS))
def test_each_activation_equals_torch_nn(class_name):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    module = getattr(torch.nn, class_name)(**({"dim": -1} if class_name == "Softmax" else {}))
    torch.testing.assert_close(ACTIVATIONS[ACTIVATION_PATHS[class_name]](x), module(x))
    assert ClassifyOptions(activation=ACTIVATION_PATHS[class_name]).activation == ACTIVATION_PATHS[class_name]
