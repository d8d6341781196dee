"""A deliberately broken attention backend for the conformance suite's own tests: sdpa with
a softmax scale 1.5 times too large. ``tessellm plugins --check attention:broken-scale`` must
fail it, naming the property."""

from __future__ import annotations

import tessellm
from tessellm.plugins.attention.sdpa import SdpaAttention


class BrokenScaleAttention(SdpaAttention):
    """sdpa, but softmax(q k^T * 1.5 * scale): plausible outputs, wrong ones."""

    name = "broken-scale"
    api_version = "1.1"
    auto_priority = None

    def __init__(self, options, model, device, dtype):
        super().__init__(options, model, device, dtype)
        self.scale = self.scale * 1.5


@tessellm.hookimpl
def register_attention(register):
    register(BrokenScaleAttention)
