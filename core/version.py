"""Versions: the package's, and the plugin contract's.

A plugin states the plugin-API version it was written for, as a string (``api_version =
"1.0"``). It loads when its major version equals ours and its minor version is not newer than ours:
minor versions only add to the contract, a major version changes it.
"""

from __future__ import annotations

__version__ = "0.1.19"

PLUGIN_API_VERSION = "1.19"


def _parse(version: str) -> tuple[int, int]:
    parts = str(version).split(".")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"plugin api_version {version!r} is not of the form MAJOR or MAJOR.MINOR")
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def api_minor(version: str) -> int:
    """The minor number of a plugin-API version that loaded ("1.4" -> 4)."""
    return _parse(version)[1]


def api_version_problem(version: object) -> str | None:
    """Why a plugin targeting ``version`` cannot load here, or None if it can. Only a string
    is a version: a number loses digits (``1.10`` is the float 1.1)."""
    if version is None:
        return f"it does not state the plugin-API version it targets (set api_version = {PLUGIN_API_VERSION!r})"
    if not isinstance(version, str):
        return (f"api_version is {version!r} ({type(version).__name__}), but it must be a string, 'MAJOR.MINOR' "
                f"or 'MAJOR' (a number loses digits: 1.10 reads as 1.1); write it in quotes, e.g. "
                f"api_version = {PLUGIN_API_VERSION!r}")
    try:
        major, minor = _parse(version)
    except ValueError as exc:
        return f"{exc}; this tessellm {__version__} provides plugin API {PLUGIN_API_VERSION}"
    our_major, our_minor = _parse(PLUGIN_API_VERSION)
    if major != our_major or minor > our_minor:
        return (f"it targets plugin API {version}, but this tessellm {__version__} provides plugin API "
                f"{PLUGIN_API_VERSION} (compatible: {our_major}.0 to {PLUGIN_API_VERSION})")
    return None
