"""What a job trains a model to do: one module per task (causal_lm.py: next-token prediction;
image_classification.py: one label per image), each a `Task`
(base.py) owning its batch, loss, normalisation count, metrics and evaluation; `[task] name` picks one
(registry.py). The trainer calls the task and names none."""

from scaletrain.tasks.base import Task
from scaletrain.tasks.registry import task_for, tasks

__all__ = ["Task", "task_for", "tasks"]
