"""The seam between what a job trains a model to do and everything else: a `Task` answers every question the
trainer asks about the batch, the loss and what it is normalised by, so the trainer, checkpoints, recovery,
monitoring and launchers never name a loss, a vocabulary or a sequence.

A task is one module under `tasks/` (or in a folder of SCALETRAIN_TASK_PATH) exporting `TASK` (a Task subclass);
the registry finds it (tasks/registry.py) and the job's `[task] name` picks it. What a task answers:

- before launch: whether this job's model and data fit it (`check`, then `check_data`, which may open datasets);
- its data: the training and validation loaders of one data-parallel rank, yielding the batches it expects;
- per batch: what the model's forward takes (`inputs`: the first pipeline stage's input; `forward_kwargs`: keyword
  tensors every stage's forward takes, e.g. packed documents' positions) and what its loss compares the outputs
  with (`targets`: given to the last stage), all tensors of a leading batch dimension, and whether they are
  (B, S, ...) sequences context parallelism may split (`sequences`);
- the loss: summed over the units `count` counts (`loss_sum`), the same function on every path (plain,
  accumulation, loss-parallel logits, the pipeline's last stage);
- the count: the units one batch's loss is a sum over (tokens here; trained tokens only under a loss mask;
  samples for a classifier): the step's loss is divided by their total over every rank, so accumulation and
  every layout equal one process; throughput is reported in them (`unit` per second), MFU from `flops_per_unit`;
- evaluation: the metrics of the validation split from its summed loss and count (`eval_metrics`).

The layout mechanics (micro-batches, the pipeline schedule, loss parallelism, context parallelism, gradient
scaling) stay in train/step.py, which calls these.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from scaletrain.config.schema import JobConfig
    from scaletrain.models.spec import ModelSpec


@dataclass(frozen=True)
class NoOptions:
    """A task without `[task]` options of its own."""


class Task(ABC):
    """One task's answers, bound to its `[task]` options (an instance of `options_type`)."""

    name: ClassVar[str]
    # the dataclass of this task's `[task]` keys besides `name`, checked strictly (config/fields.py)
    options_type: ClassVar[type] = NoOptions
    # what `count` counts: throughput is reported as `<unit>_per_s`
    unit: ClassVar[str] = "tokens"
    # False: every batch of the same shape counts the same (the step's total needs no collective); True: the count
    # depends on the batch's content (a loss mask), and the step's total is summed over the ranks (one all-reduce).
    # A task may set it per instance once its data is known (`loaders`), the same on every rank.
    counts_vary: bool = False

    def __init__(self, options: Any = None):
        self.options = options if options is not None else self.options_type()

    # -- before launch --------------------------------------------------------------------------------------
    def check(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """ValueError (one line naming the field) when this job's model or config cannot run this task; cheap (no
        data opened)."""

    def refuse_degrees(self, cfg: JobConfig, *degrees: str) -> None:
        """ValueError (one line) for any of these parallel degrees above 1: this task does not run under them yet."""
        for degree in degrees:
            if getattr(cfg.parallel, degree) > 1:
                raise ValueError(f"parallel.{degree}: {self.name} does not run under this parallelism yet; use "
                                 f"parallel.{degree}=1")  # fmt: skip

    def require_prepared(self, cfg: JobConfig, kind: str, fmt: str) -> None:
        """ValueError (one line) unless data.path names one folder `scaletrain data prepare --format fmt` wrote (a
        `kind` folder): no data.mix, no other source."""
        if cfg.data.mix:
            raise ValueError(f"data.mix: {self.name} reads one prepared {kind} folder; set data.path instead")
        if not cfg.data.path or cfg.data.source not in ("auto", "prepared"):
            raise ValueError(f"data.path: {self.name} reads a prepared {kind} folder; set data.path=FOLDER "
                             f"(scaletrain data prepare --format {fmt})")  # fmt: skip

    def check_data(self, cfg: JobConfig, spec: ModelSpec) -> None:
        """ValueError (one line naming the field) when the job's data cannot feed this task (may open it)."""

    def bind_data(self, cfg: JobConfig, spec: ModelSpec) -> ModelSpec:
        """The model spec completed from the data, after `check_data` (e.g. a classifier's head given the data's
        classes); the spec as it is by default."""
        return spec

    # -- data -----------------------------------------------------------------------------------------------
    @abstractmethod
    def loaders(self, cfg: JobConfig, spec: ModelSpec, micro_batch: int, dp_rank: int, dp_size: int) -> tuple:
        """(training loader, validation loader) of one data-parallel rank: each `next_step()` returns the rank's
        micro-batches of one step (`micro_batch` samples each), `state_dict()`/`load_state_dict()` its position,
        `consumed_samples` settable (evaluation rewinds the validation loader), `close()`."""

    @abstractmethod
    def inputs(self, batch: Any) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """What the model's forward takes, (B, ...) on the host: one tensor, or a tuple of the forward's positional
        arguments (e.g. token ids and positions, or pixels and token ids)."""

    def forward_kwargs(self, batch: Any) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's forward, (B, ...) on the host, given to every pipeline stage (not only
        the first, unlike `inputs`), e.g. the positions and document ids of packed rows; none by default."""
        return {}

    @abstractmethod
    def targets(self, batch: Any) -> torch.Tensor:
        """What `loss_sum` compares the model's output with, (B, ...) on the host."""

    # inputs and targets are (B, S, ...) sequences: context parallelism may split dim 1 over its ranks
    sequences: ClassVar[bool] = True

    # -- loss and count -------------------------------------------------------------------------------------
    @abstractmethod
    def loss_sum(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss summed over the units `count` counts (a scalar; fp32), differentiable in `outputs`."""

    @abstractmethod
    def count(self, batch: Any) -> int:
        """The units `loss_sum` of this batch sums over, e.g. target tokens; the normaliser and the throughput."""

    def flops_per_unit(self, cfg: JobConfig, spec: ModelSpec) -> float | None:
        """Training FLOPs per counted unit (the MFU numerator); None when the spec cannot say."""
        return None

    # -- evaluation -----------------------------------------------------------------------------------------
    def eval_sums(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """Statistics of one validation micro-batch besides its loss, each a scalar (or a vector of fixed length, e.g.
        a histogram) summed over the validation run and every rank, then given to `eval_metrics` (a float, or a list
        of floats) (e.g. a classifier's correct predictions); none by default."""
        return {}

    def eval_metrics(self, loss_sum: float, count: float) -> dict[str, float]:
        """Metrics of a validation run from its loss summed over every rank and its count (and, when `eval_sums`
        gives any, a third argument: their sums); `val_loss` is the one the loop reports on the progress line and
        in summary.json."""
        return {"val_loss": loss_sum / count}

    # -- description ----------------------------------------------------------------------------------------
    def describe(self) -> str:
        return self.name
