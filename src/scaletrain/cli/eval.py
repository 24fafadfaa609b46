"""`scaletrain eval PATH --data PREPARED`: loss and perplexity over the trained tokens of a prepared dataset's
validation (or training) split. Thin: the work is in scaletrain.inference."""

from __future__ import annotations

from pathlib import Path

import click

from scaletrain.cli.errors import fail


@click.command("eval")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--data", "data", type=click.Path(path_type=Path), required=True, help="A prepared dataset folder.")
@click.option("--split", type=click.Choice(["val", "train"]), default="val", show_default=True)
@click.option(
    "--seq-len", type=click.IntRange(min=2), default=None, help="Tokens per window (default: the run's data.seq_len)."
)
@click.option("--batch-size", type=click.IntRange(min=1), default=8, show_default=True, help="Windows per forward.")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N; auto: cuda when there is one.")
def eval_cmd(path: Path, data: Path, split: str, seq_len: int | None, batch_size: int, device: str) -> None:
    """Report loss and perplexity of a run's newest checkpoint, one checkpoint, or a Hugging Face model folder."""
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
