"""The built-in Llama-style model: presets, meta construction, shapes and deterministic init."""

import time

import pytest
import torch

from scaletrain.config import ModelConfig
from scaletrain.models import model_spec, preset_spec


def test_large_presets_build_instantly_on_meta():
    start = time.perf_counter()
    model = preset_spec("llama-70b").build()
    assert time.perf_counter() - start < 5.0  # generous: meta tensors allocate nothing
    assert all(p.is_meta for p in model.parameters())
    # Llama 3.1 8B and 70B have 8.03 B and 70.55 B parameters (Meta's model cards)
    assert round(preset_spec("llama-8b").num_params() / 1e9, 2) == 8.03
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == 70.55


def test_forward_shapes_and_gqa():
    spec = model_spec(ModelConfig(name="tiny"))
    args = spec.args
    assert args.n_kv_heads < args.n_heads  # grouped-query attention in the default model
    model = spec.build("cpu")
    spec.init_weights(model, seed=0)
    logits = model(torch.randint(0, args.vocab_size, (2, 32)))
    assert logits.shape == (2, 32, args.vocab_size)
    assert torch.isfinite(logits).all()


def test_causal_prefix_does_not_see_the_future():
    spec = model_spec(ModelConfig(name="tiny"))
    model = spec.build("cpu")
    spec.init_weights(model, seed=1)
    tokens = torch.randint(0, 256, (1, 24))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20])
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_init_depends_only_on_seed_and_name():
    spec = model_spec(ModelConfig(name="tiny"))
    m1, m2 = spec.build("cpu"), spec.build("meta")
    spec.init_weights(m1, seed=3)
    m2.to_empty(device="cpu")
    spec.init_weights(m2, seed=3)
    assert [n for n, _ in m1.named_parameters()] == [n for n, _ in m2.named_parameters()]
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        assert torch.equal(p1, p2), n


@pytest.mark.parametrize(
    "override, message",
    [
        ({"name": "gpt-9"}, "model.name: unknown model 'gpt-9'; choose one of tiny, "),
        ({"name": "tiny", "n_heads": 3}, "model.dim: 128 is not divisible by model.n_heads=3"),
        ({"name": "tiny", "n_kv_heads": 3}, "model.n_kv_heads: 3 does not divide model.n_heads=4"),
        # the [model] keys are the family's own fields, checked strictly by it
        ({"bogus": 1}, "model.bogus: the llama family has no such field; it has dim, ffn_dim, max_seq_len, "),
        ({"dim": "64"}, "model.dim: input should be a valid integer (got '64')"),
        ({"dim": 1.5}, "model.dim: input should be a valid integer (got 1.5)"),
        ({"dim": 0}, "model.dim: input should be greater than 0 (got 0)"),
        ({"rope_theta": True}, "model.rope_theta: input should be a valid number (got True)"),
        ({"block": "gpt"}, "model.block: the llama family has no such field"),  # the planner's, not a key
        ({"hf": 3}, "model.hf: give a local Hugging Face model folder (got 3)"),
    ],
)
def test_bad_shapes_name_the_field(override, message):
    with pytest.raises(ValueError) as e:
        model_spec(ModelConfig(**override))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_preset_takes_any_field_of_its_family():
    spec = model_spec(ModelConfig(name="tiny", rope_theta=500000, n_layers=2))
    assert (spec.args.rope_theta, spec.args.n_layers, spec.args.dim) == (500000.0, 2, 128)
