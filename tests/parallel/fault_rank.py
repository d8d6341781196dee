"""Run ``tessellm`` under torchrun with one rank made to fail mid-generation: the rank named
by $TESSELLM_TEST_FAIL_RANK raises (or, with $TESSELLM_TEST_FAIL_MODE=exit, dies without a
word) on its model forward number $TESSELLM_TEST_FAIL_AT. The fault tests launch this file."""

from __future__ import annotations

import os
import sys

from tessellm.cli import main
from tessellm.core.model.runner import ModelRunner

rank = int(os.environ["RANK"])
if rank == int(os.environ["TESSELLM_TEST_FAIL_RANK"]):
    fail_at, mode = int(os.environ["TESSELLM_TEST_FAIL_AT"]), os.environ.get("TESSELLM_TEST_FAIL_MODE", "raise")
    forward, calls = ModelRunner.forward, [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            if mode == "exit":
                os._exit(9)
            raise RuntimeError(f"injected fault on rank {rank}")
        return forward(self, *args, **kwargs)

    ModelRunner.forward = failing

sys.exit(main(sys.argv[1:]))
