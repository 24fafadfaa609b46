"""`scaletrain data prepare --format chat|prompt-completion`: the loss mask beside the tokens trains exactly the
assistant turns (content and end-of-turn token) under three real template styles (ChatML as Qwen uses it, Llama 3's
headers, Gemma's turns), rendered by transformers from the tokenizer folder; bad input is one line, exit 2, nothing
written; an interrupted prepare resumes to the same files; the loader turns untrained targets into IGNORE_INDEX;
and a prepared chat dataset trains through `scaletrain train`."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from conftest import run_cli
from scaletrain.cli.main import main
from scaletrain.data import TokenWindows
from scaletrain.data.manifest import read_manifest, verify_shards
from scaletrain.data.prepare import PrepareOptions, prepare
from scaletrain.data.shards import open_prepared
from scaletrain.models.loss import IGNORE_INDEX

WORDS = (
    "hello world what is two plus four six you are a helpful bot please answer the question name my sky blue "
    "why it is because of light . , ? ! yes no thanks or system user assistant model"
).split()

# Qwen2.5's ChatML template without the tool branches: a default system turn when the conversation has none
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nyou are a helpful bot .<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) "
    "or (message.role == 'assistant') %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Meta-Llama-3-8B-Instruct's template
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
# gemma-2-2b-it's template: no system role, strict alternation, the assistant is "model"
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)

# style: (template, special tokens, bos, eos, turn start, header end (ids after the role), turn end, assistant role,
# template in tokenizer_config.json or chat_template.jinja)
STYLES = {
    "chatml": (CHATML, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None, "<|im_end|>", "<|im_start|>",
               ["\n"], "<|im_end|>", "assistant", "config"),
    "llama3": (LLAMA3, ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
               "<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", ["<|end_header_id|>", "\n", "\n"],
               "<|eot_id|>", "assistant", "jinja"),
    "gemma": (GEMMA, ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", "<start_of_turn>",
              ["\n"], "<end_of_turn>", "model", "config"),
}  # fmt: skip

CONVERSATIONS = [
    [
        {"role": "system", "content": "you are a helpful bot"},
        {"role": "user", "content": "what is two plus four ?"},
        {"role": "assistant", "content": "six ."},
    ],
    [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "hello ! what is my name ?"},
        {"role": "user", "content": "why is the sky blue ?"},
        {"role": "assistant", "content": "because of light , thanks"},
    ],
    [{"role": "user", "content": "please answer yes or no"}, {"role": "assistant", "content": "yes"}],
]


def _tokenizer_folder(folder: Path, specials: list[str], eos: str | None, bos: str | None = None) -> Path:
    """A WordLevel tokenizer (one token per word, space, newline or punctuation mark) with the given special
    tokens, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(dict.fromkeys([*specials, "[UNK]", " ", "\n", *WORDS]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s|\w+|[^\w\s]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": bos}
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


def _chat_tokenizer(folder: Path, style: str) -> Path:
    template, specials, bos, eos, *_, where = STYLES[style]
    _tokenizer_folder(folder, specials, eos, bos)
    if where == "jinja":
        (folder / "chat_template.jinja").write_text(template)
    else:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return folder


def _jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _samples(folder: Path, split: str = "train") -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of every sample of a prepared split, read from the files as the format documents them."""
    m = read_manifest(folder)
    out = []
    for s in m.splits[split].shards:
        tokens = np.fromfile(folder / s.tokens, dtype=np.dtype(m.dtype))
        mask = np.fromfile(folder / s.mask, dtype=np.uint8)
        ends = np.fromfile(folder / s.docs, dtype="<i8")
        assert len(mask) == len(tokens) and ends[-1] == len(tokens)
        out += [(tokens[a:b].tolist(), mask[a:b].tolist()) for a, b in zip([0, *ends[:-1]], ends)]
    return out


def _expected_mask(ids: list[int], vocab: dict[str, int], style: str) -> tuple[list[int], list[str]]:
    """The mask the turns' structure calls for, found by walking the ids (not by rendering): 1 on an assistant turn's
    content and its end-of-turn token, 0 elsewhere; and each assistant turn's content ids as text."""
    _, _, _, _, start, header_end, end, assistant, _ = STYLES[style]
    inv = {i: t for t, i in vocab.items()}
    start_id, end_id, header = vocab[start], vocab[end], [vocab[t] for t in header_end]
    mask, answers, k = [0] * len(ids), [], 0
    while k < len(ids):
        if ids[k] != start_id:
            k += 1
            continue
        h = k + 1
        while ids[h : h + len(header)] != header:
            h += 1
        role = "".join(inv[i] for i in ids[k + 1 : h])
        body = h + len(header)
        stop = ids.index(end_id, body)
        if role == assistant:
            mask[body : stop + 1] = [1] * (stop + 1 - body)
            answers.append("".join(inv[i] for i in ids[body:stop]))
        k = stop + 1
    return mask, answers


@pytest.mark.parametrize("style", list(STYLES))
def test_chat_mask_trains_exactly_the_assistant_turns(tmp_path, style):
    tok = _chat_tokenizer(tmp_path / "tok", style)
    # Gemma's template refuses a system turn
    conversations = [c[1:] if style == "gemma" and c[0]["role"] == "system" else c for c in CONVERSATIONS]
    # one conversation from each kind of record input: JSON Lines, gzip JSON Lines, Parquet
    _jsonl(tmp_path / "in" / "a.jsonl", [{"messages": conversations[0], "id": 0}])
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"messages": conversations[1]}) + "\n")
    pq.write_table(pa.table({"messages": [conversations[2]]}), tmp_path / "in" / "c.parquet")
    prepare(PrepareOptions([str(tmp_path / "in")], tmp_path / "out", str(tok), format="chat", val_share=0.0))
    vocab = json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]
    samples = _samples(tmp_path / "out")
    assert len(samples) == len(conversations)
    for (ids, mask), conversation in zip(samples, conversations):
        expected, answers = _expected_mask(ids, vocab, style)
        assert mask == expected, (style, ids, mask)
        assert answers == [m["content"] for m in conversation if m["role"] == "assistant"]
        assert vocab["[UNK]"] not in ids
    m = read_manifest(tmp_path / "out")
    assert m.version == 2 and m.source["format"] == "chat" and m.source["samples_truncated"] == 0
    assert m.splits["train"].num_trained == sum(sum(mask) for _, mask in samples)
    verify_shards(tmp_path / "out", m)


def _trained_runs(ids: list[int], mask: list[int], decode) -> list[str]:
    """The decoded text of each run of trained tokens."""
    runs, k = [], 0
    while k < len(ids):
        j = k
        while j < len(ids) and mask[j] == mask[k]:
            j += 1
        if mask[k]:
            runs.append(decode(ids[k:j]))
        k = j
    return runs


@pytest.mark.parametrize("style", list(STYLES))
def test_byte_level_bpe_masks_whole_answers(tmp_path, style):
    """A byte-level BPE tokenizer like the real models' (its post-processor trims offsets, merges may join the
    newlines after a header): each trained run is exactly one answer and its end-of-turn token."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    template, specials, bos, eos, *_, end, _, _ = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(20)) + "\n\n" for _ in range(200)]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
    )
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": eos, "bos_token": bos, "chat_template": template})
    )
    conversation = [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": " hello !\n what is my name ?"},
        {"role": "user", "content": "why"},
        {"role": "assistant", "content": "because of light , thanks"},
    ]
    _jsonl(tmp_path / "in" / "a.jsonl", [{"messages": conversation}])
    prepare(PrepareOptions([str(tmp_path / "in")], tmp_path / "out", str(folder), format="chat", val_share=0.0))
    [(ids, mask)] = _samples(tmp_path / "out")
    trim = style != "chatml"  # Llama 3 and Gemma trim the content, ChatML keeps it as it is
    answers = [m["content"].strip() if trim else m["content"] for m in conversation if m["role"] == "assistant"]
    assert _trained_runs(ids, mask, lambda t: tok.decode(t, skip_special_tokens=False)) == [a + end for a in answers]


def test_prompt_completion_with_and_without_a_template_and_overlong_samples(tmp_path):
    rows = [
        {"q": "what is two plus four ?", "a": "six"},
        {"q": "why is the sky blue ?", "a": "because of light"},
        {"q": "hello world " * 8, "a": "yes"},  # 8 x 4 tokens of prompt: over --max-tokens 20
    ]
    pq.write_table(pa.table({"q": [r["q"] for r in rows], "a": [r["a"] for r in rows]}), tmp_path / "qa.parquet")
    runner = CliRunner()
    common = ["--format", "prompt-completion", "--prompt-key", "q", "--completion-key", "a", "--val-share", "0"]

    # with a chat template: the prompt is a user turn, the completion the assistant turn
    tok = _chat_tokenizer(tmp_path / "chatml", "chatml")
    result = runner.invoke(main, ["data", "prepare", str(tmp_path / "qa.parquet"), "--out", str(tmp_path / "t"),
                                  "--tokenizer", str(tok), *common])  # fmt: skip
    assert result.exit_code == 0, result.output
    vocab = json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"]
    for (ids, mask), row in zip(_samples(tmp_path / "t"), rows):
        expected, answers = _expected_mask(ids, vocab, "chatml")
        assert mask == expected and answers == [row["a"]]

    # without one: prompt and completion concatenated, loss on the completion and the EOS after it
    plain = _tokenizer_folder(tmp_path / "plain", ["<|endoftext|>"], "<|endoftext|>")
    result = runner.invoke(main, ["data", "prepare", str(tmp_path / "qa.parquet"), "--out", str(tmp_path / "p"),
                                  "--tokenizer", str(plain), *common, "--max-tokens", "20", "--overlong", "drop"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "dropped 1" in result.output
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(plain / "tokenizer.json"))
    samples = _samples(tmp_path / "p")
    assert len(samples) == 2
    for (ids, mask), row in zip(samples, rows):
        prompt, answer = t.encode(row["q"]).ids, t.encode(row["a"]).ids
        assert ids == prompt + answer + [t.token_to_id("<|endoftext|>")]
        assert mask == [0] * len(prompt) + [1] * (len(answer) + 1)
    assert read_manifest(tmp_path / "p").source["samples_dropped_overlong"] == 1

    # --overlong truncate keeps the long sample's first 20 tokens; it has no trained token left, so it is dropped
    result = runner.invoke(main, ["data", "prepare", str(tmp_path / "qa.parquet"), "--out", str(tmp_path / "c"),
                                  "--tokenizer", str(plain), *common, "--max-tokens", "20"])  # fmt: skip
    assert result.exit_code == 0, result.output
    src = read_manifest(tmp_path / "c").source
    assert (src["samples_truncated"], src["samples_dropped_untrained"], src["max_tokens"]) == (1, 1, 20)

    # inspect marks the untrained text and counts the trained tokens
    result = runner.invoke(main, ["data", "inspect", str(tmp_path / "t")])
    assert result.exit_code == 0, result.output
    ids, mask = _samples(tmp_path / "t")[0]
    assert f"trained: {sum(mask)} of {len(ids)}" in result.output
    assert "[<|im_start|>system\nyou are a helpful bot .<|im_end|>\n<|im_start|>user\nwhat is two plus four ?" in (
        result.output
    )
    assert "<|im_start|>assistant\n]six<|im_end|>[\n]" in result.output


def _bad(tmp: Path) -> dict:
    chatml = _chat_tokenizer(tmp / "chatml", "chatml")
    gemma = _chat_tokenizer(tmp / "gemma", "gemma")
    plain = _tokenizer_folder(tmp / "plain", ["<|endoftext|>"], "<|endoftext|>")
    good = {"messages": CONVERSATIONS[2]}
    pq.write_table(pa.table({"messages": [CONVERSATIONS[2], None]}), _jsonl(tmp / "pq" / "a.parquet", []))
    return {
        "row without messages": (
            [_jsonl(tmp / "a" / "c.jsonl", [good, good, {"msgs": []}]), "--tokenizer", chatml, "--workers", "2"],
            "c.jsonl: line 3: no 'messages' key (keys: msgs); pass --messages-key",
        ),
        "null messages in a Parquet row": (
            [tmp / "pq" / "a.parquet", "--tokenizer", chatml],
            "a.parquet: row index 1 (from 0): 'messages' is null",
        ),
        "a role the template refuses": (
            [_jsonl(tmp / "b" / "c.jsonl", [good, {"messages": CONVERSATIONS[0]}]), "--tokenizer", gemma],
            "c.jsonl: line 2: the chat template refuses this conversation: System role not supported",
        ),
        "no chat template": ([tmp / "a" / "c.jsonl", "--tokenizer", plain], "no chat template"),
        "missing completion key": (
            [
                _jsonl(tmp / "d" / "c.jsonl", [{"prompt": "hello"}]),
                "--format",
                "prompt-completion",
                "--tokenizer",
                plain,
            ],
            "c.jsonl: line 1: no 'completion' key (keys: prompt)",
        ),  # fmt: skip
        "a plain-text input": ([_jsonl(tmp / "e" / "c.txt", ["hello"]), "--tokenizer", chatml], "a plain-text file"),
        "--max-tokens with text": (
            [tmp / "e" / "c.txt", "--format", "text", "--max-tokens", "9", "--tokenizer", "bytes"],
            "--max-tokens: applies to --format chat",
        ),  # fmt: skip
    }


def test_bad_chat_input_is_one_line_exit_2_nothing_written(tmp_path):
    for name, (args, message) in _bad(tmp_path).items():
        out = tmp_path / "out"
        args = [str(a) for a in args]
        if "--format" not in args:
            args += ["--format", "chat"]
        result = CliRunner().invoke(main, ["data", "prepare", *args, "--out", str(out), "--shard-tokens", "1"])
        assert result.exit_code == 2, (name, result.output)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("scaletrain: error: ") and message in lines[0], (name, lines)
        assert not out.exists(), name


def test_interrupted_prepare_resumes_to_identical_files_and_the_loader_masks_targets(tmp_path):
    tok = _chat_tokenizer(tmp_path / "tok", "llama3")
    rows = [{"messages": CONVERSATIONS[i % 3]} for i in range(60)]
    _jsonl(tmp_path / "in" / "a.jsonl", rows[:30])
    _jsonl(tmp_path / "in" / "b.jsonl", rows[30:])

    def opts(out: str) -> PrepareOptions:
        return PrepareOptions([str(tmp_path / "in")], tmp_path / out, str(tok), format="chat", val_share=0.1,
                              shard_tokens=150, piece_bytes=2000)  # fmt: skip

    whole = prepare(opts("whole"))
    assert len(whole.manifest.splits["train"].shards) > 3

    class Stop(Exception):
        pass

    def stop_late(done: int, total: int, tokens: int) -> None:
        if done > total // 2:
            raise Stop

    with pytest.raises(Stop):
        prepare(opts("cut"), on_progress=stop_late)
    assert not (tmp_path / "cut" / "manifest.json").exists()
    again = prepare(dataclasses.replace(opts("cut"), workers=2))  # the output does not depend on --workers
    assert again.resumed_from_piece > 0
    names = sorted(p.relative_to(tmp_path / "whole") for p in (tmp_path / "whole").rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(tmp_path / "cut") for p in (tmp_path / "cut").rglob("*") if p.is_file())
    assert any(n.suffix == ".mask" for n in names)
    for n in names:
        assert (tmp_path / "whole" / n).read_bytes() == (tmp_path / "cut" / n).read_bytes(), n

    # the loader: a target is IGNORE_INDEX exactly where the mask says untrained
    _, streams = open_prepared(tmp_path / "whole")
    flat = [(i, m) for ids, mask in _samples(tmp_path / "whole") for i, m in zip(ids, mask)]
    ids, mask = np.array([i for i, _ in flat]), np.array([m for _, m in flat])
    windows = TokenWindows(streams["train"], seq_len=16)
    batch = windows.gather(np.arange(windows.num_samples))
    for r in range(windows.num_samples):
        span = slice(r * 16 + 1, r * 16 + 17)
        assert batch.inputs[r].tolist() == ids[r * 16 : r * 16 + 16].tolist()
        assert batch.targets[r].tolist() == np.where(mask[span] == 1, ids[span], IGNORE_INDEX).tolist()
    assert batch.trained_tokens == int(mask[1 : windows.num_samples * 16 + 1].sum()) > 0


def test_prepared_chat_dataset_trains(tmp_path):
    tok = _chat_tokenizer(tmp_path / "tok", "chatml")
    _jsonl(tmp_path / "in" / "a.jsonl", [{"messages": CONVERSATIONS[i % 3]} for i in range(40)])
    result = CliRunner().invoke(main, ["data", "prepare", str(tmp_path / "in"), "--out", str(tmp_path / "ds"),
                                       "--tokenizer", str(tok), "--format", "chat", "--val-share", "0.2"])  # fmt: skip
    assert result.exit_code == 0, result.output
    vocab = read_manifest(tmp_path / "ds").tokenizer.vocab_size
    proc = run_cli(
        [
            "train",
            f"data.path={tmp_path / 'ds'}",
            f"model.vocab_size={vocab}",
            "data.seq_len=32",
            "train.global_batch_size=4",
            "train.steps=2",
            "train.warmup_steps=1",
            "train.eval_batches=1",
            "monitor.log_interval=1",
            "monitor.progress=false",
            "--nproc-per-node",
            "1",
        ],
        tmp_path,
        timeout=300,
    )
    assert "step 2/2  loss" in proc.stdout + proc.stderr and "validation loss" in proc.stdout + proc.stderr
