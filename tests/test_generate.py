"""`scaletrain generate` and `scaletrain eval`: a tiny model fine-tuned here on a synthetic chat task (the colour of
a thing, asked three ways) answers held-out phrasings through `generate --chat`; `eval` gives the trainer's own
validation loss on the same data; `train.sample_prompts` are answered at each evaluation into metrics.jsonl,
TensorBoard and the report; bad input is one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import run_cli
from scaletrain.cli.main import main
from scaletrain.monitor.metrics import read_jsonl

# Qwen2.5's ChatML template without the tool branches (as tests/test_data_chat.py writes it)
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nyou are a helpful bot .<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
COLOURS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "blood": "red", "sun": "yellow"}
ASKS = ("what is the colour of the {} ?", "tell me the colour of the {} .", "which colour is the {} ?")
HELD_OUT = {ASKS[2].format("sky"): "blue .", ASKS[1].format("coal"): "black .", ASKS[0].format("sun"): "yellow ."}
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = sorted({w for a in ASKS for w in a.split()} | set(COLOURS) | set(COLOURS.values()))
WORDS += "you are a helpful bot system user assistant".split()


def _tokenizer(folder: Path, template: str | None = CHATML) -> Path:
    """A WordLevel tokenizer (one token per word, space, newline or mark) with ChatML's special tokens, saved as a
    Hugging Face tokenizer folder (with the chat template unless None)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(dict.fromkeys([*SPECIALS, "[UNK]", " ", "\n", *WORDS, ".", "?"]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s|\w+|[^\w\s]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _conversations(repeat: int) -> list[dict]:
    rows = []
    for _ in range(repeat):
        for thing, colour in COLOURS.items():
            for ask in ASKS:
                if ask.format(thing) not in HELD_OUT:
                    question = ask.format(thing)
                    rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": f"{colour} ."}]})  # fmt: skip
    return rows


def _prepare(tmp: Path, name: str, rows: list[dict], tok: Path, val_share: str) -> Path:
    src = tmp / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / name
    result = CliRunner().invoke(main, ["data", "prepare", str(src), "--out", str(out), "--tokenizer", str(tok),
                                       "--format", "chat", "--val-share", val_share])  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


TRAIN = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.max_seq_len=64",
    "data.seq_len=64",
    "train.global_batch_size=8",
    "train.lr=3e-3",
    "train.warmup_steps=10",
    "train.weight_decay=0.0",
    "monitor.progress=false",
    "checkpoint.save_final=true",
    "checkpoint.async_save=false",
    "--nproc-per-node",
    "1",
]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("chat")
    tok = _tokenizer(tmp / "tok")
    data = _prepare(tmp, "colours", _conversations(12), tok, "0.1")
    vocab = json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]
    run = tmp / "runs" / "colours"
    prompts = list(HELD_OUT)[:2]
    run_cli(["train", f"data.path={data}", f"model.vocab_size={len(vocab)}", "train.steps=150",
             "train.eval_interval=75", "train.eval_batches=1", "monitor.log_interval=25", "monitor.tensorboard=true",
             f"run.output_dir={tmp / 'runs'}", "run.name=colours", f"train.sample_prompts={json.dumps(prompts)}",
             *TRAIN], tmp, timeout=300)  # fmt: skip
    return {"tmp": tmp, "tok": tok, "data": data, "run": run, "vocab": len(vocab), "prompts": prompts}


def _generate(args: list[str]) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["generate", *args])
    return result.exit_code, result.stdout, result.stderr


def test_fine_tuned_model_answers_held_out_prompts(chat_run):
    run = chat_run["run"]
    for question, answer in HELD_OUT.items():
        code, out, err = _generate([str(run), "--chat", question, "--max-new-tokens", "8"])
        assert code == 0, err
        assert out == answer + "\n", (question, out)
    # one checkpoint folder, a system turn, and sampling at a low temperature give the same answer
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    code, out, err = _generate([str(ckpt), "--chat", ASKS[0].format("grass"), "--system", "you are a helpful bot .",
                                "--temperature", "0.01", "--seed", "3"])  # fmt: skip
    assert (code, out) == (0, "green .\n"), err
    # --prompt continues plain text: the rendered conversation without the answer
    prompt = f"<|im_start|>system\nyou are a helpful bot .<|im_end|>\n<|im_start|>user\n{ASKS[0].format('snow')}<|im_end|>\n<|im_start|>assistant\n"  # fmt: skip
    code, out, err = _generate([str(run), "--prompt", prompt, "--max-new-tokens", "3"])
    assert (code, out) == (0, "white .\n"), err


def test_sample_prompts_are_answered_into_metrics_tensorboard_and_report(chat_run):
    run = chat_run["run"]
    evaluations = [r for r in read_jsonl(run / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evaluations] == [75, 150]
    for record in evaluations:
        assert [s["prompt"] for s in record["samples"]] == chat_run["prompts"]
    last = evaluations[-1]["samples"]
    assert [s["answer"] for s in last] == [HELD_OUT[p] for p in chat_run["prompts"]]
    events = b"".join(p.read_bytes() for p in (run / "tensorboard").glob("events.*"))
    assert b"samples/prompt1" in events and b"black ." in events
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    html = (run / "report.html").read_text()
    assert "Sample answers" in html and "<th>step 150</th>" in html and "tell me the colour of the coal ." in html


def test_generate_from_an_exported_hugging_face_folder(chat_run):
    out = chat_run["tmp"] / "hf"
    result = CliRunner().invoke(main, ["ckpt", "export", str(chat_run["run"]), "--format", "hf", "--out", str(out)])
    assert result.exit_code == 0, result.output
    question = ASKS[1].format("blood")
    code, text, err = _generate([str(out), "--chat", question, "--tokenizer", str(chat_run["tok"])])
    assert (code, text) == (0, "red .\n"), err


def _eval_line(args: list[str]) -> dict[str, float]:
    result = CliRunner().invoke(main, ["eval", *args])
    assert result.exit_code == 0, result.output
    words = result.stdout.split()
    return {"loss": float(words[1]), "perplexity": float(words[3]), "trained": int(words[5])}


def test_eval_equals_the_trainers_validation_loss(chat_run):
    import math

    import numpy as np

    from scaletrain.data import TokenWindows
    from scaletrain.data.shards import open_prepared

    tmp = chat_run["tmp"]
    # plain text of the same task: every target trained, so the trainer's count is the trained tokens
    docs = [{"text": f"{ask.format(t)} {c} ."} for t, c in COLOURS.items() for ask in ASKS] * 6
    src = tmp / "text.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    result = CliRunner().invoke(main, ["data", "prepare", str(src), "--out", str(tmp / "text"), "--tokenizer",
                                       str(chat_run["tok"]), "--val-share", "0.2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    _, streams = open_prepared(tmp / "text")
    windows = TokenWindows(streams["val"], 32).num_samples
    assert windows >= 2
    run_cli(["train", f"data.path={tmp / 'text'}", f"model.vocab_size={chat_run['vocab']}", "train.steps=3",
             f"train.eval_batches={windows}", f"run.output_dir={tmp / 'runs'}", "run.name=text", *TRAIN,
             "train.global_batch_size=1", "data.seq_len=32"], tmp, timeout=300)  # fmt: skip
    val_loss = json.loads((tmp / "runs" / "text" / "summary.json").read_text())["val_loss"]
    got = _eval_line([str(tmp / "runs" / "text"), "--data", str(tmp / "text"), "--batch-size", "3"])
    assert got["loss"] == pytest.approx(val_loss, rel=1e-5, abs=1e-6)
    assert got["trained"] == windows * 32 and got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-4)

    # chat data: only the assistant tokens count, on the validation split or the training split
    _, chat_streams = open_prepared(chat_run["data"])
    for split in ("val", "train"):
        w = TokenWindows(chat_streams[split], 64)
        trained = w.gather(np.arange(w.num_samples)).trained_tokens
        got = _eval_line([str(chat_run["run"]), "--data", str(chat_run["data"]), "--split", split])
        assert got["trained"] == trained < w.num_samples * 64
        assert got["loss"] < 0.5  # the answers are learnt: far below a uniform guess's ln(37)


def test_bad_input_is_one_line_exit_2(chat_run, tmp_path):
    no_ckpt = tmp_path / "runs" / "empty"
    no_ckpt.mkdir(parents=True)
    (no_ckpt / "config.toml").write_text("[train]\nsteps = 1\n")
    plain = _tokenizer(tmp_path / "plain", template=None)
    run = str(chat_run["run"])
    cases = {
        "run without a checkpoint": ([str(no_ckpt), "--prompt", "hi"], "has no committed checkpoint"),
        "tokenizer without a chat template": ([run, "--chat", "hi", "--tokenizer", str(plain)], "no chat template"),
        "both --prompt and --chat": ([run, "--prompt", "a", "--chat", "b"], "exactly one of --prompt"),
        "neither": ([run], "exactly one of --prompt"),
        "unknown PATH": ([str(tmp_path / "nowhere"), "--prompt", "hi"], "does not exist"),
        "a folder holding no model": ([str(plain), "--prompt", "hi"], "is not a run folder"),
    }
    for name, (args, message) in cases.items():
        code, out, err = _generate(args)
        lines = err.strip().splitlines()
        assert code == 2 and not out, (name, out, err)
        assert len(lines) == 1 and lines[0].startswith("scaletrain: error: ") and message in lines[0], (name, err)
    result = CliRunner().invoke(main, ["eval", run, "--data", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.output


def test_sample_prompts_on_two_fsdp_ranks(tmp_path):
    """The weights are gathered from both shards onto rank 0, which answers (byte-level stdlib data: bytes)."""
    run_cli(["train", "data.source=stdlib", "data.max_bytes=200000", "model.vocab_size=256", "train.steps=2",
             "train.eval_batches=1", "parallel.dp_shard=2", f"run.output_dir={tmp_path}", "run.name=fsdp",
             "train.sample_prompts=[\"def \"]", "train.sample_tokens=5", *TRAIN[:-2], "checkpoint.save_final=false",
             "--nproc-per-node", "2"], tmp_path, timeout=300)  # fmt: skip
    [record] = [r for r in read_jsonl(tmp_path / "fsdp" / "metrics.jsonl") if "val_loss" in r]
    [sample] = record["samples"]
    assert sample["prompt"] == "def " and isinstance(sample["answer"], str) and sample["answer"]


def test_a_hf_family_run_generates_as_transformers_own_model(chat_run, tmp_path):
    """model.hf=FOLDER (Qwen3, tied embeddings): the completion from the run's checkpoint, built in memory, is the
    one transformers' from_pretrained + generate give on the exported folder."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, vocab_size=chat_run["vocab"], max_position_embeddings=64,
                  tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3", **fields)).save_pretrained(tmp_path / "qwen3")
    run_cli(["train", f"model.hf={tmp_path / 'qwen3'}", f"data.path={chat_run['data']}", "data.seq_len=64",
             "train.steps=3", "train.global_batch_size=4", "train.eval_batches=1", "monitor.progress=false",
             "checkpoint.save_final=true", "checkpoint.async_save=false", f"run.output_dir={tmp_path}",
             "run.name=qwen3", "--nproc-per-node", "1"], tmp_path, timeout=300)  # fmt: skip
    question = ASKS[0].format("snow")
    code, ours, err = _generate([str(tmp_path / "qwen3"), "--chat", question, "--max-new-tokens", "6"])
    assert code == 0, err
    result = CliRunner().invoke(main, ["ckpt", "export", str(tmp_path / "qwen3"), "--format", "hf", "--out",
                                       str(tmp_path / "export")])  # fmt: skip
    assert result.exit_code == 0, result.output
    tok = PreTrainedTokenizerFast.from_pretrained(str(chat_run["tok"]))
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                         eos_token_id=[end], pad_token_id=end)[0, ids.shape[1]:].tolist()  # fmt: skip
    assert ours == tok.decode(out, skip_special_tokens=True) + "\n"
