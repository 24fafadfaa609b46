"""Reading a TOML file a user wrote (a job config, a cluster file, a calibration) with the one-line errors every
reader gives: missing, not UTF-8, not valid TOML."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from scaletrain.config.errors import ConfigError


def read_toml(
    path: str | Path, what: str, error: type[ValueError] = ConfigError, fix: str = "pass an existing .toml file"
) -> dict[str, Any]:
    """The top-level table of the TOML file at `path`. `error` (one line starting `WHAT 'PATH': `) when the file is
    missing (ending in `fix`), not UTF-8 text or not valid TOML."""
    p = Path(path)
    where = f"{what} {str(p)!r}"
    if not p.is_file():
        raise error(f"{where}: not found; {fix}")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise error(f"{where}: not valid TOML: {e}") from None
    except UnicodeDecodeError:
        raise error(f"{where}: not UTF-8 text") from None
