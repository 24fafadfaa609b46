"""A model's facts read off the model itself: build it on the meta device, run one micro-batch's forward and backward
on fake tensors (torch's FakeTensorMode: shapes, dtypes and the CPU kernels' choices, no memory, no arithmetic) and
record, per ATen operator and per layer: FLOPs, bytes moved, the tensors autograd saves for backward (with and
without full activation checkpointing), parameters, buffers and where the repeated blocks begin and end.

No weights and no GPU; seconds even for a 405B model: where the blocks are identical (same class, same parameter
shapes) only the first two are kept and traced, and the second stands for every block after the first (the first
may also carry what every block shares, e.g. tensors built once and passed to each block).

What is counted (docs/planner.md, "A model's trace"):
- FLOPs: torch.utils.flop_counter's formulas (matmuls, convolutions, attention), plus torch's CPU flash-attention
  kernel, which that table lacks; twice: as executed (a causal kernel skips the masked half, its backward recomputes
  the scores) and as the PaLM convention counts them (6N + 12·L·h·s, the MFU numerator).
- bytes moved: every non-view operator's tensor inputs and outputs (the convention of bench's step_profile).
- saved for backward: the distinct storages autograd's saved_tensors_hooks see, parameters and buffers excluded,
  each counted once at the first layer that saves it; under full checkpointing a block keeps only its inputs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from scaletrain.models.spec import ModelSpec

ROOT = "root"  # what is not in a block: embeddings, heads, the loss
PHASES = ("forward", "backward")
# share of a flash-attention backward's counted FLOPs that recompute the forward's scores (q·kᵀ): one of the five
# equal products torch.utils.flop_counter.sdpa_backward_flop_count sums
ATTENTION_BWD_RECOMPUTE = 1.0 / 5.0
MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution", "convolution_backward")


@dataclass(frozen=True)
class OpCount:
    """One ATen operator in one layer and phase, summed over its calls."""

    layer: str  # ROOT or the block's key ("0", "1", ...)
    phase: str  # forward | backward
    op: str  # e.g. "aten.mm"
    kind: str  # matmul | attention | memory | view
    calls: int
    flops: float  # as executed: a causal flash kernel skips the masked half of the scores
    bytes: float
    model_flops: float  # as the PaLM convention counts them (attention over the whole square, no recompute)


@dataclass(frozen=True)
class TracedLayer:
    """One traced layer (ROOT or a block) and how many of the model's layers it stands for."""

    name: str
    repeat: int  # the model holds this many layers like it (the second block stands for blocks 1..L-1)
    params: int
    param_tensors: int
    param_shapes: tuple[tuple[int, ...], ...]
    buffer_bytes: int
    saved_bytes: int  # what autograd keeps for backward, no checkpointing, one micro-batch
    input_bytes: int  # what full checkpointing keeps instead (the block's own inputs); ROOT: its saved bytes


@dataclass(frozen=True)
class ModelTrace:
    """One micro-batch of `samples` samples (of `tokens_per_sample` tokens where the model takes tokens) traced in
    `dtype`. Totals are for the whole model: every layer's figures times its repeat."""

    name: str
    samples: int
    tokens_per_sample: int | None
    dtype: str
    element_bytes: int
    n_blocks: int
    layers: tuple[TracedLayer, ...]
    ops: tuple[OpCount, ...]
    seconds: float = 0.0  # how long the trace took
    notes: tuple[str, ...] = field(default=())

    def layer(self, name: str) -> TracedLayer:
        return next(lay for lay in self.layers if lay.name == name)

    def _repeat(self, name: str) -> int:
        return self.layer(name).repeat

    @property
    def params(self) -> int:
        return sum(lay.params * lay.repeat for lay in self.layers)

    @property
    def param_tensors(self) -> int:
        return sum(lay.param_tensors * lay.repeat for lay in self.layers)

    @property
    def buffer_bytes(self) -> int:
        return sum(lay.buffer_bytes * lay.repeat for lay in self.layers)

    def flops(self, phase: str | None = None, kind: str | None = None, blocks_only: bool = False) -> float:
        """FLOPs of one micro-batch (both phases unless `phase`), of one kind of op unless None."""
        return sum(
            o.flops * self._repeat(o.layer)
            for o in self.ops
            if (phase is None or o.phase == phase)
            and (kind is None or o.kind == kind)
            and not (blocks_only and o.layer == ROOT)
        )

    def model_flops(self) -> float:
        """FLOPs of one micro-batch as the PaLM convention counts them (6N + 12·L·h·s per token, the MFU numerator):
        attention over the whole square, without the scores a flash kernel's backward recomputes. flops() is what
        the kernels execute: a causal kernel skips the masked half, its backward recomputes the scores."""
        return sum(o.model_flops * self._repeat(o.layer) for o in self.ops)

    def bytes_moved(self, phase: str | None = None, kind: str | None = None, blocks_only: bool = False) -> float:
        return sum(
            o.bytes * self._repeat(o.layer)
            for o in self.ops
            if (phase is None or o.phase == phase)
            and (kind is None or o.kind == kind)
            and not (blocks_only and o.layer == ROOT)
        )

    def op_calls(self, phase: str | None = None, blocks_only: bool = False) -> int:
        return sum(
            o.calls * self._repeat(o.layer)
            for o in self.ops
            if (phase is None or o.phase == phase) and o.kind != "view" and not (blocks_only and o.layer == ROOT)
        )

    @property
    def blocks(self) -> tuple[TracedLayer, ...]:
        return tuple(lay for lay in self.layers if lay.name != ROOT)

    def saved_bytes(self, checkpoint: str = "none") -> int:
        """Bytes autograd keeps for backward over the whole model, one micro-batch: checkpoint "none" or "full"
        (every block keeps only its inputs; what is outside the blocks is kept as it is)."""
        if checkpoint not in ("none", "full"):
            raise ValueError(f"checkpoint must be none or full for a traced model (got {checkpoint!r})")
        key = "saved_bytes" if checkpoint == "none" else "input_bytes"
        return sum(getattr(lay, key if lay.name != ROOT else "saved_bytes") * lay.repeat for lay in self.layers)

    @property
    def largest_block_params(self) -> int:
        return max((lay.params for lay in self.blocks), default=0)

    @property
    def largest_block_saved(self) -> int:
        return max((lay.saved_bytes for lay in self.blocks), default=0)

    def top_ops(self, n: int = 5) -> list[tuple[str, str, float, float]]:
        """(where, op, FLOPs, bytes) of the `n` heaviest operators over the whole model by FLOPs then bytes; where
        is "blocks" or "outside blocks"."""
        sums: dict[tuple[str, str], list[float]] = {}
        for o in self.ops:
            if o.kind == "view":
                continue
            key = ("outside blocks" if o.layer == ROOT else "blocks", o.op)
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += o.flops * self._repeat(o.layer)
            acc[1] += o.bytes * self._repeat(o.layer)
        rows = sorted(sums.items(), key=lambda kv: (kv[1][0], kv[1][1]), reverse=True)
        return [(where, op, f, b) for (where, op), (f, b) in rows[:n]]


# ---------------------------------------------------------------------------------------------- what is traced
@dataclass
class TraceTarget:
    """What a trace needs of a model: a builder on the meta device, where its repeated blocks are, one
    micro-batch's inputs (made inside the fake mode) and the loss of its output."""

    name: str
    build: Callable[[], nn.Module]  # the whole model on the meta device
    blocks: Callable[[nn.Module], Any]  # its ModuleDict / ModuleList of repeated blocks, or None
    inputs: Callable[[int], tuple[tuple, dict]]  # samples -> (args, kwargs) of the forward, made on the CPU
    loss: Callable[[Any, int], torch.Tensor]  # (output, samples) -> a scalar
    tokens_per_sample: int | None = None
    samples: int = 1


def spec_target(spec: ModelSpec, seq_len: int | None = None) -> TraceTarget:
    """The target for a model family's spec: a language model (one with a vocabulary) trains on `seq_len` token
    ids per sample with the trainer's loss (models/loss.py, chunked); another family must answer
    `example_inputs(samples)` on its spec."""
    vocab = spec.vocab_size
    if vocab is None:
        make = getattr(spec, "example_inputs", None) or _image_inputs(spec)
        if make is None:
            raise ValueError(
                f"model.name: the planner cannot trace the {spec.family} family without an example input; "
                f"give its spec an example_inputs(samples) method returning the forward's (args, kwargs)"
            )
        return TraceTarget(spec.model_name, lambda: spec.build("meta"), spec.blocks, make, _sum_loss)
    seq = seq_len or spec.max_seq_len or 2048
    build = getattr(spec, "build_for_trace", None) or (lambda: spec.build("meta"))  # a model with data checks
    make_tokens = getattr(spec, "example_token_inputs", None)  # a model taking more than token ids (a VLM's pixels)

    def inputs(samples: int):
        import torch

        if make_tokens is not None:
            return make_tokens(samples, seq)
        return (torch.zeros((samples, seq), dtype=torch.int64),), {}

    def loss(logits, samples: int):
        import torch

        from scaletrain.models.loss import token_loss_sum

        return token_loss_sum(logits, torch.zeros((samples, seq), dtype=torch.int64))

    return TraceTarget(spec.model_name, build, spec.blocks, inputs, loss, tokens_per_sample=seq)


def _image_inputs(spec: ModelSpec):
    """An image classifier's micro-batch (the image-classification task's pixels: samples x channels x size x
    size), for a spec that names a fixed image size; None otherwise."""
    size = getattr(spec, "image_size", None)
    if not size or not hasattr(spec, "num_labels"):
        return None
    channels = int(getattr(spec, "num_channels", 3))

    def inputs(samples: int):
        import torch

        return (torch.zeros((samples, channels, int(size), int(size))),), {}

    return inputs


def factory_target(path: str) -> TraceTarget:
    """The target for a user's factory `package.module:function`: called with no arguments under the meta device, it
    returns (model, example) where example is one micro-batch's input: a tensor, a tuple of positional arguments or
    a dict of keyword arguments (its first tensor's first dimension is the micro-batch). The loss is the sum of the
    model's floating-point outputs. ValueError in one line naming --factory."""
    module_name, _, fn_name = path.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"--factory: expected package.module:function (got {path!r})")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"--factory: cannot import {path!r}: {e}") from None
    import torch
    from torch import nn

    with torch.device("meta"):
        made = fn()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise ValueError(f"--factory: {path} must return (model, example_input); got {type(made).__name__}")
    model, example = made
    args: tuple
    kwargs: dict
    if isinstance(example, dict):
        args, kwargs = (), dict(example)
    else:
        args, kwargs = (example if isinstance(example, tuple) else (example,)), {}
    first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ValueError(f"--factory: {path}'s example input holds no batched tensor")
    samples = int(first.shape[0])
    used = [False]

    def build():
        if not used[0]:  # the first build is the factory's own model
            used[0] = True
            return model
        with torch.device("meta"):
            return fn()[0]

    def inputs(n: int):
        def like(t):
            if not isinstance(t, torch.Tensor):
                return t
            return torch.zeros(t.shape, dtype=t.dtype)

        return tuple(like(a) for a in args), {k: like(v) for k, v in kwargs.items()}

    return TraceTarget(path, build, find_blocks, inputs, _sum_loss, samples=samples)


def _sum_loss(output, samples: int):
    import torch
    from torch.utils._pytree import tree_flatten

    leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise ValueError("the model's output holds no floating-point tensor to take a loss of")
    return sum(t.float().sum() for t in leaves)


def find_blocks(model: nn.Module):
    """The model's repeated blocks, found without a spec: the ModuleList or ModuleDict holding the most parameters
    whose children are at least two of one class; None when there is none."""
    from torch import nn

    best, best_params = None, 0
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)) or len(module) < 2:
            continue
        children = list(module.children())
        if len({type(c) for c in children}) != 1:
            continue
        n = sum(p.numel() for p in module.parameters())
        if n > best_params:
            best, best_params = module, n
    return best


# --------------------------------------------------------------------------------------------------- the trace
def _signature(block: nn.Module) -> tuple:
    return (type(block), tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()))


def _items(container) -> list[tuple[str, nn.Module]]:
    from torch import nn

    if isinstance(container, nn.ModuleDict):
        return list(container.items())
    return [(str(i), m) for i, m in enumerate(container)]


def _keep_first_blocks(container, keep: int) -> None:
    from torch import nn

    if isinstance(container, nn.ModuleDict):
        for key in list(container.keys())[keep:]:
            del container[key]
    else:
        del container[keep:]


def _storage_key(t) -> int:
    return t.untyped_storage()._cdata


def _op_kind(func, name: str) -> str:
    if func.is_view or name in ("aten.detach", "aten.alias", "aten.lift_fresh"):
        return "view"
    short = name.split(".", 1)[1]
    if not name.startswith("aten."):
        return "memory"
    if short in MATMUL_OPS:
        return "matmul"
    if "attention" in short:
        return "attention"
    return "memory"


def _cpu_flash_flops(func_name: str, args, kwargs) -> tuple[float, float] | None:
    """(executed, model) FLOPs of torch's CPU flash-attention kernels, which torch.utils.flop_counter's table
    lacks: its formulas for the CUDA kernels (the whole square, GQA heads broadcast), halved where the kernel is
    causal (it skips the masked blocks); the model count leaves out the backward's recomputed scores."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if func_name == "aten._scaled_dot_product_flash_attention_for_cpu":
        q, k, v = args[:3]
        causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        full = float(sdpa_flop_count(q.shape, k.shape, v.shape))
        return full * (0.5 if causal else 1.0), full
    if func_name == "aten._scaled_dot_product_flash_attention_for_cpu_backward":
        grad, q, k, v = args[:4]
        causal = args[7] if len(args) > 7 else kwargs.get("is_causal", False)
        full = float(sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape))
        return full * (0.5 if causal else 1.0), full * (1.0 - ATTENTION_BWD_RECOMPUTE)
    return None


def trace_model(target: TraceTarget, dtype: str = "bf16", samples: int | None = None) -> ModelTrace:
    """Trace one micro-batch of `samples` (default: the target's) in `dtype` ("bf16", "fp16" or "fp32": the
    weights are cast to it, as FSDP2's mixed precision computes)."""
    import time

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map
    from torch.utils.flop_counter import flop_registry
    from torch.utils.module_tracker import ModuleTracker

    started = time.perf_counter()
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    samples = samples or target.samples
    model = target.build()
    container = target.blocks(model)
    items = _items(container) if container is not None else []
    n_blocks = len(items)
    # the whole model's parameters, layer by layer, before any block is dropped
    identical = n_blocks > 2 and len({_signature(m) for _, m in items}) == 1
    traced_keys = [key for key, _ in items[:2]] if identical else [key for key, _ in items]
    repeat = {key: 1 for key in traced_keys}
    if identical:
        repeat[traced_keys[1]] = n_blocks - 1
        _keep_first_blocks(container, 2)

    in_block = {id(p) for _, m in items for p in m.parameters()}
    root_params = [p for p in model.parameters() if id(p) not in in_block]
    in_block_buf = {id(b) for _, m in items for b in m.buffers()}
    root_buffers = [b for b in model.buffers() if id(b) not in in_block_buf]
    # the weights in the compute dtype, as FSDP2's mixed precision gathers them; buffers keep theirs (rotary
    # tables stay fp32); tied weights stay tied (one Parameter, its data replaced)
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch_dtype)

    # to_empty() reads the meta parameters (empty_like): let them in for that step only
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:
        model.to_empty(device="cpu")
        model.train()
        args, kwargs = target.inputs(samples)
        # floating inputs in the compute dtype, as FSDP2's mixed precision casts the forward's inputs
        args, kwargs = tree_map(
            lambda t: t.to(torch_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
            (args, kwargs),
        )
    fake.allow_non_fake_inputs = False
    blocks_now = dict(_items(target.blocks(model))) if container is not None else {}
    known = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}

    tracker = ModuleTracker()
    block_names: dict[str, str] = {}
    root_name = type(model).__name__
    for fqn, module in model.named_modules():
        if id(module) in {id(m) for m in blocks_now.values()}:
            key = next(k for k, m in blocks_now.items() if m is module)
            block_names[f"{root_name}.{fqn}"] = key

    order = {key: i for i, key in enumerate(blocks_now)}

    def current_layer() -> str:
        # ModuleTracker's parents is a set, and in backward it can still hold a block whose backward ended (its
        # post-backward hook fires late): several blocks may match. Backward runs the blocks last to first, so the
        # current one is the first of them; forward (no stale entries) the last. Taking the set's first match made
        # the layer of backward's ops depend on the hash seed (op counts 168 or 226 for one ViT).
        found = {key for parent in tracker.parents for name, key in block_names.items()
                 if parent == name or parent.startswith(name + ".")}  # fmt: skip
        if not found:
            return ROOT
        pick = min if phase[0] == "backward" else max
        return pick(found, key=order.__getitem__)

    counts: dict[tuple[str, str, str], list] = {}
    saved: dict[str, int] = {}
    seen_saved: set[int] = set()
    phase = ["forward"]

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = f"{func.namespace}.{func._overloadpacket.__name__}"
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            # metadata queries (prim.device, aten.sym_size, ...) return no tensor: they move nothing
            kind = _op_kind(func, name) if outs else "view"
            counted = _cpu_flash_flops(name, args, kwargs)
            if counted is None and func._overloadpacket in flop_registry:
                both = float(flop_registry[func._overloadpacket](*args, **kwargs, out_val=out))
                counted = (both, both)
            flops, model_flops = counted or (0.0, 0.0)
            moved = 0
            if kind != "view":
                tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
                moved = sum(t.numel() * t.element_size() for t in tensors)
            key = (current_layer(), phase[0], name)
            acc = counts.setdefault(key, [kind, 0, 0.0, 0.0, 0.0])
            acc[1] += 1
            acc[2] += flops
            acc[3] += moved
            acc[4] += model_flops
            return out

    def pack(t):
        k = _storage_key(t)
        if k not in known and k not in seen_saved:
            seen_saved.add(k)
            layer = current_layer()
            saved[layer] = saved.get(layer, 0) + t.untyped_storage().nbytes()
        return t

    # what full checkpointing keeps of a block: its tensor inputs (not a parameter, buffer or an input an
    # earlier block already took, which is shared and counted once)
    inputs_of: dict[str, int] = {}
    seen_inputs: set[int] = set()

    def take_inputs(module, a, kw):
        key = next(k for k, m in blocks_now.items() if m is module)
        total = 0
        for t in tree_flatten((a, kw))[0]:
            if isinstance(t, torch.Tensor):
                k = _storage_key(t)
                if k not in known and k not in seen_inputs:
                    seen_inputs.add(k)
                    total += t.untyped_storage().nbytes()
        inputs_of[key] = inputs_of.get(key, 0) + total

    hooks = [m.register_forward_pre_hook(take_inputs, with_kwargs=True) for m in blocks_now.values()]
    try:
        with fake, tracker, Record(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*args, **kwargs)
            loss = target.loss(out, samples)
            # the chunked LM loss checkpoints its chunks: it keeps its input alive without saving it
            if target.tokens_per_sample is not None and isinstance(out, torch.Tensor):
                k = _storage_key(out)
                if k not in seen_saved:
                    seen_saved.add(k)
                    saved[ROOT] = saved.get(ROOT, 0) + out.untyped_storage().nbytes()
            phase[0] = "backward"
            loss.backward()
    except (RuntimeError, NotImplementedError) as e:  # a kernel without a fake (meta) version for this dtype
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--precision: tracing {target.name} in {dtype} failed ({first}); try another dtype") from e
    finally:
        for h in hooks:
            h.remove()

    layers = [
        TracedLayer(
            ROOT,
            1,
            sum(p.numel() for p in root_params),
            len(root_params),
            tuple(tuple(p.shape) for p in root_params),
            sum(b.numel() * b.element_size() for b in root_buffers),
            saved.get(ROOT, 0),
            saved.get(ROOT, 0),
        )
    ]
    for key in traced_keys:
        m = blocks_now[key]
        params = list(m.parameters())
        layers.append(
            TracedLayer(
                key,
                repeat[key],
                sum(p.numel() for p in params),
                len(params),
                tuple(tuple(p.shape) for p in params),
                sum(b.numel() * b.element_size() for b in m.buffers()),
                saved.get(key, 0),
                inputs_of.get(key, 0),
            )
        )
    ops = tuple(
        OpCount(layer, ph, op, kind, calls, flops, moved, model_flops)
        for (layer, ph, op), (kind, calls, flops, moved, model_flops) in sorted(counts.items())
    )
    notes: tuple[str, ...] = ()
    if n_blocks == 0:
        notes = ("no repeated blocks found: the model is one layer to FSDP and checkpointing",)
    return ModelTrace(
        target.name,
        samples,
        target.tokens_per_sample,
        dtype,
        torch.empty((), dtype=torch_dtype).element_size(),
        n_blocks,
        tuple(layers),
        ops,
        time.perf_counter() - started,
        notes,
    )


def _count(n: int) -> str:
    return f"{n / 1e6:,.2f}M" if n >= 1e5 else f"{n:,}"


def describe(trace: ModelTrace) -> str:
    """One line: the model's size, a micro-batch's FLOPs and what it keeps for backward."""
    return (
        f"{trace.name}: {_count(trace.params)} params in {trace.n_blocks} blocks; one micro-batch of "
        f"{trace.samples}: {trace.flops() / 1e9:,.3g} GFLOP, {trace.saved_bytes() / 1e9:,.3g} GB kept for backward "
        f"(traced in {trace.seconds:.1f} s)"
    )
