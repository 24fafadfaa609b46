"""The published Llama 3 405B layout (Llama 3 paper, sec. 3.3: 8,192 H100 80 GB, TP 8, PP 16, DP 64, sequence 8,192,
global batch 16M tokens = 2,048 sequences, micro-batch 1, no activation checkpointing), evaluated by the planner's
Python API as scaletrain would run it (FSDP over the 64 data-parallel ranks, 1F1B, bf16).

It does not fit, and these tests pin why, line by line, and what it would take; the numbers are the planner's
predictions, not measurements on H100s:
- activations, 112 GB: pipeline rank 0 keeps 16 micro-batches in flight (1F1B, pp 16) of its 7 blocks (the
  cost-balanced split gives stage 0 the embedding and one block fewer), 122 kB per token and block. 65.5 kB of those
  (53 %) are the inputs of q/k/v and of the SwiGLU gate/up that DTensor's sequence parallelism all-gathers and
  autograd keeps whole; Megatron re-gathers them in backward instead. Without them: 52 GB.
- gradients, 12.75 GB: torch's pipeline schedules accumulate FSDP gradients unsharded over the 32 micro-batches
  (parallel.fsdp_accumulate cannot change that under pp > 1); sharded they would be 0.2 GB.
With both, the prediction is 63.5 GB: it would fit. Meta also ran a custom interleaved schedule and moved a block off
the first and last stages; the planner's Interleaved1F1B keeps more in flight on rank 0, not less.
"""

from __future__ import annotations

import numpy as np
import pytest

from scaletrain.hardware.cluster import make_cluster
from scaletrain.models import preset_spec
from scaletrain.plan import Layout, Workload, evaluate_layout
from scaletrain.plan.memory import (
    DEFAULT_MEMORY_OPTIONS,
    FRAGMENTATION_SHARE,
    MemoryOptions,
    holds_unsharded_grads,
    layer_activation_bytes_per_token,
)
from scaletrain.plan.pipeline import activations_in_flight, schedule_code

GB = 1e9
META = Layout(1, 64, 8, 16, 1, 1, 32, "none", "bf16", "1F1B")  # dp_shard 64, tp 8, pp 16, mb 1 x 32


def _predict(options: MemoryOptions = DEFAULT_MEMORY_OPTIONS):
    shape = preset_spec("llama-405b").shape()
    return shape, evaluate_layout(
        Workload("llama-405b", shape, 8192, 2048), make_cluster("h100-sxm", 8192), META, options
    )


def test_meta_layout_is_what_was_published():
    assert META.world_size == 8192 and META.dp == 64
    assert META.micro_batch * META.accumulation * META.dp * 8192 == 2048 * 8192  # 16M tokens per step
    inflight = activations_in_flight(np.array([schedule_code("1F1B")]), np.array([16]), np.array([32]), np.array([1]))
    assert float(inflight[0]) == 16.0  # 1F1B: stage 0 holds pp micro-batches


def test_405b_does_not_fit_80_gb_and_activations_are_in_the_way():
    shape, row = _predict()
    m = row.memory
    assert row.memory_total / GB == pytest.approx(139.2, abs=0.1)
    assert row.memory_total > make_cluster("h100-sxm", 8).memory_bytes
    assert max(m, key=lambda k: m[k]) == "activations"
    assert m["activations"] / GB == pytest.approx(112.3, abs=0.1)  # alone more than 80 GB
    per_token = float(layer_activation_bytes_per_token(shape, 2, 8, "none"))
    assert per_token == 122433.0
    assert m["activations"] == pytest.approx(16 * 7 * 8192 * per_token)  # 16 in flight x 7 blocks x tokens
    assert m["gradients"] / GB == pytest.approx(12.75, abs=0.01)  # unsharded inside torch's pipeline schedule
    assert holds_unsharded_grads(True, 16, 32, "sharded")


def test_what_it_would_take_to_fit():
    shape, row = _predict()
    m = row.memory
    per_token = float(layer_activation_bytes_per_token(shape, 2, 8, "none"))
    gathered_inputs = 2 * 2 * shape.dim  # q/k/v and gate/up inputs, bf16, whole sequence
    act_saved = m["activations"] * gathered_inputs / per_token
    grads_saved = m["gradients"] - m["parameters"]  # sharded fp32 gradients are as large as the fp32 shards
    total = row.memory_total - (act_saved + grads_saved) - FRAGMENTATION_SHARE * act_saved
    assert act_saved / GB == pytest.approx(60.1, abs=0.1)
    assert total / GB == pytest.approx(63.5, abs=0.1)
    assert total < make_cluster("h100-sxm", 8).memory_bytes
    # the leaner block and loss of this issue already took 20 GB off (the block kept 143 kB per token and block before)
    _, before = _predict(MemoryOptions(lean_activations=False))
    assert before.memory_total / GB == pytest.approx(159.5, abs=0.1)
