"""The typed config: overrides, TOML round trip, one-line errors."""

import pytest

from scaletrain.config import ConfigError, JobConfig, load_config, parse_override, to_toml


def test_override_values_are_toml_literals():
    assert parse_override("train.lr=3e-4") == (["train", "lr"], 3e-4)
    assert parse_override("train.steps=100") == (["train", "steps"], 100)
    assert parse_override("monitor.progress=false") == (["monitor", "progress"], False)
    assert parse_override("run.name=my-run") == (["run", "name"], "my-run")
    assert parse_override('run.name="quoted"') == (["run", "name"], "quoted")


def test_print_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=7", "parallel.dp_replicate=2", "model.dim=64", "precision.dtype=bf16"])
    path = tmp_path / "job.toml"
    path.write_text(to_toml(cfg))
    again = load_config(path)
    assert again == cfg
    assert again.model.dim == 64 and again.train.steps == 7


def test_file_then_overrides(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[train]\nsteps = 50\nlr = 1e-3\n")
    cfg = load_config(path, ["train.steps=60"])
    assert (cfg.train.steps, cfg.train.lr) == (60, 1e-3)
    assert cfg == JobConfig.model_validate({"train": {"steps": 60, "lr": 1e-3}})


@pytest.mark.parametrize(
    "override, field",
    [
        ("train.lr=-1", "train.lr"),
        ("run.bogus=1", "run.bogus"),  # [model] and [task] keys are their family's / task's: test_model.py
        ("train.steps=ten", "train.steps"),
        ("train.steps=1.5", "train.steps"),
        ("nosuch.key=1", "nosuch"),
        ("precision.dtype=fp8x", "precision.dtype"),
    ],
)
def test_errors_are_one_line_naming_the_field(override, field):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(field), message


def test_every_registered_schedule_and_precision_is_a_config_choice_torch_knows():
    import typing

    import torch
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    from scaletrain.config.precisions import PRECISIONS
    from scaletrain.config.schedules import SCHEDULE_NAMES, SCHEDULES

    assert (
        typing.get_args(JobConfig.model_fields["parallel"].annotation.model_fields["pp_schedule"].annotation)
        == SCHEDULE_NAMES
    )
    for s in SCHEDULES:
        cfg = load_config(None, ["parallel.pp=2", f"parallel.pp_schedule={s.name}"])
        assert cfg.parallel.stages_per_rank == s.stages_per_rank
        # torch builds single-stage schedules from one stage, the others from a rank's list of stages
        assert issubclass(get_schedule_class(s.name), PipelineScheduleSingle) == (s.placement == "single")
    for p in PRECISIONS:
        assert load_config(None, [f"precision.dtype={p.name}"]).precision.dtype == p.name
        assert getattr(torch, p.torch_dtype).itemsize == p.element_bytes
