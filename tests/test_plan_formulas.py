"""The planner's formulas against published numbers and against tensors autograd actually saves."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from scaletrain.hardware import make_cluster
from scaletrain.models.llama.model import LlamaArgs, TransformerBlock, precompute_rope
from scaletrain.plan.comm import collective_seconds, group_placement
from scaletrain.plan.memory import (
    gpt_layer_saved_tensor_bytes,
    korthikanti_layer_activation_bytes,
    layer_activation_bytes_per_token,
    output_layer_saved_bytes_per_token,
    zero_model_state_bytes,
)
from scaletrain.plan.pipeline import activations_in_flight, bubble_ratio, bubble_share, schedule_code


def test_zero_paper_example_7_5b_on_64_ranks():
    # Rajbhandari et al. 2020, Figure 1: Ψ = 7.5B, N_d = 64 -> 120, 31.4, 16.6, 1.9 GB
    got = [round(zero_model_state_bytes(7.5e9, 64, stage) / 1e9, 1) for stage in range(4)]
    assert got == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (2048, 4, 4096, 32, 4), (1024, 2, 1024, 16, 1)])
def test_korthikanti_table2_settings(s, b, h, a, t):
    sbh = s * b * h
    k = korthikanti_layer_activation_bytes
    assert k(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert k(s, b, h, a, t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert k(s, b, h, a, t, sequence_parallel=True) == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    assert k(s, b, h, a, t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert k(s, b, h, a, t, True, "selective") == pytest.approx(34 * sbh / t)
    assert k(s, b, h, a, t, recompute="full") == pytest.approx(2 * sbh)
    # with t = 1 tensor parallelism and sequence parallelism change nothing
    assert k(s, b, h, a, 1) == k(s, b, h, a, 1, True) == k(s, b, h, a)
    # the table's total is the paper's tensor-by-tensor count
    assert sum(gpt_layer_saved_tensor_bytes(s, b, h, a).values()) == pytest.approx(k(s, b, h, a))


class _GPT2Block(nn.Module):
    """The GPT-2 layer Korthikanti et al. count: LayerNorm, attention with softmax and dropouts, 4h GeLU MLP."""

    def __init__(self, h: int, a: int):
        super().__init__()
        self.a = a
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.reshape(b, s, self.a, h // self.a).transpose(1, 2).contiguous() for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(h // self.a)
        probs = F.dropout(torch.softmax(scores, dim=-1), 0.1, True)
        ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(ctx), 0.1, True)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), 0.1, True)


def _saved_bytes(module: nn.Module, fn) -> int:
    """Bytes of distinct storages autograd saves while running fn(), parameters and buffers excluded."""
    known = {p.untyped_storage().data_ptr() for p in module.parameters()}
    known |= {b.untyped_storage().data_ptr() for b in module.buffers()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in known:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_gpt2_block_measured_matches_korthikanti_reference():
    torch.manual_seed(0)
    s, b, h, a = 64, 2, 128, 4
    block = _GPT2Block(h, a).to(torch.bfloat16)
    x = torch.randn(b, s, h, dtype=torch.bfloat16, requires_grad=True)
    measured = _saved_bytes(block, lambda: block(x))
    # what the paper leaves out or counts differently: LayerNorm's mean and rstd (2 per token per norm, bf16 on
    # CPU), and CPU dropout keeps its masks in the activation dtype (2 bytes) where the paper assumes 1 byte
    layernorm_stats = 2 * 2 * 2 * s * b
    wider_masks = a * s * s * b + 2 * s * b * h
    assert measured == korthikanti_layer_activation_bytes(s, b, h, a) + layernorm_stats + wider_masks


ARGS = LlamaArgs(dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=704, vocab_size=512, max_seq_len=128)


def _llama_block(dtype, lean: bool = True):
    torch.manual_seed(0)
    block = TransformerBlock(ARGS, lean_activations=lean).to(dtype)
    cos, sin = precompute_rope(ARGS.head_dim, ARGS.max_seq_len, ARGS.rope_theta)
    return block, cos, sin


@pytest.mark.parametrize("lean", [False, True], ids=["before", "lean"])
@pytest.mark.parametrize("dtype,elem", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_llama_block_activation_bytes_measured(dtype, elem, lean):
    """Before (lean_activations=False) and after the reductions (unrepeated GQA k/v, SiLU recomputed)."""
    block, cos, sin = _llama_block(dtype, lean)
    b, s = 2, 128
    x = torch.randn(b, s, ARGS.dim, dtype=dtype, requires_grad=True)
    out = block(x, cos[:s], sin[:s])
    measured = _saved_bytes(block, lambda: block(x, cos[:s], sin[:s]))
    rope_tables = cos.nbytes + sin.nbytes  # shared by every layer, built once per model
    predicted = layer_activation_bytes_per_token(ARGS, elem, 1, "none", fused_norm=False, lean=lean) * b * s
    assert measured - rope_tables == predicted
    # the same function either way: outputs and input gradients of the lean block equal the plain block's
    plain, _, _ = _llama_block(dtype, lean=False)
    x2 = x.detach().clone().requires_grad_(True)
    ref = plain(x2, cos[:s], sin[:s])
    # bf16: flash attention sums the grouped heads' k/v gradients in fp32, the repeat's backward in bf16
    tol = {"atol": 5e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {}
    torch.testing.assert_close(out, ref, **tol)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, **tol)


def test_llama_block_full_checkpoint_keeps_only_the_input():
    block, cos, sin = _llama_block(torch.bfloat16)
    b, s = 2, 128
    x = torch.randn(b, s, ARGS.dim, dtype=torch.bfloat16, requires_grad=True)
    c, si = cos[:s].contiguous(), sin[:s].contiguous()
    measured = _saved_bytes(block, lambda: torch.utils.checkpoint.checkpoint(block, x, c, si, use_reentrant=True))
    predicted = layer_activation_bytes_per_token(ARGS, 2, 1, "full") * b * s
    assert measured - c.nbytes - si.nbytes == predicted


def test_llama_block_selective_checkpoint_keeps_matmul_and_attention_outputs():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    from torch.utils._python_dispatch import TorchDispatchMode

    save_ops = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    kept = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in save_ops:
                kept.extend(t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))
            return out

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save_ops else CheckpointPolicy.PREFER_RECOMPUTE

    block, cos, sin = _llama_block(torch.bfloat16)
    b, s = 2, 128
    x = torch.randn(b, s, ARGS.dim, dtype=torch.bfloat16, requires_grad=True)
    with Record():
        torch.utils.checkpoint.checkpoint(
            block,
            x,
            cos[:s],
            sin[:s],
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(policy),
        )
    measured = x.nbytes + sum(t.untyped_storage().nbytes() for t in kept)
    assert measured == layer_activation_bytes_per_token(ARGS, 2, 1, "selective") * b * s


@pytest.mark.parametrize("chunked", [False, True], ids=["before", "chunked"])
@pytest.mark.parametrize("dtype,elem", [(torch.bfloat16, 2), (torch.float32, 4)])
def test_output_layer_and_loss_saved_bytes_measured(dtype, elem, chunked, monkeypatch):
    """The trainer's loss (models/loss.py), whole (fp32 log-softmax kept) and in chunks (logits kept only)."""
    import scaletrain.models.loss as loss_mod

    monkeypatch.setattr(loss_mod, "LOSS_CHUNK_TOKENS", 48)  # 128 tokens: 3 chunks, the last one short
    torch.manual_seed(0)
    norm, out = nn.RMSNorm(ARGS.dim).to(dtype), nn.Linear(ARGS.dim, ARGS.vocab_size, bias=False)
    out = out.to(dtype)
    head = nn.Sequential(norm, out)
    b, s = 2, 64
    x = torch.randn(b, s, ARGS.dim, dtype=dtype, requires_grad=True)
    target = torch.randint(0, ARGS.vocab_size, (b, s))

    measured = _saved_bytes(head, lambda: loss_mod.token_loss_sum(head(x), target, chunked))
    measured -= target.nbytes  # the target exists anyway; counted in the prediction
    predicted = output_layer_saved_bytes_per_token(ARGS, elem, 1, False, chunked) * b * s - 8 * b * s
    assert measured == pytest.approx(float(predicted), abs=64)  # nll_loss's scalar total_weight
    whole = loss_mod.token_loss_sum(head(x), target, chunked=False)
    torch.testing.assert_close(loss_mod.token_loss_sum(head(x), target, chunked), whole)


def test_llama_8b_block_is_44_h_plain_and_megatrons_34_h_lean():
    from scaletrain.models import preset_spec

    a = preset_spec("llama-8b").shape()
    per_token = float(layer_activation_bytes_per_token(a, 2, 1, "none", fused_norm=True, lean=False))
    assert per_token == 16 * a.dim + 8 * a.ffn_dim + 4 * a.n_heads + 8
    assert round(per_token / a.dim) == 44
    kv = a.n_kv_heads * a.head_dim
    lean = float(layer_activation_bytes_per_token(a, 2, 1, "none", fused_norm=True))
    assert lean == 12 * a.dim + 4 * kv + 6 * a.ffn_dim + 4 * a.n_heads + 8
    assert round(lean / a.dim) == 34  # Megatron's 34·s·b·h for GPT's block
    # tensor parallel with sequence parallel shards everything but the gathered linear inputs (2 x h x 2 bytes)
    t8 = float(layer_activation_bytes_per_token(a, 2, 8, "none", lean=False))
    assert t8 == pytest.approx((per_token - 4 * a.dim) / 8 + 4 * a.dim)


def test_bubble_formulas():
    one_f1b, gpipe = schedule_code("1F1B"), schedule_code("GPipe")
    inter, zbv = schedule_code("Interleaved1F1B"), schedule_code("ZBVZeroBubble")
    izb = schedule_code("InterleavedZeroBubble")
    for p, m in [(4, 8), (8, 32), (16, 16)]:
        assert bubble_ratio(one_f1b, p, m, 1) == pytest.approx((p - 1) / m)
        assert bubble_share(one_f1b, p, m, 1) == pytest.approx((p - 1) / (m + p - 1))
        assert bubble_ratio(gpipe, p, m, 1) == pytest.approx((p - 1) / m)
        assert bubble_ratio(inter, p, m, 2) == pytest.approx((p - 1) / (2 * m))
        assert bubble_ratio(izb, p, m, 2) == pytest.approx((p - 1) / (3 * 2 * m))
        assert bubble_ratio(zbv, p, m, 2) == 0
        assert activations_in_flight(gpipe, p, m, 1) == m
        assert activations_in_flight(one_f1b, p, m, 1) == min(p, m)
        assert activations_in_flight(inter, p, m, 2) == pytest.approx(min(p, m) * (1 + (p - 1) / (2 * p)))
    assert bubble_ratio(0, 1, 8, 1) == 0 and activations_in_flight(0, 1, 8, 1) == 1


def test_ring_collectives_over_the_links_they_cross():
    c = make_cluster("h100-sxm", 64, "nvlink4,ib-ndr")
    S = 1e9
    # 8 ranks inside one node: ring all-reduce 2(n-1)/n S / bw
    t = collective_seconds("all_reduce", S, 8, 1, c)
    assert t == pytest.approx(2 * 7 / 8 * S / c.intra_bw + 2 * 7 * c.intra_link.latency_s)
    # one rank per node across 8 nodes (members 8 apart): only the NIC share of one GPU
    t = collective_seconds("all_gather", S, 8, 8, c)
    assert t == pytest.approx(7 / 8 * S / c.inter_bw_per_gpu + 7 * c.inter_link.latency_s)
    assert group_placement(16, 1, 8) == (8, 2)  # TP 16 spans two nodes
    assert c.inter_bw_per_gpu == pytest.approx(400e9 / 8 * 0.8)  # one 400 Gb/s NDR port per GPU


def _dispatched_ops(preset: str, ac: str) -> tuple[int, int]:
    """(forward incl. loss, backward) ATen ops of the built-in model as the trainer wraps it for `ac`."""
    from scaletrain.hardware.op_profile import count_dispatched_ops
    from scaletrain.models import preset_spec
    from scaletrain.parallel.activation_checkpoint import apply_activation_checkpointing

    spec = preset_spec(preset)
    args = spec.shape()
    model = spec.build("meta").to_empty(device="cpu")
    spec.init_weights(model, seed=0)
    if ac != "none":
        apply_activation_checkpointing(model, ac, "op", 2)
    x = torch.randint(0, args.vocab_size, (2, 64))
    held = {}

    def forward():
        held["loss"] = F.cross_entropy(model(x).float().flatten(0, 1), x.flatten(), reduction="sum")

    return count_dispatched_ops(forward), count_dispatched_ops(lambda: held["loss"].backward())


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_op_counts_per_block_are_what_the_built_model_dispatches(ac):
    from scaletrain.models import preset_spec
    from scaletrain.plan.steptime import OPS_PER_BLOCK, OPS_ROOT

    tiny, small = _dispatched_ops("tiny", ac), _dispatched_ops("small", ac)  # 4 and 8 blocks
    extra = preset_spec("small").shape().n_layers - preset_spec("tiny").shape().n_layers
    per_block = tuple((s - t) // extra for s, t in zip(small, tiny))
    assert per_block == OPS_PER_BLOCK[ac]
    assert tuple(t - preset_spec("tiny").shape().n_layers * b for t, b in zip(tiny, per_block)) == OPS_ROOT


def test_dispatch_overhead_is_paid_per_micro_batch_on_cpu_and_hidden_on_big_gpu_work():
    from scaletrain.models import preset_spec
    from scaletrain.plan import Layout, Workload, evaluate_layout
    from scaletrain.plan.steptime import OPS_PER_BLOCK, OPS_ROOT

    cpu = make_cluster("cpu", 2, gpus_per_node=2)
    work = Workload("tiny", preset_spec("tiny").shape(), 256, 16)
    one = evaluate_layout(work, cpu, Layout(2, 1, 1, 1, 1, 8, 1, "none", "fp32", "none"))
    eight = evaluate_layout(work, cpu, Layout(2, 1, 1, 1, 1, 1, 8, "none", "fp32", "none"))
    ops = preset_spec("tiny").shape().n_layers * sum(OPS_PER_BLOCK["none"]) + sum(OPS_ROOT)
    assert eight.time["op dispatch"] == pytest.approx(8 * ops * cpu.op_overhead_s)
    # and 7 of the 8 micro-batches add their gradients into the fp32 accumulator: read 4, read + write 8 bytes each
    accumulate = 7 * preset_spec("tiny").shape().num_params() * (4 + 8) / cpu.memory_bw
    assert eight.step_s - one.step_s == pytest.approx(7 * ops * cpu.op_overhead_s + accumulate, rel=1e-6)
    # a GPU dispatches ahead of its kernels: nothing shows for an 8B model, the host shows for a tiny one
    h100 = make_cluster("h100-sxm", 8)
    big = evaluate_layout(
        Workload("llama-8b", preset_spec("llama-8b").shape(), 8192, 8),
        h100,
        Layout(1, 8, 1, 1, 1, 1, 1, "full", "bf16", "none"),
    )
    small = evaluate_layout(
        Workload("tiny", preset_spec("tiny").shape(), 64, 8), h100, Layout(8, 1, 1, 1, 1, 1, 1, "none", "bf16", "none")
    )
    assert big.time["op dispatch"] == 0.0 and small.time["op dispatch"] > 0.0


@pytest.mark.parametrize("dim,ffn", [(128, 352), (256, 352), (128, 704)])
def test_pointwise_bytes_per_block_are_what_the_built_block_moves(dim, ffn):
    """The planner's memory-bound elements per token of one block (steptime.POINTWISE_*): every op but GEMMs,
    attention kernels and views, its tensors in and out, counted op by op as bench's step_profile counts them."""
    import dataclasses

    from scaletrain.hardware.op_profile import step_profile
    from scaletrain.models import preset_spec
    from scaletrain.models.llama.model import Llama
    from scaletrain.plan.steptime import POINTWISE_BWD_FFN, POINTWISE_BWD_H, POINTWISE_FWD_FFN, POINTWISE_FWD_H

    args = dataclasses.replace(preset_spec("tiny").shape(), dim=dim, ffn_dim=ffn, n_layers=1)
    model = Llama(args)
    block, tokens = model.layers["0"], 2 * 64
    x = torch.randn(2, 64, dim, requires_grad=True)
    held = {}

    def forward():
        held["out"] = block(x, model.rope_cos, model.rope_sin)

    fwd = step_profile(forward, 1)["pointwise"][0] / tokens / 4
    bwd = step_profile(lambda: held["out"].backward(torch.ones_like(held["out"])), 1)["pointwise"][0] / tokens / 4
    assert fwd == pytest.approx(POINTWISE_FWD_H * dim + POINTWISE_FWD_FFN * ffn, rel=0.02)
    assert bwd == pytest.approx(POINTWISE_BWD_H * dim + POINTWISE_BWD_FFN * ffn, rel=0.02)


def test_optimizer_bytes_per_parameter_are_what_a_step_moves():
    """steptime.ADAMW_BYTES_PER_PARAM: Job.step's memory-bound ops (the global norm, the clip, foreach AdamW as
    train/optim.py builds it) per parameter, counted op by op as bench's step_profile counts a step's."""
    from scaletrain.config.schema import TrainConfig
    from scaletrain.hardware.op_profile import step_profile
    from scaletrain.models import preset_spec
    from scaletrain.models.llama.model import Llama
    from scaletrain.plan.steptime import ADAMW_BYTES_PER_PARAM
    from scaletrain.train.job import clip_grads_, global_grad_norm
    from scaletrain.train.optim import build_optimizer

    torch.manual_seed(0)
    model = Llama(preset_spec("tiny").shape())
    params = list(model.parameters())
    optimizer = build_optimizer(model, TrainConfig())

    grads = [[torch.randn_like(p) for p in params] for _ in range(2)]

    def step():
        for p, g in zip(params, grads.pop()):
            p.grad = g
        norm = global_grad_norm(params)
        clip_grads_(params, 1.0, norm)
        optimizer.step()

    step()  # the first step allocates AdamW's state
    moved = step_profile(step, 1)["pointwise"][0]
    assert moved / sum(p.numel() for p in params) == pytest.approx(ADAMW_BYTES_PER_PARAM, rel=0.02)
