"""Bad input: one line on stderr naming what is wrong, exit code 2, and nothing written."""

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import run_cli, run_cli_in_process
from scaletrain.cli.main import main

BAD = [
    (["model.foo=1"], "model.foo"),  # unknown key
    (["nosuch.key=1"], "nosuch"),  # unknown section
    (["train.steps=abc"], "train.steps"),  # wrong type
    (["train.steps=1.5"], "train.steps"),  # float for an int
    (["train.lr=-0.1"], "train.lr"),  # negative lr
    (["model.name=gpt-9"], "model.name"),  # unknown model
    (["model.n_heads=3"], "model.dim"),  # heads do not divide the hidden size
    (["model.vocab_size=100"], "model.vocab_size"),  # too small for byte tokens
    (["model.dim=abc"], "model.dim"),  # the family's field, strictly typed
    (["model.hf=x", "model.dim=64"], "model.dim"),  # model.hf takes its shape from config.json
    (["task.name=nope"], "task.name"),  # unknown task
    (["task.bogus=1"], "task.bogus"),  # causal-lm has no options
    (["parallel.dp_replicate=3"], "parallel"),  # dp degree does not divide world size 2
    (["parallel.dp_shard=4"], "parallel"),  # degrees multiply to 4, world is 2
    (["train.global_batch_size=15"], "train.global_batch_size"),  # not divisible by dp=2
    (["train.micro_batch_size=3"], "train.micro_batch_size"),  # 8 per rank do not split into 3s
    (["data.seq_len=100000"], "data.seq_len"),  # longer than the model's context
    (["data.source=tokens"], "data.path"),  # token source without a file
    (["data.source=tokens", "data.path=/no/such/tokens.bin"], "data.path"),  # missing data file
    (["data.val_fraction=0.9"], "data.val_fraction"),  # out of range
    (["precision.dtype=fp7"], "precision.dtype"),  # unknown dtype
    (["run.device=cuda"], "run.device"),  # no GPU on this host
    (["missing.toml"], "config file"),  # missing config file
    (["train.steps=0"], "train.steps"),  # zero steps
    (["launch.nnodes=2"], "launch.rdzv_endpoint"),  # multi-node without a rendezvous host
    (["launch.nnodes=2", "launch.rdzv_endpoint=localhost:29500"], "launch.rdzv_endpoint"),  # other nodes can't reach
    (
        ["launch.nnodes=2", "launch.rdzv_endpoint=127.0.0.1:29500", "launch.local_addr=203.0.113.7"],
        "launch.local_addr",
    ),  # not an address of this host
    (["launch.rdzv_endpoint=29500"], "launch.rdzv_endpoint"),  # not host:port
    (["launch.rdzv_endpoint=127.0.0.1:99999"], "launch.rdzv_endpoint"),  # port out of range
    (["launch.rdzv_endpoint=garbage::"], "launch.rdzv_endpoint"),  # not HOST:PORT
    (["launch.rdzv_endpoint=999.0.0.1:29500"], "launch.rdzv_endpoint"),  # not an IPv4 address
    (["train.steps=99999999999999999999999"], "train.steps"),  # beyond int64, and beyond any run
    (["train.global_batch_size=99999999999"], "train.global_batch_size"),
    (["data.seq_len=9999999999"], "data.seq_len"),
    (["checkpoint.interval_steps=99999999999"], "checkpoint.interval_steps"),
    (["run.seed=18446744073709551616"], "run.seed"),  # 2**64: no torch seed
    (["launch.collective_timeout_s=inf"], "launch.collective_timeout_s"),  # TOML inf
    (["train.grad_clip=nan"], "train.grad_clip"),  # TOML nan
]


@pytest.mark.parametrize("args, field", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path, monkeypatch, args, field):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["train", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"scaletrain: error: {field}"), lines[0]
    assert list(tmp_path.iterdir()) == []


def test_taken_rendezvous_port_is_one_line(tmp_path, monkeypatch):
    from scaletrain.launch.network import listening_socket

    monkeypatch.chdir(tmp_path)
    with listening_socket("127.0.0.1", 0) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["train", f"launch.rdzv_endpoint=127.0.0.1:{port}"])
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("scaletrain: error: launch.rdzv_endpoint: cannot listen on 127.0.0.1:"), (
        result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1 and list(tmp_path.iterdir()) == []


def test_bad_config_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken.toml").write_text("[train\nsteps = 3\n")
    (tmp_path / "typed.toml").write_text('[train]\nsteps = "10"\n')
    for name, field in [("broken.toml", "config file"), ("typed.toml", "train.steps")]:
        result = CliRunner().invoke(main, ["train", name, "run.name=x"])
        assert result.exit_code == 2
        assert result.stderr.startswith(f"scaletrain: error: {field}"), result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
    result = CliRunner().invoke(main, ["train", "typed.toml", "train.steps"])
    assert result.exit_code == 2 and "section.key=value" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.toml", "typed.toml"]


def test_real_process_exit_code(tmp_path):
    proc = run_cli(["train", "train.lr=-1"], tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "scaletrain: error: train.lr: input should be greater than 0 (got -1)"
    assert list(tmp_path.iterdir()) == []


def test_print_config_is_loadable_toml(tmp_path):
    proc = run_cli_in_process(["train", "--print-config", "train.steps=5", "parallel.dp_replicate=2"], tmp_path)
    (tmp_path / "job.toml").write_text(proc.stdout)
    again = run_cli_in_process(["train", "job.toml", "--print-config"], tmp_path)
    assert again.stdout == proc.stdout
    assert "steps = 5" in proc.stdout


@pytest.mark.parametrize(
    "dtype, ids, field",
    [
        ("uint16", [1, 2, 300, 4], "data.path: token id 300 at position 2"),  # above the tiny model's 256
        ("int32", [1, -5, 2, 3], "data.path: token id -5 at position 1"),  # negative
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_before_launch(tmp_path, monkeypatch, dtype, ids, field):
    data = tmp_path / "data"
    data.mkdir()
    np.tile(np.asarray(ids, dtype=dtype), 50_000).tofile(data / "tokens.bin")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = CliRunner().invoke(
        main, ["train", "data.source=tokens", f"data.path={data / 'tokens.bin'}", f"data.token_dtype={dtype}"]
    )
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"scaletrain: error: {field}"), result.stderr
    assert "model.vocab_size" in lines[0] or "data.token_dtype" in lines[0]
    assert list(work.iterdir()) == []


PLAN_BAD = [
    (["--params", "1e30", "--gpus", "8"], "--params"),  # ran for minutes before
    (["--params", "inf", "--gpus", "8"], "--params"),
    (["--params", "nan", "--gpus", "8"], "--params"),
    (["--gpus", "1000000000"], "--gpus"),  # ran for minutes before
    (["--gpus", "-3"], "--gpus"),
    (["--gpus", "8", "--seq-len", "1000000000"], "--seq-len"),
    (["--gpus", "8", "--global-batch", "1000000000000"], "--global-batch"),
    (["--gpus", "8", "--global-batch", "0"], "--global-batch"),  # silently became the default before
    (["--gpus", "8", "--layers", "100000000"], "--layers"),  # a traceback before
    (["--gpus", "8", "--top", "1000000000"], "--top"),
    (["--gpus", "8", "--tokens", "inf"], "--tokens"),
    (["--gpus", "8", "--pue", "inf"], "--pue"),
    (["--gpus", "8", "--usd-per-gpu-hour", "nan"], "--usd-per-gpu-hour"),
    (["--gpus", "8", "--cp", "1000000000"], "--cp"),
]


@pytest.mark.parametrize("args, flag", PLAN_BAD, ids=[" ".join(a) for a, _ in PLAN_BAD])
def test_absurd_planner_input_is_one_line_exit_2(tmp_path, monkeypatch, args, flag):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["plan", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"scaletrain: error: {flag}:"), result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_lost_rendezvous_store_is_one_line_and_its_host_keeps_it_after_a_failure(tmp_path, monkeypatch):
    """A node whose agent loses the store another node serves says so in one line (no elastic traceback); the node
    serving it keeps it STORE_GRACE_S after a failed multi-node run, so the other agents see their own ranks end
    first (the race behind a node reporting a lost connection instead of the refusal its ranks printed)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    import scaletrain.launch.local as local
    from scaletrain.config import load_config
    from scaletrain.exit_codes import EXIT_FAILED

    def lost(*args, **kwargs):
        raise RendezvousConnectionError("The connection to the C10d store has failed.")

    launch_local = local.launch_local
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(local, "launch_local", lost)
    result = CliRunner().invoke(main, ["train", "train.steps=1"])
    assert result.exit_code == EXIT_FAILED, result.output
    assert result.stderr.startswith("scaletrain: lost the rendezvous at 127.0.0.1:"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1

    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "SCALETRAIN_NODE_ADDR", "OMP_NUM_THREADS"):
        monkeypatch.setenv(var, "x")  # launch_local sets them for its ranks; restored after the test
    monkeypatch.setattr("torch.distributed.launcher.api.elastic_launch", lambda *a: lost)
    slept: list[float] = []
    monkeypatch.setattr(local.time, "sleep", slept.append)
    for nnodes, server, waits in ((2, object(), [local.STORE_GRACE_S]), (2, None, []), (1, object(), [])):
        cfg = load_config(None, [f"launch.nnodes={nnodes}", "launch.rdzv_endpoint=127.0.0.1:29400"])
        slept.clear()
        with pytest.raises(RendezvousConnectionError):
            launch_local(cfg, 2, local.LocalRendezvous("127.0.0.1:29400", "127.0.0.1", server))
        assert slept == waits, (nnodes, server)


@pytest.mark.parametrize(
    "args, field",
    [
        (["train", "run.output_dir=afile/runs"], "run.output_dir: "),
        (["train", "run.output_dir=/proc/scaletrain-runs"], "run.output_dir: cannot create folders in /proc"),
        (["train", "checkpoint.dir=afile/ckpt"], "checkpoint.dir: "),
        (["data", "prepare", "corpus.txt", "--tokenizer", "bytes", "--out", "afile/out"], "--out: "),
    ],
)
def test_an_output_folder_that_cannot_be_written_is_one_line_before_anything_starts(tmp_path, monkeypatch, args, field):
    """A file where a folder must go, or /proc (root cannot write there either): refused before any rank or
    tokenizer worker starts, instead of a rank failing with exit 1 and pointing at a log inside that same path."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("not a folder\n")
    (tmp_path / "corpus.txt").write_text("some text to tokenize\n")
    result = CliRunner().invoke(main, args)
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"scaletrain: error: {field}"), lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "corpus.txt"]  # nothing written
