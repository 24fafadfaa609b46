"""The loader: deterministic order, every rank a disjoint share, a position that survives a change of world size."""

import torch

from scaletrain.config import DataConfig
from scaletrain.data import DistributedLoader, TokenWindows, open_datasets, stdlib_files


def _windows(n_tokens=10_001, seq=10):
    return TokenWindows(torch.arange(n_tokens), seq)


def _step_samples(loaders):
    """Global sample starts (first input token / seq) of one step across all ranks, in rank order."""
    out = []
    for ld in loaders:
        for mb in ld.next_step():
            out += (mb.inputs[:, 0] // ld.windows.seq_len).tolist()
    return out


def test_windows_are_shifted_pairs():
    b = _windows().gather(torch.tensor([0, 3]))
    assert b.inputs[1].tolist() == list(range(30, 40))
    assert b.targets[1].tolist() == list(range(31, 41))


def test_same_global_batch_under_any_data_parallel_degree_and_micro_batch():
    w = _windows()
    one = DistributedLoader(w, 16, 16, 0, 1, seed=5)
    two = [DistributedLoader(w, 16, 8, r, 2, seed=5) for r in range(2)]
    four = [DistributedLoader(w, 16, 2, r, 4, seed=5) for r in range(4)]
    for _ in range(3):
        want = _step_samples([one])
        assert _step_samples(two) == want and _step_samples(four) == want
        assert len(set(want)) == 16  # the ranks' shares are disjoint and together the whole global batch
    assert four[0].accumulation_steps == 2
    assert one.consumed_samples == two[1].consumed_samples == four[3].consumed_samples == 48


def test_epoch_visits_every_sample_once_and_reshuffles():
    w = _windows(n_tokens=321, seq=10)  # 32 samples
    ld = DistributedLoader(w, 8, 8, 0, 1, seed=0)
    first = sum((_step_samples([ld]) for _ in range(4)), [])
    second = sum((_step_samples([ld]) for _ in range(4)), [])
    assert sorted(first) == list(range(32)) == sorted(second)
    assert first != second


def test_resume_on_another_world_size_continues_without_repeats():
    w = _windows()
    two = [DistributedLoader(w, 8, 4, r, 2, seed=1) for r in range(2)]
    seen = sum((_step_samples(two) for _ in range(5)), [])
    state = two[0].state_dict()
    four = [DistributedLoader(w, 8, 1, r, 4, seed=0) for r in range(4)]
    for ld in four:
        ld.load_state_dict(state)
    after = sum((_step_samples(four) for _ in range(5)), [])
    reference = DistributedLoader(w, 8, 8, 0, 1, seed=1)
    assert seen + after == sum((_step_samples([reference]) for _ in range(10)), [])
    assert not set(seen) & set(after)


def test_resume_at_another_world_size_across_an_epoch_boundary():
    w = _windows(n_tokens=321, seq=10)  # 32 samples; step 3 (samples 24-35) ends epoch 0 and starts epoch 1
    reference = DistributedLoader(w, 12, 12, 0, 1, seed=3)
    want = [_step_samples([reference]) for _ in range(6)]  # 72 samples: two full epochs and a bit
    flat = sum(want, [])
    assert sorted(flat[:32]) == list(range(32)) == sorted(flat[32:64]) and flat[:32] != flat[32:64]
    four = [DistributedLoader(w, 12, 3, r, 4, seed=3) for r in range(4)]
    got = [_step_samples(four) for _ in range(2)]
    two = [DistributedLoader(w, 12, 2, r, 2, seed=0) for r in range(2)]
    for ld in two:
        ld.load_state_dict(four[0].state_dict())
    got += [_step_samples(two) for _ in range(4)]  # resumed just before the boundary, on half the ranks
    assert got == want


def test_stdlib_source_is_deterministic_bytes():
    files = stdlib_files()
    assert files == sorted(files) and len(files) > 100
    cfg = DataConfig(max_bytes=50_000)
    a, b = open_datasets(cfg, 256, 0)[0], open_datasets(cfg, 256, 0)[0]
    assert a.train.num_tokens + a.val.num_tokens == 50_000 and a.val.num_tokens == 2_500  # val_fraction 0.05
    assert (a.train.read(0, a.train.num_tokens) == b.train.read(0, b.train.num_tokens)).all()
    assert int(a.train.read(0, a.train.num_tokens).max()) < 256 and a.has_documents
