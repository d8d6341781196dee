"""Optional dependencies of the applications: the server's (``[serve]``), the benchmarks'
plots and HTTP client (``[bench]``), the conformance suites' pytest and hypothesis
(``[conformance]``) and lm-evaluation-harness (``[eval]``). The library and ``tessellm generate`` need none of them;
a command that does and finds one missing stops with one line naming the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

from tessellm.core.errors import TessellmError


class MissingExtraError(TessellmError, ImportError):
    """An optional dependency of the command is not installed."""


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or raise MissingExtraError naming ``pip install 'tessellm[extra]'``."""
    try:
        return importlib.import_module(module)
    except MissingExtraError:
        raise  # the module itself requires an extra that is missing, and said which
    except ImportError as exc:
        if exc.name is not None and exc.name != module and not module.startswith(exc.name + "."):
            raise  # the module is there but itself fails to import: not a missing extra
        raise MissingExtraError(f"this needs the Python package {module!r}, which is not installed; "
                                f"install it with: pip install 'tessellm[{extra}]'") from None
