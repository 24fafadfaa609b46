"""The seams a newcomer extends without touching the trainer: a model family owns its `[model]` keys (a family
with other arguments than the Llama's is configured from TOML with its own fields, refused in one line on a bad
one), and a task owns its batch, loss and normalisation count (a second task, found through SCALETRAIN_TASK_PATH,
trains through the unchanged trainer with exact loss normalisation under another layout)."""

import os
import textwrap
from pathlib import Path

import pytest

from conftest import run_cli
from scaletrain.config import ConfigError, load_config

# A family whose args are nothing like a decoder's: no dim/heads, a choice of activation, a float scale. It answers
# the vocabulary and context the causal-lm task asks for, and nothing the planner models (no decoder shape).
WIDE_FAMILY = """
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from scaletrain.models.spec import ModelSpec, prune_stage


@dataclass(frozen=True)
class WideArgs:
    width: Annotated[int, Field(gt=0)]
    depth: Annotated[int, Field(gt=0)]
    vocab: int
    context: int
    activation: Literal["gelu", "relu"] = "gelu"
    init_scale: float = 0.02


def build_model(a):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(a.width, a.width)

        def forward(self, x):
            act = torch.nn.functional.gelu if a.activation == "gelu" else torch.relu
            return x + act(self.proj(x))

    class WideLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(a.vocab, a.width)
            self.blocks = nn.ModuleDict({str(i): Block() for i in range(a.depth)})
            self.head = nn.Linear(a.width, a.vocab, bias=False)

        def forward(self, tokens):
            h = self.embed(tokens) if self.embed is not None else tokens
            for block in self.blocks.values():
                h = block(h)
            return self.head(h) if self.head is not None else h

    return WideLM()


class WideSpec(ModelSpec):
    family = "wide-lm"
    args_type = WideArgs

    def build(self, device="meta"):
        import torch

        with torch.device(device):
            return build_model(self.args)

    def param_init_std(self, name):
        return 0.0 if name.endswith("bias") else self.args.init_scale

    def blocks(self, model):
        return model.blocks

    def stage(self, model, stage, n_stages, bounds):
        drop = (() if stage == 0 else ("embed",)) + (() if stage == n_stages - 1 else ("head",))
        return prune_stage(model, "blocks", bounds, drop)

    def has_output(self, model):
        return getattr(model, "head", None) is not None

    @property
    def vocab_size(self):
        return self.args.vocab

    @property
    def max_seq_len(self):
        return self.args.context


SPEC = WideSpec
PRESETS = {"wide-tiny": WideArgs(width=32, depth=2, vocab=256, context=128)}
"""

# A second task: next-token prediction trained only on even token ids, so how many tokens a batch trains on
# depends on its content (counts_vary) and an option of its own sets the rule.
EVEN_TASK = """
from dataclasses import dataclass

from scaletrain.tasks.causal_lm import CausalLM


@dataclass(frozen=True)
class Options:
    modulus: int = 2


class TrainedOnMultiples(CausalLM):
    name = "multiples-lm"
    options_type = Options
    counts_vary = True

    def targets(self, batch):
        t = batch.targets.clone()
        t[t % self.options.modulus != 0] = -100
        return t

    def count(self, batch):
        return int((batch.targets % self.options.modulus == 0).sum())


TASK = TrainedOnMultiples
"""


@pytest.fixture
def wide_family(tmp_path, monkeypatch):
    folder = tmp_path / "families"
    (folder / "wide_lm").mkdir(parents=True)
    (folder / "wide_lm" / "__init__.py").write_text(WIDE_FAMILY)
    monkeypatch.setenv("SCALETRAIN_MODEL_PATH", str(folder))
    return folder


def _spec(tmp_path: Path, toml: str):
    from scaletrain.models import model_spec

    path = tmp_path / "job.toml"
    path.write_text(textwrap.dedent(toml))
    return model_spec(load_config(path).model)


def test_a_family_with_its_own_args_is_configured_from_toml(wide_family, tmp_path):
    spec = _spec(tmp_path, '[model]\nname = "wide-tiny"\nwidth = 48\nactivation = "relu"\ninit_scale = 0.5\n')
    assert (spec.family, spec.args.width, spec.args.activation, spec.args.init_scale) == ("wide-lm", 48, "relu", 0.5)
    assert spec.args.depth == 2 and spec.shape() is None  # the rest from the preset; nothing the planner models
    assert spec.n_blocks == 2 and spec.num_params() == 256 * 48 * 2 + 2 * (48 * 48 + 48)  # answered from meta
    assert spec.layer_costs(64) == [1.0, 1.0]  # no decoder shape: the pipeline cut balances block counts
    bad = {
        'width = "48"': "model.width: input should be a valid integer (got '48')",
        "width = 0": "model.width: input should be greater than 0 (got 0)",
        'activation = "tanh"': "model.activation: input should be 'gelu' or 'relu' (got 'tanh')",
        "dim = 64": "model.dim: the wide-lm family has no such field; it has activation, context, depth, init_scale, "
        "vocab, width",
    }
    for line, message in bad.items():
        with pytest.raises(ValueError) as e:
            _spec(tmp_path, f'[model]\nname = "wide-tiny"\n{line}\n')
        assert str(e.value) == message


def test_the_cli_refuses_a_bad_family_field_in_one_line(wide_family, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from scaletrain.cli.main import main

    job = tmp_path / "wide.toml"
    job.write_text('[model]\nname = "wide-tiny"\nactivation = "swish"\n')
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["train", str(job)])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert (
        result.stderr.strip() == "scaletrain: error: model.activation: input should be 'gelu' or 'relu' (got 'swish')"
    )


@pytest.mark.slow  # one launch; the fast tier checks the same keys in process above
def test_the_cli_trains_a_family_from_its_own_fields(wide_family, tmp_path):
    job = tmp_path / "wide.toml"
    job.write_text('[model]\nname = "wide-tiny"\nwidth = 64\nactivation = "relu"\n')
    fast = ["train.steps=3", "train.global_batch_size=4", "data.seq_len=32", "train.eval_batches=1"]
    run_cli(["train", str(job), *fast, "data.source=synthetic", "monitor.progress=false", "--nproc-per-node", "1"],
            tmp_path)  # fmt: skip
    assert (tmp_path / "runs/default/config.toml").read_text().count('activation = "relu"') == 1
    assert (tmp_path / "runs/default/summary.json").is_file()


def test_task_section_is_checked_by_the_task():
    from scaletrain.tasks import task_for

    assert task_for(load_config(None).task).name == "causal-lm"  # the default: every existing config
    for override, message in {
        "task.name=nope": "task.name: unknown task 'nope'; choose one of causal-lm, diffusion, image-classification, "
        "recommendation, vision-language",
        "task.bogus=1": "task.bogus: the causal-lm task has no such field; it has none",
    }.items():
        with pytest.raises(ValueError) as e:
            task_for(load_config(None, [override]).task)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match="^task.name: "):
        load_config(None, ["task.name=1"])


@pytest.fixture(scope="module")
def multiples_runs(tmp_path_factory):
    from test_parallel_layouts import launch_runner

    folder = tmp_path_factory.mktemp("tasks")
    (folder / "multiples_lm.py").write_text(EVEN_TASK)
    out = folder / "runner"
    task = ["task.name=multiples-lm", "task.modulus=3", "train.steps=6"]
    os.environ["SCALETRAIN_TASK_PATH"] = str(folder)  # inherited by the launches below
    try:
        launch_runner(1, {"single": [*task, "parallel.dp_shard=1"]}, out)
        launch_runner(2, {"ddp2_accumulate": [*task, "parallel.dp_replicate=2", "train.micro_batch_size=2"]}, out)
    finally:
        del os.environ["SCALETRAIN_TASK_PATH"]
    return out


@pytest.mark.slow  # two launches (one process, two ranks)
def test_a_second_task_trains_through_the_trainer_with_exact_normalisation(multiples_runs):
    """Each rank's micro-batches train on a different number of tokens; the step's loss is the mean over the
    tokens trained on every rank, so 2 ranks with accumulation give one process's losses."""
    from test_parallel_layouts import runner_losses

    ref, got = runner_losses(multiples_runs / "single"), runner_losses(multiples_runs / "ddp2_accumulate")
    assert len(ref) == len(got) == 6 and ref[-1] < ref[0]
    for step, (a, b) in enumerate(zip(ref, got, strict=True), 1):
        assert abs(a - b) <= 1e-5, f"step {step}: {b} vs one process {a}"
