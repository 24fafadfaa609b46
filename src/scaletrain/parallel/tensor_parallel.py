"""Tensor parallelism (Megatron-style, on DTensor) and sequence parallelism.

Attention q/k/v and MLP up/gate projections are split by output column, attention output and MLP down projections
by input row, so one block costs two all-reduces forward (or, with sequence parallelism, an all-gather before and
a reduce-scatter after each half, with norms and residuals kept as sequence shards). The embedding is split along
the hidden dim (a vocabulary split would get a full-size gradient back on every rank), the output layer by
vocabulary column; with loss parallelism the cross-entropy runs on the vocabulary shards and the full logits are
never gathered.

Two plans: the one a model's spec writes (ModelSpec.tp_plan; the built-in Llama's is models/llama/parallelize.py),
and `auto_tp_plan` for any standard decoder (Hugging Face Llama, Mistral, Qwen ...), which finds each block's
linears by structure.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from scaletrain.models.lora import ADAPTER, linear_layers
from scaletrain.models.spec import ModelSpec
from scaletrain.parallel.blocks import block_container, block_items

OUTPUT_NAMES = ("o_proj", "out_proj", "wo", "down_proj", "w2", "c_proj", "dense", "fc2")


@dataclass(frozen=True)
class TPOptions:
    sequence_parallel: bool = False
    loss_parallel: bool = False  # output layer returns vocabulary-sharded DTensor logits
    float8: bool = False  # float8 (tensorwise) linears get torchao's float8 styles (parallel/float8.py)


class ReplicateParallel(ParallelStyle):
    """A linear whose weight every TP rank holds whole, as Replicate DTensors (so the optimizer's foreach kernels
    and FSDP2 see DTensors as for its sharded neighbours): its input arrives as `input_layouts` and is made whole,
    its output leaves as `output_layouts`. LoRA's small factor beside a split base layer (models/lora.py)."""

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output: bool = True):
        from torch.distributed.tensor import Replicate

        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _partition_fn(self, name: str, module: nn.Module, device_mesh) -> None:
        from torch.distributed.tensor import Replicate, distribute_tensor

        for pname, param in module.named_parameters(recurse=False):
            whole = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(whole, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor import distribute_module

        # the input and output handling is ColwiseParallel's: annotate, redistribute, back to a local tensor
        prepare_input = partial(ColwiseParallel._prepare_input_fn, self.input_layouts, self.desired_input_layouts)
        prepare_output = partial(ColwiseParallel._prepare_output_fn, self.output_layouts, self.use_local_output)
        return distribute_module(module, device_mesh, self._partition_fn, prepare_input, prepare_output)


def _blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, block) of every block, by the shared rule (parallel/blocks.py)."""
    found = block_container(model)
    if found is None:
        return []
    path, container = found
    return [(f"{path}.{k}" if path else k, b) for k, b in block_items(container)]


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
        for name, m in linear_layers(block):  # a LoRA-wrapped linear counts as its base (models/lora.py)
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            groups.setdefault(parent, []).append((name, m))
        for linears in groups.values():
            h = hidden or max((m.in_features for _, m in linears), key=[m.in_features for _, m in linears].count)
            split = _split_group(linears, h)
            if split is None:
                continue
            ins, out = split
            for n in ins:
                plan[f"{bpath}.{n}"] = ColwiseParallel()
            plan[f"{bpath}.{out}"] = RowwiseParallel()
    if not plan:
        raise ValueError(
            "parallel.tp_plan: auto found no attention or MLP linears in the model's blocks; "
            "use parallel.tp_plan=model or parallel.tp=1"
        )
    inside = tuple(f"{b}." for b, _ in blocks)
    for name, m in model.named_modules():
        if not name.startswith(inside) and isinstance(m, nn.Embedding):
            # on the hidden dim, as the built-in plan (models/llama/parallelize.py) and for the same reason
            plan[name] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for name, m in linear_layers(model):
        if not name.startswith(inside) and m.in_features == hidden:
            plan[name] = ColwiseParallel(output_layouts=Replicate())
    return plan


def apply_tensor_parallel(
    model: nn.Module, tp_mesh, opts: TPOptions, plan: str | dict = "model", spec: ModelSpec | None = None
) -> nn.Module:
    """Shard `model` (or a pipeline stage of it) over tp_mesh in place: the spec's plan (plan='model'), or the
    structural one (plan='auto', or a model without a spec), or a given {module path: ParallelStyle} dict. Works on the meta device: the weights are filled
    afterwards by the spec's init_weights, which distributes each full tensor."""
    from torch.distributed.tensor.parallel import parallelize_module

    if isinstance(plan, dict):
        styles = plan
    elif plan == "auto" or spec is None:
        styles = auto_tp_plan(model)
    else:
        styles = spec.tp_plan(model, opts.sequence_parallel, opts.loss_parallel)
    if opts.float8:
        from scaletrain.parallel.float8 import float8_tp_styles

        styles = float8_tp_styles(model, styles)
    styles = adapter_tp_styles(model, styles)  # LoRA's adapters follow their base layer's split
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    parallelize_module(model, tp_mesh, styles, src_data_rank=None)
    # torch 2.13's SequenceParallel re-registers a norm's weight as a new Parameter with requires_grad=True: a
    # frozen weight (LoRA's base) would train
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    return model


def adapter_tp_styles(model: nn.Module, styles: dict) -> dict:
    """The TP plan `styles` ({module path: ParallelStyle}) for `model` with peft's LoRA layers: a style written for
    a LoRA-wrapped linear goes to its base layer and the adapters follow it (torchtitan's LoRA), so the adapted
    output equals one process's: a column-parallel base gets lora_A whole on every rank and lora_B column-split
    (lora_A's output all-reduced in backward); a row-parallel base gets lora_A row-split (its rank-r output
    all-reduced) and lora_B whole, leaving in the base's output layout. Paths that are no LoRA layer pass through."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    adapted = dict(linear_layers(model))
    out: dict = {}
    for path, style in styles.items():
        try:
            module: nn.Module = model.get_submodule(path)
        except AttributeError:  # a pattern or a path of another stage: parallelize_module resolves it
            module = model
        if not hasattr(module, "lora_A") or path not in adapted:
            out[path] = style
            continue
        a, b = f"{path}.lora_A.{ADAPTER}", f"{path}.lora_B.{ADAPTER}"
        out[f"{path}.base_layer"] = style
        if type(style) is ColwiseParallel:
            out[a] = ReplicateParallel(input_layouts=style.input_layouts[0])
            out[b] = ColwiseParallel(
                input_layouts=Replicate(),
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        elif type(style) is RowwiseParallel:
            out[a] = RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=Replicate())
            out[b] = ReplicateParallel(output_layouts=style.output_layouts[0], use_local_output=style.use_local_output)
        else:
            raise ValueError(
                f"lora.targets: {path} is split by {type(style).__name__} under tensor parallelism, which LoRA's "
                f"adapters cannot follow (column- or row-parallel linears only); leave it out of lora.targets"
            )
    return out
