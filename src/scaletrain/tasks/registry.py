"""Tasks, found by module: every module of `scaletrain.tasks` that exports `TASK` (a Task subclass) is a task, named
by its `name`. Adding a task is adding a module; no code here or in the trainer names one.

`SCALETRAIN_TASK_PATH` (folders separated by os.pathsep) adds folders whose modules are found the same way: a
user's own task, or a test's, without touching the installed package. Importing a task imports no torch unless the
task itself does at import time (the built-in ones do not).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from functools import lru_cache
from pathlib import Path

from scaletrain.tasks.base import Task

PATH_ENV = "SCALETRAIN_TASK_PATH"
_NOT_TASKS = ("base", "registry")


def _task_modules() -> list:
    import scaletrain.tasks as pkg

    found = [
        importlib.import_module(f"{pkg.__name__}.{info.name}")
        for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name)
        if not info.ispkg and info.name not in _NOT_TASKS
    ]
    for folder in filter(None, os.environ.get(PATH_ENV, "").split(os.pathsep)):
        for info in sorted(pkgutil.iter_modules([folder]), key=lambda i: i.name):
            name = f"scaletrain_task_{info.name}"
            if name not in sys.modules:
                path = Path(folder) / (f"{info.name}/__init__.py" if info.ispkg else f"{info.name}.py")
                spec = importlib.util.spec_from_file_location(name, path)
                if spec is None or spec.loader is None:
                    raise RuntimeError(f"{PATH_ENV}: {path} cannot be imported as a task module")
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            found.append(sys.modules[name])
    return [m for m in found if isinstance(getattr(m, "TASK", None), type) and issubclass(m.TASK, Task)]


@lru_cache(maxsize=None)
def _tasks_for(path: str) -> dict[str, type[Task]]:
    tasks: dict[str, type[Task]] = {}
    for module in _task_modules():
        cls = module.TASK
        if cls.name in tasks and tasks[cls.name] is not cls:
            raise RuntimeError(f"task {cls.name!r} is defined twice: {tasks[cls.name].__module__} and {cls.__module__}")
        tasks[cls.name] = cls
    return tasks


def tasks() -> dict[str, type[Task]]:
    """{task name: its Task class} of every task found."""
    return _tasks_for(os.environ.get(PATH_ENV, ""))


def task_for(section) -> Task:
    """The task of a job's `[task]` section (config/schema.py TaskConfig) with its options checked strictly;
    ValueError (one line) names an unknown task or a bad option."""
    from scaletrain.config.fields import check_fields

    found = tasks()
    cls = found.get(section.name)
    if cls is None:
        raise ValueError(f"task.name: unknown task {section.name!r}; choose one of {', '.join(sorted(found))}")
    options = check_fields("task", f"{cls.name} task", cls.options_type, section.options())
    return cls(cls.options_type(**options))
