"""Tensor parallelism (Megatron-style, on DTensor) and sequence parallelism.

Attention q/k/v and MLP up/gate projections are split by output column, attention output and MLP down projections
by input row, so one block costs two all-reduces forward (or, with sequence parallelism, an all-gather before and
a reduce-scatter after each half, with norms and residuals kept as sequence shards). The embedding is split along
the hidden dim (a vocabulary split would get a full-size gradient back on every rank), the output layer by
vocabulary column; with loss parallelism the cross-entropy runs on the vocabulary shards and the full logits are
never gathered.

Two plans: the hand-written one for the built-in Llama (`llama_tp_plan`), and `auto_tp_plan` for any standard
decoder (Hugging Face Llama, Mistral, Qwen ...), which finds each block's linears by structure.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

OUTPUT_NAMES = ("o_proj", "out_proj", "wo", "down_proj", "w2", "c_proj", "dense", "fc2")


@dataclass(frozen=True)
class TPOptions:
    sequence_parallel: bool = False
    loss_parallel: bool = False  # output layer returns vocabulary-sharded DTensor logits


def check_tp_divides(tp: int, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int) -> None:
    """Raise ValueError (one line, naming the field) when tp cannot split the model's heads or matmuls evenly."""
    for field, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("ffn_dim", ffn_dim),
                         ("dim", dim), ("vocab_size", vocab_size)):
        if value % tp:
            raise ValueError(f"parallel.tp: {tp} does not divide model.{field}={value}; "
                             f"pick a tp that divides it (each rank needs a whole share)")


def llama_tp_plan(model: nn.Module, opts: TPOptions) -> dict:
    """{module path: ParallelStyle} for the built-in Llama (and any pipeline stage of it)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    sp = opts.sequence_parallel
    act = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    plan: dict = {}
    if getattr(model, "tok_embeddings", None) is not None:
        # sharded on the hidden dim, not the vocabulary: torch 2.13 returns a vocabulary-sharded (RowwiseParallel)
        # embedding's gradient as a full Replicate tensor on every rank (tests/test_plan_distributed.py)
        plan["tok_embeddings"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if getattr(model, "norm", None) is not None and sp:
        plan["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        plan["output"] = ColwiseParallel(input_layouts=act,
                                         output_layouts=Shard(-1) if opts.loss_parallel else Replicate(),
                                         use_local_output=not opts.loss_parallel)
    for name in model.layers:
        p = f"layers.{name}."
        plan.update({
            p + "attention.wq": ColwiseParallel(), p + "attention.wk": ColwiseParallel(),
            p + "attention.wv": ColwiseParallel(), p + "attention.wo": RowwiseParallel(output_layouts=act),
            p + "feed_forward.w1": ColwiseParallel(), p + "feed_forward.w3": ColwiseParallel(),
            p + "feed_forward.w2": RowwiseParallel(output_layouts=act),
        })
        if sp:
            plan.update({
                p + "attention_norm": SequenceParallel(), p + "ffn_norm": SequenceParallel(),
                # the rotary tables (2nd, 3rd inputs) are plain tensors every rank holds whole
                p + "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                    desired_input_layouts=(Replicate(), None, None)),
                p + "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                       desired_input_layouts=(Replicate(),)),
            })
    return plan


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, block) of every transformer block: the entries of the largest ModuleList/ModuleDict."""
    best: tuple[str, nn.Module] | None = None
    for path, m in model.named_modules():
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m) and (best is None or len(m) > len(best[1])):
            best = (path, m)
    if best is None:
        return []
    path, container = best
    items = container.items() if isinstance(container, nn.ModuleDict) else enumerate(container)
    return [(f"{path}.{k}" if path else str(k), b) for k, b in items]


def _split_group(linears: list[tuple[str, nn.Linear]], hidden: int) -> tuple[list[str], str] | None:
    """Inside one attention or MLP module: the input projections (read the hidden state) and the one output
    projection (writes back to it), or None when the group does not look like either."""
    outs = [(n, m) for n, m in linears if m.out_features == hidden]
    if not outs:
        return None
    named = [(n, m) for n, m in outs if n.rsplit(".", 1)[-1] in OUTPUT_NAMES]
    out_name, out = (named or outs)[-1]  # by name when it is a known one, else the last registered
    ins = [(n, m) for n, m in linears if n != out_name and m.in_features == hidden]
    if not ins or len(ins) + 1 != len(linears):
        return None
    # the output projection reads what one of the input projections wrote (attention: q heads; MLP: up)
    if not any(m.out_features == out.in_features for _, m in ins):
        return None
    return [n for n, _ in ins], out_name


def auto_tp_plan(model: nn.Module, hidden: int | None = None) -> dict:
    """A TP plan found by structure for any standard decoder: in every block, each module holding several
    nn.Linear (attention, MLP) gets its hidden-reading projections column-split and its hidden-writing
    projection row-split; embeddings outside the blocks are split along the hidden dim and linears reading the
    hidden state outside them (the output head) by column, both with whole outputs, so every matrix is a DTensor
    (the optimizer's foreach kernels cannot mix them with plain tensors). Raises ValueError if no block matches."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    blocks = _blocks(model)
    if hidden is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        hidden = emb.embedding_dim if emb is not None else None
    plan: dict = {}
    for bpath, block in blocks:
        groups: dict[str, list[tuple[str, nn.Linear]]] = {}
        for name, m in block.named_modules():
            if isinstance(m, nn.Linear):
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                groups.setdefault(parent, []).append((name, m))
        for parent, linears in groups.items():
            h = hidden or max((m.in_features for _, m in linears), key=[m.in_features for _, m in linears].count)
            split = _split_group(linears, h)
            if split is None:
                continue
            ins, out = split
            for n in ins:
                plan[f"{bpath}.{n}"] = ColwiseParallel()
            plan[f"{bpath}.{out}"] = RowwiseParallel()
    if not plan:
        raise ValueError("parallel.tp_plan: auto found no attention or MLP linears in the model's blocks; "
                         "use parallel.tp_plan=model or parallel.tp=1")
    inside = tuple(f"{b}." for b, _ in blocks)
    for name, m in model.named_modules():
        if name.startswith(inside):
            continue
        if isinstance(m, nn.Embedding):
            plan[name] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())  # see llama_tp_plan
        elif isinstance(m, nn.Linear) and m.in_features == hidden:
            plan[name] = ColwiseParallel(output_layouts=Replicate())
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh, opts: TPOptions, plan: str = "model") -> nn.Module:
    """Shard `model` (or a pipeline stage of it) over tp_mesh in place. Works on the meta device: the weights
    are filled afterwards by init_weights, which distributes each full tensor."""
    from torch.distributed.tensor.parallel import parallelize_module

    if plan == "auto" or not hasattr(model, "layers"):
        styles = auto_tp_plan(model)
    else:
        styles = llama_tp_plan(model, opts)
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    return model
