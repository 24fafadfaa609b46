"""`scaletrain generate PATH --prompt TEXT | --chat TEXT`: print a trained model's completion (nothing else) on
stdout. Thin: the work is in scaletrain.inference."""

from __future__ import annotations

from pathlib import Path

import click

from scaletrain.cli.errors import fail


@click.command()
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Plain text the model continues.")
@click.option("--chat", "chat", default=None, help="A user turn, rendered with the tokenizer's chat template.")
@click.option("--system", default=None, help="With --chat: a system turn before the user's.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0: greedy; > 0: sample."
)
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=None, help="Random seed for sampling.")
@click.option(
    "--tokenizer", default=None, help="Tokenizer folder or `bytes` (default: the one the run's data was prepared with)."
)
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N; auto: cuda when there is one.")
def generate(
    path: Path,
    prompt: str | None,
    chat: str | None,
    system: str | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    tokenizer: str | None,
    device: str,
) -> None:
    """Complete a prompt with a run's newest checkpoint, one checkpoint, or a Hugging Face model folder."""
    if (prompt is None) == (chat is None):
        fail("--prompt/--chat: give exactly one of --prompt TEXT or --chat TEXT")
    if system is not None and chat is None:
        fail("--system: only used with --chat")
    from scaletrain.inference.generate import GenerationOptions
    from scaletrain.inference.generate import generate as run_generate
    from scaletrain.inference.generate import causal_lm
    from scaletrain.inference.source import find_source, find_tokenizer, load_weights
    from scaletrain.inference.text import TextCodec

    try:
        source = find_source(path)
        codec_name = find_tokenizer(source, tokenizer)
        weights, spec = load_weights(source)
        codec = TextCodec(codec_name, spec.vocab_size or 0)
        ids = codec.chat(chat, system) if chat is not None else codec.encode(prompt or "")
        stops = codec.stop_ids(chat=chat is not None)
        model = causal_lm(weights, spec, _device(device))
        del weights
        options = GenerationOptions(max_new_tokens, temperature, top_p, seed)
        completion = run_generate(model, ids, stops, options)
    except ValueError as e:
        fail(str(e))
    click.echo(codec.decode(completion))


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name
