"""Decoding `speculative`: draft with n-gram lookup, a draft model or the target's own
layers, verify exactly in the target's forward. See ``decoder.py``."""

import tessellm

from .decoder import SpeculativeDecoder, SpeculativeOptions

__all__ = ["SpeculativeDecoder", "SpeculativeOptions"]


@tessellm.hookimpl
def register_decoding(register):
    register(SpeculativeDecoder)
