"""Tensor- and pipeline-parallel plans without starting ranks: the automatic TP plan, the cost-balanced stage
split, the schedules' bubble, and impossible layouts refused before launch (one line, exit 2, nothing written)."""

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from scaletrain.cli.main import main
from scaletrain.config import ModelConfig
from scaletrain.models import model_spec
from scaletrain.models.stages import split_layers, stage_costs
from scaletrain.parallel.pipeline import bubble_fraction
from scaletrain.parallel.tensor_parallel import auto_tp_plan


class HFLlamaLikeAttention(nn.Module):  # the module layout of transformers' LlamaAttention
    def __init__(self, hidden, heads, kv_heads):
        super().__init__()
        hd = hidden // heads
        self.q_proj = nn.Linear(hidden, heads * hd, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, hidden, bias=False)


class HFLlamaLikeMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)


class HFLlamaLikeLayer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, inter):
        super().__init__()
        self.self_attn = HFLlamaLikeAttention(hidden, heads, kv_heads)
        self.mlp = HFLlamaLikeMLP(hidden, inter)
        self.input_layernorm = nn.RMSNorm(hidden)
        self.post_attention_layernorm = nn.RMSNorm(hidden)


class HFLlamaLike(nn.Module):
    def __init__(self, layers=3, hidden=64, heads=4, kv_heads=2, inter=160, vocab=300):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(HFLlamaLikeLayer(hidden, heads, kv_heads, inter) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def _styles(plan):
    return {k: type(v).__name__ for k, v in plan.items()}


def test_auto_tp_plan_finds_hf_llama_projections_by_structure():
    with torch.device("meta"):
        model = HFLlamaLike()
    styles = _styles(auto_tp_plan(model))
    assert len(styles) == 3 * 7 + 2
    assert styles["model.embed_tokens"] == "ColwiseParallel" and styles["lm_head"] == "ColwiseParallel"
    for i in range(3):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert styles[p + name] == "ColwiseParallel", name
        assert styles[p + "self_attn.o_proj"] == styles[p + "mlp.down_proj"] == "RowwiseParallel"


def test_auto_tp_plan_matches_the_hand_written_one_on_the_builtin_model():
    spec = model_spec(ModelConfig(name="tiny"))
    model = spec.build()
    auto = _styles(auto_tp_plan(model))
    assert auto == _styles(spec.tp_plan(model, sequence_parallel=False, loss_parallel=False))  # same modules, styles


def test_balanced_split_beats_equal_layer_counts_when_the_head_is_big():
    costs = model_spec(ModelConfig(name="tiny", vocab_size=8192)).layer_costs(seq_len=256)
    equal = split_layers(costs, 2, "layers")
    balanced = split_layers(costs, 2, "cost")
    assert equal == [(0, 2), (2, 4)]
    assert balanced == [(0, 3), (3, 4)]
    eq_max, bal_max = max(stage_costs(costs, equal)), max(stage_costs(costs, balanced))
    assert bal_max < 0.9 * eq_max  # the pipeline's pace is its slowest stage
    # the split covers every layer once and is optimal: no other 2-way cut has a cheaper slowest stage
    assert min(max(sum(costs[:c]), sum(costs[c:])) for c in range(1, 4)) == pytest.approx(bal_max)


def test_cost_split_is_optimal_contiguous_and_covers_every_layer():
    import itertools
    import random

    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 9)
        k = rng.randint(1, n)
        costs = [rng.choice([1.0, 2.0, 3.0, rng.random() * 5]) for _ in range(n)]
        bounds = split_layers(costs, k)
        assert len(bounds) == k and bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(a < b for a, b in bounds) and all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))
        best = min(
            max(sum(costs[a:b]) for a, b in zip((0, *cut), (*cut, n)))
            for cut in itertools.combinations(range(1, n), k - 1)
        )
        assert max(stage_costs(costs, bounds)) == pytest.approx(best, rel=1e-12)


def test_stage_modules_keep_the_plain_model_names():
    spec = model_spec(ModelConfig(name="tiny"))
    model = spec.build()
    parts = [spec.stage(model, s, 2, b) for s, b in enumerate(split_layers(spec.layer_costs(64), 2))]
    names = [n for p in parts for n, _ in p.named_parameters()]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert parts[0].output is None and parts[1].tok_embeddings is None


def test_bubble_of_gpipe_is_p_minus_1_over_m_plus_p_minus_1():
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    p, m = 4, 8
    f, b = _ComputationType.FORWARD, _ComputationType.FULL_BACKWARD
    order = {r: [_Action(r, f, i) for i in range(m)] + [_Action(r, b, i) for i in range(m)] for r in range(p)}
    assert bubble_fraction(order, p) == pytest.approx((p - 1) / (m + p - 1))


BAD = [
    (["parallel.tp=2", "parallel.pp=2"], "parallel"),  # 4 != world size 2
    (["parallel.pp=8", "--nproc-per-node", "8"], "parallel.pp"),  # 8 stages, 4 layers
    (["parallel.pp=2", "parallel.pp_schedule=Interleaved1F1B", "parallel.pp_stages_per_rank=4"], "parallel.pp"),
    (["parallel.tp=2", "model.n_heads=2", "model.n_kv_heads=1"], "parallel.tp"),  # kv heads 1 not split by 2
    (["parallel.tp=4", "--nproc-per-node", "4", "model.n_heads=2", "model.n_kv_heads=2"], "parallel.tp"),
    (["parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1", "--nproc-per-node", "4"], "parallel.tp"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),  # SP without TP
    (["parallel.pp=2", "parallel.pp_schedule=1F1B", "parallel.pp_stages_per_rank=2"], "parallel.pp_stages_per_rank"),
    (["parallel.pp=2", "parallel.pp_microbatches=3"], "parallel.pp_microbatches"),  # 16 per rank / 3
    (["parallel.pp=2", "parallel.pp_microbatches=1"], "parallel.pp_microbatches"),  # 1F1B: 1 < 2 stages
    (["parallel.pp=2", "precision.dtype=fp16"], "precision.dtype"),
    (["parallel.pp=2", "parallel.compile=true", "parallel.pp_schedule=ZBVZeroBubble"], "parallel.compile"),
]


@pytest.mark.parametrize("args, field", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_impossible_layouts_are_refused_before_launch(tmp_path, monkeypatch, args, field):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["train", *args])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"scaletrain: error: {field}"), result.stderr
    assert list(tmp_path.iterdir()) == []
