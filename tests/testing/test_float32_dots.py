"""tessellm.testing.float32_dots: a float32 launch's TF32 dot is caught on a CPU (the
interpreter computes both precisions alike), a 16-bit launch's is allowed, IEEE passes.
tests/conftest.py keeps the check on for every interpreted kernel test."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from tessellm.testing.float32_dots import TF32DotError, float32_dots_checked  # noqa: E402

interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="watches interpreted launches")


@triton.jit
def _square(X, Out, IEEE: tl.constexpr):
    offs = tl.arange(0, 16)
    x = tl.load(X + offs[:, None] * 16 + offs[None, :]).to(tl.float32)
    if IEEE:
        y = tl.dot(x, x, input_precision="ieee")
    else:
        y = tl.dot(x, x)
    tl.store(Out + offs[:, None] * 16 + offs[None, :], y.to(Out.dtype.element_ty))


@interpreted
@pytest.mark.parametrize("dtype, ieee, refused", [(torch.float32, False, True), (torch.float32, True, False),
                                                  (torch.bfloat16, False, False)])
def test_a_float32_launch_must_ask_for_ieee_dots(dtype, ieee, refused):
    x = torch.randn(16, 16).to(dtype)
    out = torch.empty_like(x)
    with float32_dots_checked():
        if refused:
            with pytest.raises(TF32DotError, match="_square.*input_precision"):
                _square[(1,)](x, out, IEEE=ieee)
        else:
            _square[(1,)](x, out, IEEE=ieee)
            torch.testing.assert_close(out.float(), x.float() @ x.float(), rtol=1e-2 if dtype != torch.float32 else
                                       1e-5, atol=1e-2 if dtype != torch.float32 else 1e-5)


def test_nothing_loaded_turns_tf32_on_for_torch_matmuls():
    """torch's float32 GEMMs on CUDA stay IEEE: importing tessellm, its built-in plugins and the
    libraries they load sets neither allow_tf32 nor a lower float32 matmul precision."""
    import tessellm  # noqa: F401
    import transformers  # noqa: F401
    from tessellm.core.registry import get_registry

    get_registry()
    assert torch.get_float32_matmul_precision() == "highest"
    assert torch.backends.cuda.matmul.allow_tf32 is False
