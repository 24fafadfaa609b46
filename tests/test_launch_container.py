"""`scaletrain launch container`: a Dockerfile and an Apptainer definition pinned to this run's software.
No container engine runs here, so the files are checked structurally: pins, the files they copy, the command."""

from __future__ import annotations

import json
import platform
import re
import tomllib
from pathlib import Path

import torch
from click.testing import CliRunner

from scaletrain.cli.main import main


def test_build_context_pins_python_torch_cuda_and_runs_the_same_command(tmp_path: Path) -> None:
    out = tmp_path / "ctx"
    res = CliRunner().invoke(
        main, ["launch", "container", "train.steps=7", "run.name=boxed", f"--out={out}"], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    docker = (out / "Dockerfile").read_text()
    apptainer = (out / "scaletrain.def").read_text()
    reqs = (out / "requirements.txt").read_text().split()

    # exact versions of the run: the Python base image, torch and its CUDA build, every dependency
    py = platform.python_version()
    assert re.search(rf"^FROM python:{re.escape(py)}-slim-bookworm$", docker, re.M)
    assert re.search(rf"^From: python:{re.escape(py)}-slim-bookworm$", apptainer, re.M)
    assert reqs[0] == f"torch=={torch.__version__.split('+')[0]}"
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[^=\s]+", r) for r in reqs)
    assert {r.split("==")[0] for r in reqs} >= {"torch", "pydantic", "click", "numpy"}
    want_cuda = torch.version.cuda or "cpu"
    for text in (docker, apptainer):  # the build fails when the installed torch is another build
        assert f"want = ({torch.__version__.split('+')[0]!r}, {want_cuda!r})" in text
        assert "-r /opt/scaletrain/requirements.txt" in text

    # the same command in both, on the baked config
    entry = json.loads(re.search(r"^ENTRYPOINT (.*)$", docker, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (.*)$", docker, re.M).group(1))
    assert entry + cmd == ["python", "-m", "scaletrain.cli.main", "train", "/opt/scaletrain/job.toml"]
    assert "exec python -m scaletrain.cli.main" in apptainer and "train /opt/scaletrain/job.toml" in apptainer

    # everything they copy exists in the build context
    for src in re.findall(r"^COPY (\S+) ", docker, re.M):
        assert (out / src).exists(), src
    files = apptainer.split("%files", 1)[1].split("%", 1)[0].split("\n")
    for line in filter(str.strip, files):
        assert (out / line.split()[0]).exists(), line
    assert (out / "src" / "scaletrain" / "cli" / "main.py").is_file()
    job = tomllib.loads((out / "job.toml").read_text())
    assert job["train"]["steps"] == 7 and job["run"]["name"] == "boxed"
    assert "%runscript" in apptainer and "Bootstrap: docker" in apptainer
