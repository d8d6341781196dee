"""Public-domain texts bundled for ``tessellm eval ppl`` (sources and licence: NOTICE.md)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tessellm.core.errors import ConfigError

BUNDLED = {"the-tempest": "the-tempest.txt", "paradise-lost": "paradise-lost-book-1.txt"}
"""Name -> file of each bundled text; the first is the default."""

DEFAULT_TEXT = next(iter(BUNDLED))


def load_text(name_or_path: str | None = None) -> tuple[str, str]:
    """(label, text) of a bundled text by name, or of a UTF-8 file by path; None: the default.
    An unknown name that is no file is a ConfigError naming the bundled texts."""
    name = name_or_path or DEFAULT_TEXT
    if name in BUNDLED:
        return name, resources.files(__name__).joinpath(BUNDLED[name]).read_text(encoding="utf-8")
    path = Path(name)
    if not path.is_file():
        raise ConfigError(f"--text {name!r} is neither a file nor a bundled text; bundled: {', '.join(BUNDLED)}")
    try:
        return str(path), path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--text {name!r} cannot be read as UTF-8 text: {exc}") from None
