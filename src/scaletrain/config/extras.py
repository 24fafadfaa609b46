"""Optional extras (pyproject.toml's [project.optional-dependencies]): a feature whose library is not installed is
refused before launch in one line naming the extra to install, instead of an ImportError in a rank."""

from __future__ import annotations

import importlib.util

# importable module -> the extra of pyproject.toml that installs it
EXTRA_OF = {
    "transformers": "hf",
    "peft": "hf",
    "mlflow": "trackers",
    "wandb": "trackers",
    "lm_eval": "eval",
}


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a module set to None in sys.modules is not)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a module without a spec
        return False


def require(module: str, feature: str, extra: str | None = None) -> None:
    """ValueError, one line naming `feature` (the config key or option that asks for it) and the extra that installs
    `module` (`extra`, else the one EXTRA_OF names), when it is not installed."""
    if not installed(module):
        extra = extra or EXTRA_OF[module]
        raise ValueError(f"{feature}: needs {module}, which is not installed; pip install 'scaletrain[{extra}]'")
