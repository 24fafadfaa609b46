"""Model families and their presets, found by folder: every subpackage of `scaletrain.models` that exports `SPEC`
(a ModelSpec subclass) and `PRESETS` ({name: args}) is a family. Adding a family is adding a folder; no code here or
in the trainer names one.

`SCALETRAIN_MODEL_PATH` (folders separated by os.pathsep) adds folders holding more family packages, found the
same way: a user's own family, or a test's, without touching the installed package. Importing a family imports no
torch unless the family itself does at import time (the built-in one does not).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from functools import lru_cache
from pathlib import Path

from scaletrain.models.spec import ModelSpec

PATH_ENV = "SCALETRAIN_MODEL_PATH"


def _family_modules() -> list:
    import scaletrain.models as pkg

    found = []
    # the built-in Llama first (the default family: its presets lead every list), then by name
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: (i.name != "llama", i.name)):
        if info.ispkg:
            found.append(importlib.import_module(f"{pkg.__name__}.{info.name}"))
    for folder in filter(None, os.environ.get(PATH_ENV, "").split(os.pathsep)):
        for info in sorted(pkgutil.iter_modules([folder]), key=lambda i: i.name):
            if not info.ispkg:
                continue
            name = f"scaletrain_model_family_{info.name}"
            if name not in sys.modules:
                init = Path(folder) / info.name / "__init__.py"
                spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
                if spec is None or spec.loader is None:
                    raise RuntimeError(f"{PATH_ENV}: {init} cannot be imported as a model family package")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            found.append(sys.modules[name])
    return [m for m in found if isinstance(getattr(m, "SPEC", None), type) and issubclass(m.SPEC, ModelSpec)]


@lru_cache(maxsize=None)
def _families_for(path: str) -> tuple[dict[str, type[ModelSpec]], dict[str, tuple[type[ModelSpec], object]]]:
    families: dict[str, type[ModelSpec]] = {}
    presets: dict[str, tuple[type[ModelSpec], object]] = {}
    for module in _family_modules():
        cls = module.SPEC
        families[cls.family] = cls
        for name, args in getattr(module, "PRESETS", {}).items():
            if name in presets:
                raise RuntimeError(
                    f"model preset {name!r} is defined by two families: {presets[name][0].family} and {cls.family}"
                )
            presets[name] = (cls, args)
    return families, presets


def families() -> dict[str, type[ModelSpec]]:
    """{family name: its ModelSpec class} of every family found."""
    return _families_for(os.environ.get(PATH_ENV, ""))[0]


def presets() -> dict[str, tuple[type[ModelSpec], object]]:
    """{preset name: (its family's ModelSpec class, args)} over every family, in discovery order."""
    return _families_for(os.environ.get(PATH_ENV, ""))[1]


def preset_spec(name: str) -> ModelSpec:
    """The spec of a preset as it is; ValueError (one line) lists the presets when the name is unknown."""
    found = presets()
    if name not in found:
        raise ValueError(f"model.name: unknown model {name!r}; choose one of {', '.join(found)}")
    cls, args = found[name]
    return cls(args)


def model_spec(cfg) -> ModelSpec:
    """The spec for a job's `[model]` section (config/schema.py ModelConfig): the family whose `selected_by` key is
    set (e.g. model.hf = FOLDER) reads the section itself, else the preset cfg.name's family applies the other keys
    to it, each checked strictly against the family's own fields; ValueError (one line) names the bad key."""
    keys = cfg.family_keys()
    by_key = {cls.selected_by for cls in families().values() if cls.selected_by}
    chosen = [key for key in keys if key in by_key]
    if len(chosen) > 1:
        raise ValueError(f"model.{chosen[1]}: model.{chosen[0]} already chooses the model; set only one of them")
    if chosen:
        return _family_of(chosen[0], keys[chosen[0]]).from_section(keys, None)
    base = preset_spec(cfg.name)
    return type(base).from_section(keys, base.args)


def spec_selected_by(key: str, value: object) -> ModelSpec:
    """The spec of the family chosen by `model.<key> = value` alone (e.g. `plan --hf DIR` is model.hf = DIR);
    ValueError (one line) when no installed family is chosen by that key, or from the family's own checks."""
    if not any(cls.selected_by == key for cls in families().values()):
        raise ValueError(f"model.{key}: no installed model family is chosen by this key")
    return _family_of(key, value).from_section({key: value}, None)


def _family_of(key: str, value: object) -> type[ModelSpec]:
    """The family `model.<key> = value` chooses: of those selected by `key`, the first whose `claims` says so,
    families with their own `claims` asked before those that take whatever is left."""
    candidates = [cls for cls in families().values() if cls.selected_by == key]
    candidates.sort(key=lambda cls: cls.claims.__func__ is ModelSpec.claims.__func__)  # type: ignore[attr-defined]
    return next((cls for cls in candidates if cls.claims(value)), candidates[-1])


def spec_from_manifest(entry: dict) -> ModelSpec:
    """Rebuild the spec a checkpoint recorded (ModelSpec.manifest); ValueError when its family is not installed."""
    cls = families().get(entry.get("family", ""))
    if cls is None:
        raise ValueError(
            f"checkpoint: model family {entry.get('family')!r} is not installed here (found: {', '.join(families())})"
        )
    return cls(cls.args_type(**entry["args"]))
