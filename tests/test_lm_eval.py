"""`scaletrain eval RUN --lm-eval TASKS`: lm-evaluation-harness straight on a scaletrain checkpoint, offline, with
task YAMLs and JSONL data written here (no download): a multiple-choice task's accuracy and a rolling
log-likelihood task's bits per byte equal what the same checkpoint's transformers model (built in memory, an
independent forward) gives for the same documents. Bad input is one line and exit 2."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_cli, run_cli_in_process

MC_DOCS = [
    {"question": "def f(x):\n    return", "choices": [" x", " zq"], "answer": 0},
    {"question": "import", "choices": [" qqq", " os"], "answer": 1},
    {"question": "for i in", "choices": [" range(3):", " zzz:"], "answer": 0},
    {"question": "class A", "choices": ["#@!", "(object):"], "answer": 0},
    {"question": "if x ==", "choices": [" None:", " ~~"], "answer": 0},
]
PROMPTS = ["def ", "import ", "class "]
TEXTS = ["def main():\n    return 0\n", "import sys\nprint(sys.argv)\n", "x = [i for i in range(3)]\n"]


def _task_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    (folder / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    common = f"dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n    test: {folder}/"
    (folder / "mc.yaml").write_text(
        f"task: tiny_code_mc\n{common}mc.jsonl\noutput_type: multiple_choice\ndoc_to_text: '{{{{question}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "text.yaml").write_text(
        f"task: tiny_code_bpb\n{common}text.jsonl\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: bits_per_byte\n"
        "    aggregation: bits_per_byte\n    higher_is_better: false\n"
    )
    return folder


def _log_prob(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids[:, :-1]).logits[0].double(), dim=-1)[-len(continuation) :]
    return float(logp.gather(1, torch.tensor(continuation)[:, None]).sum())


@pytest.mark.slow  # one short training run (a checkpoint to evaluate) and the harness's task loading
def test_lm_eval_on_a_checkpoint_equals_the_transformers_model(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the datasets cache of the local JSON files
    run_cli(["train", "data.source=stdlib", "data.max_bytes=200000", "model.vocab_size=256", "train.steps=20",
             "train.global_batch_size=8", "data.seq_len=64", "train.eval_interval=0", "monitor.progress=false",
             "monitor.sample_interval_s=0", "checkpoint.save_final=true", "checkpoint.async_save=false",
             "run.name=lm", "--nproc-per-node", "1"], tmp_path, timeout=300)  # fmt: skip
    run, tasks = tmp_path / "runs" / "lm", _task_folder(tmp_path / "tasks")
    # a generate_until task whose answers are what `scaletrain generate` prints (greedy, cut at the first newline)
    answers = []
    for prompt in PROMPTS:
        out = run_cli_in_process(["generate", str(run), "--prompt", prompt, "--max-new-tokens", "8"], tmp_path)
        answers.append(out.stdout.removesuffix("\n").split("\n", 1)[0])
    (tasks / "gen.jsonl").write_text("".join(json.dumps({"p": p, "a": a}) + "\n" for p, a in zip(PROMPTS, answers)))
    (tasks / "gen.yaml").write_text(
        f"task: tiny_code_gen\ndataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tasks}/gen.jsonl\noutput_type: generate_until\ndoc_to_text: '{{{{p}}}}'\ndoc_to_target: '{{{{a}}}}'\n"
        'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    names = "tiny_code_mc,tiny_code_bpb,tiny_code_gen"
    args = ["eval", str(run), "--lm-eval", names, "--lm-eval-include", str(tasks), "--json"]
    results = json.loads(run_cli_in_process(args, tmp_path).stdout)
    assert results["tiny_code_gen"]["exact_match,none"] == 1.0, answers

    from scaletrain.inference.generate import causal_lm
    from scaletrain.inference.source import find_source, load_weights

    model = causal_lm(*load_weights(find_source(run)))
    right = 0
    for doc in MC_DOCS:  # bytes are the ids; the harness scores each choice after the question
        context = list(doc["question"].encode())
        scores = [_log_prob(model, context, list(c.encode())) for c in doc["choices"]]
        right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    assert results["tiny_code_mc"]["acc,none"] == pytest.approx(right / len(MC_DOCS))
    newline = list(b"\n")  # the document's first byte follows a newline (bytes have no EOS)
    total = sum(_log_prob(model, newline, list(t.encode())) for t in TEXTS)
    bits = -total / sum(len(t.encode()) for t in TEXTS) / math.log(2)
    assert results["tiny_code_bpb"]["bits_per_byte,none"] == pytest.approx(bits, rel=1e-6)
    assert bits < 8  # the model learnt something of the stdlib's bytes: less than 8 bits per byte

    unknown = run_cli_in_process(["eval", str(run), "--lm-eval", "no_such_task"], tmp_path, check=False)
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        "scaletrain: error: --lm-eval: no task named no_such_task; pass --lm-eval-include DIR with its YAML"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lm-eval", "x", "--data", "y"], "--data/--lm-eval: give exactly one of --data PREPARED or --lm-eval TASKS"),
        ([], "--data/--lm-eval: give exactly one of --data PREPARED or --lm-eval TASKS"),
        (["--lm-eval", " , "], "--lm-eval: name at least one task, e.g. --lm-eval hellaswag,arc_easy"),
    ],
)
def test_bad_lm_eval_input_is_one_line_exit_2(tmp_path, args, message):
    proc = run_cli_in_process(["eval", str(tmp_path), *args], tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr == f"scaletrain: error: {message}\n"


def test_lm_eval_without_the_extra_names_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what find_spec sees when it is not installed
    proc = run_cli_in_process(["eval", str(tmp_path), "--lm-eval", "arc_easy"], tmp_path, check=False)
    assert proc.returncode == 2
    assert (
        proc.stderr
        == "scaletrain: error: --lm-eval: needs lm_eval, which is not installed; pip install 'scaletrain[eval]'\n"
    )
