"""A deliberately broken model plugin for checking the model conformance suite's power: it
builds Mixtral but forgets to renormalise the two chosen experts' weights, so its logits
are close to Mixtral's but not equal."""

from __future__ import annotations

import dataclasses

import tessellm
from tessellm.plugins.model.mixtral import MixtralArchitecture


class BrokenMixtral(MixtralArchitecture):
    """Mixtral with its routing weights left unnormalised. Not a plugin to use."""

    name = "broken-mixtral"
    api_version = "1.6"
    auto_priority = None

    def spec(self, hf_config):
        spec = super().spec(hf_config)
        return dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, norm_topk_prob=False))


@tessellm.hookimpl
def register_model(register):
    register(BrokenMixtral)
