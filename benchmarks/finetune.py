"""Supervised fine-tuning on packed chat data, LoRA against full fine-tuning: the same model, data and layout
through `scaletrain train` (FSDP2 on --nproc CPU ranks by default), runs alternating full, lora, full, lora ... so
drift on a shared machine hits both. The data is synthetic chat (a ChatML template, a word-level tokenizer written
here, conversations of varied length) prepared by `scaletrain data prepare --format chat` and packed with
`data.packing=document` (attention within each conversation, loss on the assistant turns only).

Per variant: the median step time (the first logged step dropped as warm-up), trained tokens per second, the peak
memory per rank the monitor records (GPU: max_memory_allocated; CPU: peak RSS, an upper bound with the
interpreter's own ~0.3-0.5 GB in it), and the planner's model-state bytes per rank for the same layout (exact:
tests/test_plan_lora.py checks them against the trainer's tensors); then the ratios lora / full.

    python benchmarks/finetune.py [--nproc 2] [--dim 512 --layers 8] [--lora-rank 8] [--steps 12] [--reps 2]
                                  [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHATML = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
WORDS = [f"w{i}" for i in range(200)] + ["user", "assistant", "system"]
FOOTER = (
    "Step times come from CPU cores shared with other jobs: read the ratios, not the seconds. On CPU ranks the "
    "monitor's peak memory is the process's peak RSS over its whole life, reached while the weights are filled by "
    "name before sharding (the same for both variants) and holding the interpreter and torch, so it does not show "
    "what LoRA saves during the steps; the planner's model-state bytes are the exact difference (fp32 weights of "
    "the frozen base, gradients and AdamW states of the adapters only). On GPUs the monitor reports "
    "max_memory_allocated."
)


def _tokenizer(folder: Path) -> Path:
    """A word-level tokenizer with ChatML's special tokens and chat template, as a Hugging Face folder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(dict.fromkeys([*SPECIALS, "[UNK]", " ", "\n", *WORDS]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\s|\w+|[^\w\s]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def _chat_data(work: Path, conversations: int, seed: int = 0) -> tuple[Path, int]:
    """Prepared chat data (and its vocabulary size): a user turn of 4-40 words, an answer of 4-60."""
    rng = random.Random(seed)
    rows = []
    for _ in range(conversations):
        ask = " ".join(rng.choice(WORDS[:200]) for _ in range(rng.randint(4, 40)))
        answer = " ".join(rng.choice(WORDS[:200]) for _ in range(rng.randint(4, 60)))
        rows.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]})
    src = work / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = _tokenizer(work / "tok")
    out = work / "chat"
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "data", "prepare", str(src), "--out", str(out)]
    cmd += ["--tokenizer", str(tok), "--format", "chat", "--val-share", "0.05"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    vocab = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"])
    return out, vocab


def _train(a, work: Path, data: Path, vocab: int, name: str, lora: list[str]) -> list[dict]:
    """One `scaletrain train` run; its metrics records with a step time (the first dropped as warm-up)."""
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "train", f"data.path={data}", "data.packing=document"]
    cmd += [f"model.vocab_size={vocab}", f"model.dim={a.dim}", f"model.n_layers={a.layers}"]
    cmd += [f"model.n_heads={max(1, a.dim // 64)}", f"model.n_kv_heads={max(1, a.dim // 256)}"]
    cmd += [f"model.ffn_dim={int(a.dim * 2.75) // 64 * 64}", f"model.max_seq_len={a.seq_len}"]
    cmd += [f"data.seq_len={a.seq_len}", f"train.global_batch_size={a.global_batch}", f"train.steps={a.steps}"]
    cmd += ["monitor.log_interval=1", "monitor.progress=false", "monitor.sample_interval_s=0", "train.eval_interval=0"]
    cmd += ["monitor.tensorboard=false", "checkpoint.save_final=false", f"run.name={name}", f"run.output_dir={work}"]
    cmd += [*lora, "--nproc-per-node", str(a.nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=work)
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step_time_s" in r][1:]


def _model_states(a, vocab: int, lora_rank: int) -> float:
    """The planner's model-state bytes per rank (parameters, gradients, AdamW states) of the run's layout."""
    from scaletrain.models.llama.args import LlamaArgs
    from scaletrain.plan.lora import lora_shape
    from scaletrain.plan.memory import trainer_model_state_bytes

    shape = LlamaArgs(
        dim=a.dim,
        n_layers=a.layers,
        n_heads=max(1, a.dim // 64),
        n_kv_heads=max(1, a.dim // 256),
        ffn_dim=int(a.dim * 2.75) // 64 * 64,
        vocab_size=vocab,
        max_seq_len=a.seq_len,
    )
    lora = lora_shape(lora_rank) if lora_rank else None
    return sum(trainer_model_state_bytes(shape, dp_shard=a.nproc, seq_len=a.seq_len, lora=lora).values())


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--markdown", type=Path, default=None)
    a = ap.parse_args(argv)
    lora_args = [f"lora.rank={a.lora_rank}", f"lora.alpha={2 * a.lora_rank}"]
    runs: dict[str, list[dict]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, vocab = _chat_data(work, a.conversations)
        for rep in range(a.reps):
            runs["full"] += _train(a, work, data, vocab, f"full{rep}", [])
            runs["lora"] += _train(a, work, data, vocab, f"lora{rep}", lora_args)
    figures = {}
    for variant, rows in runs.items():
        step = statistics.median(r["step_time_s"] for r in rows)
        trained = statistics.median(r["tokens_per_s"] for r in rows)  # chat data: trained tokens only
        peak = max(max(r["peak_mem_bytes_per_rank"]) for r in rows)
        states = _model_states(a, vocab, a.lora_rank if variant == "lora" else 0)
        figures[variant] = (step, trained, peak, states)
    lines = [
        "| variant | median step (ms) | trained tokens/s | peak memory/rank (GB) | model states/rank (MB, planner) |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant, (step, trained, peak, states) in figures.items():
        lines.append(f"| {variant} | {step * 1e3:.1f} | {trained:,.0f} | {peak / 1e9:.3f} | {states / 1e6:.1f} |")
    full, lora = figures["full"], figures["lora"]
    lines.append(
        f"| lora / full | {lora[0] / full[0]:.3f} | {lora[1] / full[1]:.3f} | {lora[2] / full[2]:.3f} | "
        f"{lora[3] / full[3]:.3f} |"
    )
    header = (
        f"Llama dim {a.dim}, {a.layers} layers, vocab {vocab}; {a.nproc} rank(s), FSDP2; {a.steps} steps x "
        f"{a.global_batch} x {a.seq_len} tokens, packed chat (data.packing=document); LoRA rank {a.lora_rank} on "
        f"the attention and MLP projections; {a.reps} alternating reps"
    )
    report = "\n".join([header, "", *lines])
    print(report)
    if a.markdown is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        import sections  # the shared BENCHMARKS.md section writer
        from peers import machine  # the machine line every benchmark report carries

        sections.write_section(
            a.markdown,
            "## Fine-tuning: LoRA against full, packed chat data",
            "benchmarks/finetune.py",
            argv,
            [header, "", *lines, ""],
            machine(),
            footer=FOOTER,
        )
    return report


if __name__ == "__main__":
    main()
