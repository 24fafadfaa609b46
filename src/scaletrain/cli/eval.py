"""`scaletrain eval PATH --data PREPARED`: loss and perplexity over the trained tokens of a prepared dataset's
validation (or training) split; `--lm-eval TASKS`: lm-evaluation-harness tasks on the same model, offline. Thin:
the work is in scaletrain.inference."""

from __future__ import annotations

import json
from pathlib import Path

import click

from scaletrain.cli.errors import fail


@click.command("eval")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--data", "data", type=click.Path(path_type=Path), default=None, help="A prepared dataset folder.")
@click.option("--split", type=click.Choice(["val", "train"]), default="val", show_default=True)
@click.option(
    "--seq-len", type=click.IntRange(min=2), default=None, help="Tokens per window (default: the run's data.seq_len)."
)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Windows per forward.")
@click.option(
    "--lm-eval",
    "lm_eval_tasks",
    default=None,
    help="lm-evaluation-harness tasks, comma-separated (the eval extra: pip install 'scaletrain[eval]'); offline.",
)
@click.option(
    "--lm-eval-include",
    type=click.Path(path_type=Path),
    default=None,
    help="A folder of lm-eval task YAMLs (with local data files) to add to the harness's own.",
)
@click.option("--limit", type=click.IntRange(min=1), default=None, help="--lm-eval: at most this many documents.")
@click.option("--num-fewshot", type=click.IntRange(min=0), default=None, help="--lm-eval: few-shot examples.")
@click.option(
    "--tokenizer", default=None, help="Tokenizer folder or `bytes` (default: the one the run's data was prepared with)."
)
@click.option("--json", "as_json", is_flag=True, help="--lm-eval: print the results as JSON.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N; auto: cuda when there is one.")
def eval_cmd(
    path: Path,
    data: Path | None,
    split: str,
    seq_len: int | None,
    batch_size: int,
    lm_eval_tasks: str | None,
    lm_eval_include: Path | None,
    limit: int | None,
    num_fewshot: int | None,
    tokenizer: str | None,
    as_json: bool,
    device: str,
) -> None:
    """Report loss and perplexity (--data) or lm-eval task metrics (--lm-eval) of a run's newest checkpoint, one
    checkpoint, or a Hugging Face model folder."""
    if (data is None) == (lm_eval_tasks is None):
        fail("--data/--lm-eval: give exactly one of --data PREPARED or --lm-eval TASKS")
    if lm_eval_tasks is not None:
        _lm_eval(path, lm_eval_tasks, lm_eval_include, limit, num_fewshot, tokenizer, as_json, device)
        return
    assert data is not None
    from scaletrain.cli.generate import _device
    from scaletrain.inference.evaluate import evaluate_prepared
    from scaletrain.inference.source import find_source, load_weights

    try:
        source = find_source(path)
        cfg = source.run_config
        if seq_len is None:
            seq_len = cfg.data.seq_len if cfg is not None else None
        weights, spec = load_weights(source)
        seq_len = seq_len or spec.max_seq_len
        if seq_len is None:
            raise ValueError("--seq-len: the model has no max_seq_len and no run config says one; pass --seq-len N")
        mask_doc_starts = cfg.data.mask_doc_starts if cfg is not None else False
        result = evaluate_prepared(weights, spec, data, split, seq_len, batch_size, mask_doc_starts, _device(device))
    except ValueError as e:
        fail(str(e))
    click.echo(
        f"loss {result.loss:.6f}  perplexity {result.perplexity:.4f}  over {result.trained_tokens} trained tokens "
        f"({result.windows} windows of {result.seq_len}, {split} split of {data})"
    )


def _lm_eval(path, tasks_text, include, limit, num_fewshot, tokenizer, as_json, device) -> None:
    """lm-eval's metrics per task, one `task  metric  value` line each (or JSON)."""
    from scaletrain.cli.generate import _device
    from scaletrain.config.extras import require
    from scaletrain.inference.harness import harness_lm, run_harness
    from scaletrain.inference.source import find_source, find_tokenizer, load_weights
    from scaletrain.inference.text import TextCodec

    tasks = [t.strip() for t in tasks_text.split(",") if t.strip()]
    try:
        require("lm_eval", "--lm-eval")
        if not tasks:
            raise ValueError("--lm-eval: name at least one task, e.g. --lm-eval hellaswag,arc_easy")
        source = find_source(path)
        codec_name = find_tokenizer(source, tokenizer)
        weights, spec = load_weights(source)
        cfg = source.run_config
        max_length = (cfg.data.seq_len if cfg is not None else None) or spec.max_seq_len or 2048
        lm = harness_lm(weights, spec, TextCodec(codec_name, spec.vocab_size or 0), _device(device), max_length)
        results = run_harness(lm, tasks, include, limit, num_fewshot)
    except ValueError as e:
        fail(str(e))
    if as_json:
        click.echo(json.dumps(results, indent=2))
        return
    for task, metrics in results.items():
        for metric, value in metrics.items():
            click.echo(f"{task}  {metric}  {value:.6g}")
