"""Tensor (+ sequence) parallelism for transformers' models, from the model's own `base_model_tp_plan`: its
strings translated to torch's ParallelStyles. GPT-2 has no plan: its Conv1D layers (weight [in, out]) are split
here by structure, the fused q|k|v c_attn so that each rank holds whole heads of all three; with sequence
parallelism its residual stream leaves the last layer whole (GPT-2's model views it as (-1, S, hidden)). An MoE
block whose packed experts expert parallelism splits (models/hf/experts.py) keeps them whole: each TP rank routes its
piece of the tokens (_moe_block_styles). Other models without a plan and plan entries with no torch counterpart here
(other packed experts) are refused before launch, never split wrongly.

The embedding is split along the hidden dim and gathered whole: transformers computes the causal mask, position
ids and rotary tables from its output's length at model level, so the residual stream enters the first layer whole
and, with sequence parallelism, is cut into sequence shards there (norms and residual adds on shards, an
all-gather before attention and MLP, a reduce-scatter after). A tied output layer reuses the embedding's DTensor
(hidden-dim shards): it runs row-wise, its partial logits summed (or reduce-scattered over the vocabulary under
loss parallelism)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from scaletrain.models.spec import CONFIG_TP_WORDS, TPWords

if TYPE_CHECKING:
    from torch import nn


# what `scaletrain models` says of model.hf (kept next to the rules it summarises)
HF_SUPPORT = (
    "model.hf=FOLDER  any decoder-only causal LM of transformers (AutoModelForCausalLM), built from the folder's "
    "config.json, weights from its *.safetensors if any; proven: Llama, Qwen3, Mistral, Gemma 2, Phi-3, GPT-2, "
    "Qwen3-MoE. Layouts: DDP, FSDP/HSDP, TP+SP where transformers has a base_model_tp_plan and for GPT-2's "
    "Conv1D layers (MoE: packed experts whole, each TP rank routing a piece of the tokens, with FSDP); EP for "
    "packed experts (parallel.ep); "
    "PP (tied embeddings: a copy on the first and the last stage, gradients summed)"
)

# transformers' plan strings (integrations/tensor_parallel.py) that translate to torch ParallelStyles here
KNOWN = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "replicated_with_grad_allreduce")


def base_plan(spec: Any) -> dict[str, str]:
    """The model's base_model_tp_plan; a composite model's (LLaVA) is its text model's, whose layers blocks() gives."""
    config = spec.config
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan and hasattr(config, "get_text_config"):
        plan = getattr(config.get_text_config(), "base_model_tp_plan", None)
    return dict(plan or {})


# GPT-2's decoder layer in transformers' Conv1D layout (weight [in, out]): what each projection's split is
CONV1D_PLAN = {
    "attn.c_attn": "fused_qkv_colwise",
    "attn.c_proj": "rowwise",
    "mlp.c_fc": "colwise",
    "mlp.c_proj": "rowwise",
}


def conv1d_plan(spec: Any) -> dict[str, str]:
    """{layer-relative path: split} when every decoder layer is GPT-2's Conv1D block with a fused q|k|v c_attn
    of 3 x hidden outputs (no cross-attention), else {}."""
    model = spec.meta_model
    hidden = int(spec.config.hidden_size)
    for layer in spec.blocks(model):
        for path in CONV1D_PLAN:
            try:
                mod = layer.get_submodule(path)
            except AttributeError:
                return {}
            if type(mod).__name__ != "Conv1D":
                return {}
        if layer.get_submodule("attn.c_attn").weight.shape[1] != 3 * hidden or hasattr(layer, "crossattention"):
            return {}
    return dict(CONV1D_PLAN)


def check_plan(spec: Any, tp: int, words: TPWords = CONFIG_TP_WORDS) -> None:
    """ValueError (one line, in `words`) when tensor parallelism cannot split this model correctly."""
    plan = base_plan(spec)
    if not plan and conv1d_plan(spec):
        return
    if not plan:
        raise ValueError(
            f"{words.tp}: {spec.architecture} has no tensor-parallel plan in transformers (base_model_tp_plan), "
            f"and fused or non-Linear projections cannot be split safely by structure; {words.no_plan_fix}"
        )
    if spec.n_experts and spec.splits_experts:
        return _check_known(spec, {k: v for k, v in plan.items() if "experts" not in k}, words)
    if spec.n_experts:
        # transformers keeps each layer's experts packed in [experts, rows, cols] tensors. Up to 5.24 its TP plan
        # splits them with its own kernels (packed_colwise, moe_tp_experts: no torch ParallelStyle counterpart);
        # from 5.25 the plan leaves them out (they moved to base_model_ep_plan), so TP would copy every expert to
        # every rank. Either way scaletrain's TP does not split them; only a plan splitting them with torch's own
        # styles (per-expert Linears) passes.
        experts = {k: s for k, s in plan.items() if "experts" in k}
        if not experts or any(s not in KNOWN for s in experts.values()):
            what = ", ".join(sorted(experts)) or "not in its base_model_tp_plan"
            raise ValueError(
                f"{words.tp}: {spec.architecture}'s {spec.n_experts} experts ({what}) are packed tensors "
                f"scaletrain's tensor parallelism does not split; use {words.tp_off} and shard them with FSDP "
                f"instead ({words.fsdp})"
            )
    _check_known(spec, plan, words)


def _check_known(spec: Any, plan: dict[str, str], words: TPWords) -> None:
    """Packed experts that expert parallelism splits (models/hf/experts.py) stay whole under TP: each TP rank routes
    its piece of the tokens through them (hf_tp_plan), so the plan's expert entries (transformers <= 5.24) are not
    used; every other entry must translate."""
    for key, style in plan.items():
        if style in KNOWN:
            continue
        raise ValueError(
            f"{words.tp}: {spec.architecture}'s plan splits {key} as {style!r}, which scaletrain does not "
            f"translate; {words.no_plan_fix}"
        )


def _tied_head(embedding: nn.Module, **kwargs):
    """A row-wise output layer whose weight is the (already distributed) embedding's: one parameter, still tied."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    class TiedHead(RowwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            module.weight = embedding.weight

    return TiedHead(**kwargs)


def _conv1d_styles(act) -> dict:
    """ParallelStyles for transformers' Conv1D (y = x @ W + b, W stored [in, out]): column-wise shards W's dim 1
    and b; row-wise shards W's dim 0, b whole; the fused q|k|v projection gives each rank its heads of q, k and v."""
    from functools import partial

    import torch
    from torch import nn
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    def shard(module, mesh, placements: dict) -> None:
        for name, placement in placements.items():
            p = getattr(module, name)
            module.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, [placement]), p.requires_grad))

    def apply(style, module, device_mesh, placements: dict):
        return distribute_module(
            module,
            device_mesh,
            lambda name, mod, mesh: shard(mod, mesh, placements),
            partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts),
            partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
        )

    class ColwiseConv1D(ColwiseParallel):
        def _apply(self, module, device_mesh):
            return apply(self, module, device_mesh, {"weight": Shard(1), "bias": Shard(0)})

    class RowwiseConv1D(RowwiseParallel):
        def _apply(self, module, device_mesh):
            self.desired_input_layouts = (Shard(-1),)
            return apply(self, module, device_mesh, {"weight": Shard(0), "bias": Replicate()})

    class FusedQKVConv1D(ParallelStyle):
        """c_attn's output columns are [q | k | v], each of heads x head_dim: _StridedShard(split_factor=3) gives
        rank r the r-th slice of each of the three, so its local output is [q_r | k_r | v_r] over whole heads (the
        layout checkpoints and full_tensor() read); the attention then splits by hidden / tp."""

        def __init__(self, attention: nn.Module):
            super().__init__()
            self.attention = attention

        def _apply(self, module, device_mesh):
            shard(
                module,
                device_mesh,
                {"weight": _StridedShard(1, split_factor=3), "bias": _StridedShard(0, split_factor=3)},
            )
            self.attention.split_size //= device_mesh.size()

            def forward(x):
                # whole activations in; their gradient is partial over the ranks' heads: summed in backward
                xl = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(
                    grad_placements=[Partial()]
                )
                out = torch.addmm(module.bias.to_local(), xl.reshape(-1, xl.size(-1)), module.weight.to_local())
                return out.view(*xl.shape[:-1], -1)

            module.forward = forward
            return module

    return {
        "colwise": lambda layer: ColwiseConv1D(),
        "rowwise": lambda layer: RowwiseConv1D(output_layouts=act),
        "fused_qkv_colwise": lambda layer: FusedQKVConv1D(layer.get_submodule("attn")),
    }


def _replicated(tokens_sharded: bool = False):
    """Whole parameters as Replicate DTensors, plain tensors in and out (a tuple too: a router's), so every
    parameter is a DTensor (the optimizer's foreach kernels cannot mix). The inputs are declared whole (modules the
    plan does not split: norms without sequence parallelism), or with tokens_sharded=True as this rank's tokens,
    dim 0 sharded over TP: the children of an MoE block under TP, where each rank routes its piece of the tokens,
    so their gradients are partial per rank and DTensor sums them over TP."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.utils._pytree import tree_map

    placement = Shard(0) if tokens_sharded else Replicate()

    def inputs(mod, args, mesh):
        return tuple(
            DTensor.from_local(a, mesh, [placement], run_check=False)
            if isinstance(a, torch.Tensor) and not isinstance(a, DTensor)
            else a
            for a in args
        )

    def outputs(mod, out, mesh):
        return tree_map(lambda t: t.to_local() if isinstance(t, DTensor) else t, out)

    class Replicated(ParallelStyle):
        def _apply(self, module, device_mesh):
            return distribute_module(module, device_mesh, None, inputs, outputs)

    return Replicated()


def _moe_block_styles(layer: nn.Module, lpath: str, act) -> dict:
    """TP of a transformers MoE block whose packed experts models/hf/experts.py runs (the built-in family's way,
    models/moe/parallelize.py): its input cut into tp pieces of every sequence, each rank routing its piece through
    whole experts (FSDP2 sums the experts' gradients over TP: parallel/dims.py expert_fsdp_mesh), the router and
    shared experts whole (_replicated, tokens sharded), the output gathered back (or left sharded under sequence parallelism);
    {} for a layer without such a block."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import PrepareModuleInputOutput

    from scaletrain.models.hf.experts import splittable

    block = getattr(layer, "mlp", None)
    if block is None or not splittable(getattr(block, "experts", None)):
        return {}
    styles: dict = {
        f"{lpath}.mlp": PrepareModuleInputOutput(
            input_layouts=(act,),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(act,),
            use_local_output=True,
        )
    }
    for name, child in block.named_children():
        if name != "experts" and any(True for _ in child.parameters()):
            styles[f"{lpath}.mlp.{name}"] = _replicated(tokens_sharded=True)
    return styles


def hf_tp_plan(spec: Any, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
    """{module path: ParallelStyle} for a transformers causal LM."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()
    m = cast(Any, model)
    names = {mod: n for n, mod in model.named_modules()}
    styles = {
        "colwise": lambda: ColwiseParallel(),
        "rowwise": lambda: RowwiseParallel(output_layouts=act),
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
        # q/k norms over the head dim (Qwen3): whole weights, inputs sharded by head, gradients summed
        "replicated_with_grad_allreduce": lambda: SequenceParallel(sequence_dim=2, use_local_output=True),
    }
    plan: dict = {}
    conv1d = {} if base_plan(spec) else conv1d_plan(spec)
    conv1d_styles = _conv1d_styles(act) if conv1d else {}
    emb = m.get_input_embeddings()
    if emb is not None:  # None on pipeline stages after the first
        plan[names[emb]] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    out = m.get_output_embeddings()
    container = spec.blocks(model)
    cpath = names[container]
    layer_attr = cpath.rsplit(".", 1)[-1]
    children = list(container.named_children())
    for i, (key, layer) in enumerate(children):
        lpath = f"{cpath}.{key}"
        for rest, style in conv1d.items():
            plan[f"{lpath}.{rest}"] = conv1d_styles[style](layer)
        for pattern, style in base_plan(spec).items():
            head, _, rest = pattern.partition(".*.")
            if head != layer_attr:
                continue
            path = f"{lpath}.{rest}"
            try:
                model.get_submodule(path)
            except AttributeError:
                continue  # e.g. dense MLP names on a MoE layer
            plan[path] = styles[style]()
        if sp:
            # the whole residual stream enters the first layer (of the model, or of a pipeline stage: stages hand
            # each other whole hidden states, transformers reads the sequence length from them)
            # GPT-2's model hands its block 4 positional arguments (hidden states, cache, mask, encoder states):
            # only the first is laid out
            others = (None,) * 3 if conv1d else ()
            into = (Replicate() if i == 0 else Shard(1), *others)
            sharded = (Shard(1), *others)
            # the last layer of a stage before the last, or of GPT-2 (its model views the output as (-1, S, hidden)
            # with the S it was fed): gathered whole
            if (out is None or conv1d) and i == len(children) - 1:
                plan[lpath] = PrepareModuleInputOutput(
                    input_layouts=into,
                    desired_input_layouts=sharded,
                    use_local_input=True,
                    output_layouts=(Shard(1),),
                    desired_output_layouts=(Replicate(),),
                )
            else:
                plan[lpath] = PrepareModuleInput(
                    input_layouts=into, desired_input_layouts=sharded, use_local_output=True
                )
            for child_name, child in layer.named_children():
                if "Norm" in type(child).__name__:
                    plan[f"{lpath}.{child_name}"] = SequenceParallel(use_local_output=True)
            if hasattr(layer, "self_attn"):
                plan[f"{lpath}.self_attn"] = PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    use_local_output=True,
                )
            else:  # GPT-2's attn, called with hidden states as its first argument
                plan[f"{lpath}.attn"] = PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                )
            plan[f"{lpath}.mlp"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            )
        plan.update(_moe_block_styles(layer, lpath, act))  # an MoE block takes its piece of the tokens instead
    if out is not None:
        if sp and not conv1d:  # the final norm: a Norm child of the module holding the layers, on sequence shards
            parent_path = cpath.rsplit(".", 1)[0] if "." in cpath else ""
            for child_name, child in model.get_submodule(parent_path).named_children():
                if "Norm" in type(child).__name__:
                    plan[f"{parent_path}.{child_name}".lstrip(".")] = SequenceParallel(use_local_output=True)
        logits = Shard(-1) if loss_parallel else Replicate()
        if spec.tied:
            plan[names[out]] = _tied_head(
                emb,
                input_layouts=Replicate() if conv1d else act,
                output_layouts=logits,
                use_local_output=not loss_parallel,
            )
        else:
            plan[names[out]] = ColwiseParallel(
                input_layouts=act, output_layouts=logits, use_local_output=not loss_parallel
            )
    planned = tuple(plan)
    for path, module in model.named_modules():
        inside = any(path == p or path.startswith(p + ".") for p in planned)
        if not inside and any(True for _ in module.parameters(recurse=False)):
            plan[path] = _replicated()
    return plan
