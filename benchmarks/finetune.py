"""Supervised fine-tuning on chat data, three comparisons on the same data and layout through `scaletrain train`
(FSDP2 on --nproc CPU ranks by default), the variants alternating within each rep so drift on a shared machine hits
all of them. The data is synthetic chat (a ChatML template, a word-level tokenizer written here, conversations
averaging under a quarter of the sequence) prepared by `scaletrain data prepare --format chat` (loss on the
assistant turns only).

1. Packed against padded: trained tokens per second with `data.packing=document` (several conversations per row,
   attention within each) and `data.packing=pad` (one conversation per row), full fine-tuning.
2. LoRA and QLoRA (a 4-bit NF4 base) against full fine-tuning, packed: the median step time (the first logged step dropped as warm-up), trained
   tokens per second, the peak memory per rank the monitor records (GPU: max_memory_allocated; CPU: peak RSS, an
   upper bound with the interpreter's own ~0.3-0.5 GB in it), and the planner's model-state bytes per rank for the
   same layout (exact: tests/test_plan_lora.py checks them against the trainer's tensors).
3. scaletrain against TRL's SFTTrainer (its packing, loss on the completion), the same Hugging Face Llama folder
   (same initial weights), the same conversations, learning rate, AdamW settings and clipping, on the same number of
   CPU ranks (torchrun, DDP over gloo): median step time and the two loss curves. Skipped, with the reason, when trl
   is not installed (the bench extra).

    python benchmarks/finetune.py [--nproc 2] [--dim 512 --layers 8] [--seq-len 512] [--lora-rank 8] [--steps 12]
                                  [--reps 2] [--no-trl] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
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
    "name before sharding (about the same for every variant) and holding the interpreter and torch, so it does not "
    "show what LoRA saves during the steps; the planner's model-state bytes are the exact difference (fp32 weights "
    "of the frozen base, or its 4-bit NF4 copy for QLoRA, gradients and AdamW states of the adapters only; tested "
    "against the trainer's tensors). QLoRA's steps on a CPU pay for dequantizing each 4-bit weight in every "
    "forward and backward. On GPUs the monitor reports max_memory_allocated. Against TRL: each trainer draws, "
    "shuffles and packs its own batches from the same conversations (TRL's best-fit packing and sampler, "
    "scaletrain's data.packing=document and loader), so the per-step losses are of different batches and the "
    "curves are compared by their level, not step for step."
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


def _chat_data(work: Path, conversations: int, seed: int = 0) -> tuple[Path, Path, int, float]:
    """Prepared chat data, its JSONL source, its vocabulary size and the mean tokens per conversation: a user turn
    of 2-20 words, an answer of 2-30 (each word and each space a token: ~60 tokens with the template's)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(conversations):
        ask = " ".join(rng.choice(WORDS[:200]) for _ in range(rng.randint(2, 20)))
        answer = " ".join(rng.choice(WORDS[:200]) for _ in range(rng.randint(2, 30)))
        rows.append({"messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]})
    src = work / "chat.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = _tokenizer(work / "tok")
    out = work / "chat"
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "data", "prepare", str(src), "--out", str(out)]
    cmd += ["--tokenizer", str(tok), "--format", "chat", "--val-share", "0.05"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    vocab = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tok))
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in rows[:200]]
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return out, src, vocab, statistics.mean(lengths)


def _model_args(a, vocab: int) -> dict:
    """The benchmark's Llama shape, in the built-in family's [model] keys."""
    return {
        "vocab_size": vocab,
        "dim": a.dim,
        "n_layers": a.layers,
        "n_heads": max(1, a.dim // 64),
        "n_kv_heads": max(1, a.dim // 256),
        "ffn_dim": int(a.dim * 2.75) // 64 * 64,
        "max_seq_len": a.seq_len,
    }


def _hf_folder(a, work: Path, vocab: int) -> Path:
    """The same Llama shape as a Hugging Face folder (seeded random weights, safetensors) with the tokenizer: what
    scaletrain (model.hf=FOLDER) and TRL both start from."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = _model_args(a, vocab)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=m["dim"],
        num_hidden_layers=m["n_layers"],
        num_attention_heads=m["n_heads"],
        num_key_value_heads=m["n_kv_heads"],
        intermediate_size=m["ffn_dim"],
        max_position_embeddings=a.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    folder = work / "hf_llama"
    LlamaForCausalLM(config).save_pretrained(folder)
    for f in (work / "tok").iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


# the optimizer settings both trainers of comparison 3 run with (TRL's AdamW defaults, a constant learning rate)
SAME_OPTIM = {"lr": 1e-3, "weight_decay": 0.0, "beta1": 0.9, "beta2": 0.999, "grad_clip": 1.0}


def _train(a, work: Path, data: Path, vocab: int, name: str, extra: list[str]) -> list[dict]:
    """One `scaletrain train` run (the built-in Llama, packed, unless `extra` says otherwise); its metrics records
    with a step time (the first dropped as warm-up)."""
    cmd = [sys.executable, "-m", "scaletrain.cli.main", "train", f"data.path={data}", "data.packing=document"]
    if not any(x.startswith("model.hf=") for x in extra):
        cmd += [f"model.{k}={v}" for k, v in _model_args(a, vocab).items()]
    cmd += [f"data.seq_len={a.seq_len}", f"train.global_batch_size={a.global_batch}", f"train.steps={a.steps}"]
    cmd += ["monitor.log_interval=1", "monitor.progress=false", "monitor.sample_interval_s=0", "train.eval_interval=0"]
    cmd += ["monitor.tensorboard=false", "checkpoint.save_final=false", f"run.name={name}", f"run.output_dir={work}"]
    cmd += [*extra, "--nproc-per-node", str(a.nproc)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=work)
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "step_time_s" in r][1:]


def _trl_missing() -> str | None:
    """Why TRL's row cannot run here, or None."""
    try:
        import trl  # noqa: F401
    except ImportError:
        return "trl is not installed (pip install 'scaletrain[bench]')"
    return None


def _trl_worker(job: dict) -> None:
    """One rank of TRL's SFTTrainer (launched by torchrun: transformers' Trainer runs DDP over gloo on CPU ranks):
    the conversations as conversational prompt-completion rows (loss on the completion), packed; rank 0 writes the
    step times and losses to job['out']."""
    import time

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    rows = [json.loads(x) for x in Path(job["data"]).read_text().splitlines()]
    ds = Dataset.from_list([{"prompt": r["messages"][:1], "completion": r["messages"][1:]} for r in rows])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    tokenizer.pad_token = "<|endoftext|>"
    times: list[float] = []
    losses: list[float] = []

    class Record(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    o = SAME_OPTIM
    cfg = SFTConfig(
        output_dir=job["work"],
        max_length=job["seq_len"],
        packing=True,
        completion_only_loss=True,
        per_device_train_batch_size=job["per_rank_batch"],
        gradient_accumulation_steps=1,
        max_steps=job["steps"],
        learning_rate=o["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=o["weight_decay"],
        adam_beta1=o["beta1"],
        adam_beta2=o["beta2"],
        max_grad_norm=o["grad_clip"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        seed=0,
        bf16=False,
        disable_tqdm=True,
    )
    trainer = SFTTrainer(
        model=job["model"], args=cfg, train_dataset=ds, processing_class=tokenizer, callbacks=[Record()]
    )
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        Path(job["out"]).write_text(json.dumps({"step_times": times, "losses": losses}))


def _trl(a, work: Path, src: Path, folder: Path, name: str) -> dict:
    """One TRL run on a.nproc ranks; its step times (the first dropped as warm-up) and losses."""
    job = {
        "data": str(src),
        "model": str(folder),
        "seq_len": a.seq_len,
        "per_rank_batch": a.global_batch // a.nproc,
        "steps": a.steps,
        "work": str(work / name),
        "out": str(work / f"{name}.json"),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(a.nproc), "--standalone"]
    cmd += [__file__, "--trl-worker", json.dumps(job)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # its own session: a run past the time limit is ended with its ranks
    proc = subprocess.Popen(
        cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        proc.wait(timeout=a.trl_timeout)
    except subprocess.TimeoutExpired:
        # torchrun's ranks run in sessions of their own: end them by their parent, then torchrun's group
        subprocess.run(["pkill", "-KILL", "-P", str(proc.pid)], check=False)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return {"failed": f"did not finish within {a.trl_timeout:.0f} s"}
    if proc.returncode:
        return {"failed": f"exited with {proc.returncode}"}
    got = json.loads(Path(job["out"]).read_text())
    return {"step_times": got["step_times"][1:], "losses": got["losses"]}


def _model_states(a, vocab: int, lora_rank: int, quantize: str = "none") -> float:
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
    lora = lora_shape(lora_rank, quantize=quantize) if lora_rank else None
    return sum(trainer_model_state_bytes(shape, dp_shard=a.nproc, seq_len=a.seq_len, lora=lora).values())


def _same_optim_args(nproc: int) -> list[str]:
    """scaletrain's settings for comparison 3: TRL's optimizer and its layout (DDP over every rank)."""
    o = SAME_OPTIM
    return [
        f"train.lr={o['lr']}",
        "train.warmup_steps=0",
        "train.min_lr_ratio=1.0",
        f"train.weight_decay={o['weight_decay']}",
        f"train.beta1={o['beta1']}",
        f"train.beta2={o['beta2']}",
        f"train.grad_clip={o['grad_clip']}",
        "parallel.dp_shard=1",
        f"parallel.dp_replicate={nproc}",
    ]


def _median_step(rows: list[dict]) -> float:
    return statistics.median(r["step_time_s"] for r in rows)


def _trained_per_s(rows: list[dict]) -> float:
    return statistics.median(r["tokens_per_s"] for r in rows)  # chat data: trained tokens only


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--no-trl", action="store_true", help="leave out the TRL comparison")
    ap.add_argument(
        "--trl-timeout", type=float, default=900.0, help="seconds a TRL run may take before its row is failed"
    )
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)  # one TRL rank (torchrun runs it)
    a = ap.parse_args(argv)
    if a.trl_worker:
        _trl_worker(json.loads(a.trl_worker))
        return ""
    lora_args = [f"lora.rank={a.lora_rank}", f"lora.alpha={2 * a.lora_rank}"]
    trl_skip = "left out (--no-trl)" if a.no_trl else _trl_missing()
    runs: dict[str, list[dict]] = {"full": [], "lora": [], "qlora": [], "padded": [], "hf": []}
    trl_runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data, src, vocab, mean_tokens = _chat_data(work, a.conversations)
        folder = _hf_folder(a, work, vocab) if trl_skip is None else None
        for rep in range(a.reps):
            runs["full"] += _train(a, work, data, vocab, f"full{rep}", [])
            runs["lora"] += _train(a, work, data, vocab, f"lora{rep}", lora_args)
            runs["qlora"] += _train(a, work, data, vocab, f"qlora{rep}", [*lora_args, "lora.quantize=nf4"])
            runs["padded"] += _train(a, work, data, vocab, f"padded{rep}", ["data.packing=pad"])
            if folder is not None:
                hf = [f"model.hf={folder}", *_same_optim_args(a.nproc)]
                runs["hf"] += _train(a, work, data, vocab, f"hf{rep}", hf)
                trl_runs.append(_trl(a, work, src, folder, f"trl{rep}"))
                if "failed" in trl_runs[-1]:
                    folder = None  # no second try
    sections = [_packing_table(a, runs, mean_tokens), _lora_table(a, runs, vocab)]
    sections.append(_trl_table(a, runs["hf"], trl_runs, trl_skip))
    report = "\n\n".join("\n".join(lines) for lines in sections)
    print(report)
    if a.markdown is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        import sections as section_writer  # the shared BENCHMARKS.md section writer
        from peers import machine  # the machine line every benchmark report carries

        section_writer.write_section(
            a.markdown,
            "## Fine-tuning: packed against padded, LoRA against full, scaletrain against TRL",
            "benchmarks/finetune.py",
            argv,
            [line for lines in sections for line in [*lines, ""]],
            machine(),
            footer=FOOTER,
        )
    return report


def _packing_table(a, runs: dict[str, list[dict]], mean_tokens: float) -> list[str]:
    packed, padded = runs["full"], runs["padded"]
    lines = [
        f"Packed against padded: Llama dim {a.dim}, {a.layers} layers, full fine-tune; {a.nproc} rank(s), FSDP2; "
        f"{a.steps} steps x {a.global_batch} rows x {a.seq_len} tokens; conversations average {mean_tokens:.0f} "
        f"tokens ({mean_tokens / a.seq_len:.2f} of a row); {a.reps} alternating reps",
        "",
        "| data.packing | median step (ms) | trained tokens/s |",
        "|---|---:|---:|",
    ]
    for name, rows in (("document (packed)", packed), ("pad (one per row)", padded)):
        lines.append(f"| {name} | {_median_step(rows) * 1e3:.1f} | {_trained_per_s(rows):,.0f} |")
    ratio = _trained_per_s(packed) / _trained_per_s(padded)
    lines.append(f"| packed / padded | {_median_step(packed) / _median_step(padded):.3f} | {ratio:.2f}x |")
    return lines


def _lora_table(a, runs: dict[str, list[dict]], vocab: int) -> list[str]:
    figures = {}
    for variant in ("full", "lora", "qlora"):
        rows = runs[variant]
        peak = max(max(r["peak_mem_bytes_per_rank"]) for r in rows)
        rank = a.lora_rank if variant != "full" else 0
        states = _model_states(a, vocab, rank, "nf4" if variant == "qlora" else "none")
        figures[variant] = (_median_step(rows), _trained_per_s(rows), peak, states)
    lines = [
        f"LoRA and QLoRA against full: Llama dim {a.dim}, {a.layers} layers, vocab {vocab}; {a.nproc} rank(s), FSDP2; "
        f"{a.steps} steps x {a.global_batch} x {a.seq_len} tokens, packed chat (data.packing=document); LoRA rank "
        f"{a.lora_rank} on the attention and MLP projections (QLoRA: their base in 4-bit NF4, lora.quantize=nf4); "
        f"{a.reps} alternating reps",
        "",
        "| variant | median step (ms) | trained tokens/s | peak memory/rank (GB) | model states/rank (MB, planner) |",
        "|---|---:|---:|---:|---:|",
    ]
    for variant, (step, trained, peak, states) in figures.items():
        lines.append(f"| {variant} | {step * 1e3:.1f} | {trained:,.0f} | {peak / 1e9:.3f} | {states / 1e6:.1f} |")
    for num, den in (("lora", "full"), ("qlora", "full"), ("qlora", "lora")):
        x, y = figures[num], figures[den]
        lines.append(
            f"| {num} / {den} | {x[0] / y[0]:.3f} | {x[1] / y[1]:.3f} | {x[2] / y[2]:.3f} | {x[3] / y[3]:.3f} |"
        )
    return lines


def _trl_table(a, ours: list[dict], trl_runs: list[dict], skipped: str | None) -> list[str]:
    head = (
        f"scaletrain against TRL's SFTTrainer (packing, loss on the completion): the same Hugging Face Llama folder, "
        f"conversations, AdamW (lr {SAME_OPTIM['lr']}, constant) and clipping; {a.nproc} CPU rank(s), DDP; "
        f"{a.steps} steps x {a.global_batch} rows x {a.seq_len} tokens; {a.reps} alternating reps"
    )
    failed = next((r["failed"] for r in trl_runs if "failed" in r), None)
    if failed is not None:
        skipped = f"the TRL run {failed}"
    if skipped is not None:
        return [head, "", f"TRL row skipped: {skipped}"]
    trl_steps = [t for r in trl_runs for t in r["step_times"]]
    ours_step, trl_step = _median_step(ours), statistics.median(trl_steps)
    ours_losses = [r["loss"] for r in ours[: a.steps - 1]]  # the first rep's curve (its first step was dropped)
    trl_losses = trl_runs[0]["losses"][1:]
    pairs = list(zip(ours_losses, trl_losses))
    gap = statistics.mean(abs(x - y) for x, y in pairs) if pairs else float("nan")
    lines = [
        head,
        "",
        "| trainer | median step (ms) | loss at step 2 | loss at the last step |",
        "|---|---:|---:|---:|",
        f"| scaletrain (model.hf, data.packing=document) | {ours_step * 1e3:.1f} | {ours_losses[0]:.3f} | "
        f"{ours_losses[-1]:.3f} |",
        f"| TRL SFTTrainer (packing=True) | {trl_step * 1e3:.1f} | {trl_losses[0]:.3f} | {trl_losses[-1]:.3f} |",
        f"| scaletrain / TRL | {ours_step / trl_step:.3f} | mean abs loss gap over steps 2-{a.steps}: {gap:.3f} | |",
    ]
    return lines


if __name__ == "__main__":
    main()
