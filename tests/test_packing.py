"""Packing with per-document attention (data.packing = "document") and the loss counted over trained tokens.

Documents come in pairs whose lengths add up to seq_len + 2, so every packed row holds exactly two whole documents
and a step of G packed rows trains on the same documents as a step of 2G padded rows (data.packing = "pad", one
document per row): the per-step losses of the two layouts must agree (fp32, 1e-5), in one process and on DDP 2,
FSDP 2, TP 2 + SP, PP 2 and CP 2, for the built-in Llama and a Hugging Face family (Qwen3, tiny config made here). The
same packed rows under plain causal attention (a naive concat: positions running on, attention crossing documents)
give a different loss: that is what per-document attention fixes.
"""

from __future__ import annotations

from pathlib import Path

import json

import numpy as np
import pytest
import torch

from conftest import run_cli
from data_helpers import write_prepared
from test_parallel_layouts import launch_runner, runner_losses

TOL = 1e-5
SEQ = 16
STEPS = 3
PACKED_ROWS = 4  # global batch of the packed layout; the padded one takes twice as many rows


def paired_documents(pairs: int, seed: int) -> list[list[int]]:
    """Documents in pairs of lengths (a, SEQ + 2 - a): each pair fills one packed row exactly (SEQ targets)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(pairs):
        a = int(rng.integers(2, SEQ + 1))
        docs += [rng.integers(1, 256, a).tolist(), rng.integers(1, 256, SEQ + 2 - a).tolist()]
    return docs


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("packing") / "data"
    write_prepared(folder, {"train": paired_documents(40, 0), "val": paired_documents(4, 1)}, docs_per_shard=7)
    return folder


def _job(dataset: Path, packing: str, *extra: str) -> list[str]:
    rows = PACKED_ROWS if packing == "document" else 2 * PACKED_ROWS
    return [
        f"data.path={dataset}",
        f"data.packing={packing}",
        f"data.seq_len={SEQ}",
        f"train.steps={STEPS}",
        f"train.global_batch_size={rows}",
        *extra,
    ]


LLAMA = ["model.n_layers=2", "model.dim=64", "model.ffn_dim=128"]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> list[str]:
    from test_hf_models import FAMILIES, save_hf_folder

    return [f"model.hf={save_hf_folder(tmp_path_factory.mktemp('hf') / 'qwen3', FAMILIES['qwen3'])}"]


def _config(dataset: Path, packing: str, *extra: str):
    from scaletrain.config import load_config

    return load_config(None, _job(dataset, packing, *extra))


def test_rows_hold_whole_documents_with_their_own_positions(dataset):
    from scaletrain.data import build_loaders
    from scaletrain.models.loss import IGNORE_INDEX

    cfg = _config(dataset, "document", *LLAMA)
    train, _ = build_loaders(cfg.data, 256, 0, PACKED_ROWS, PACKED_ROWS, 0, 1)
    (batch,) = train.next_step()
    assert batch.positions is not None and batch.documents is not None
    for row in range(PACKED_ROWS):
        docs, pos = batch.documents[row], batch.positions[row]
        assert docs.tolist() == sorted(docs.tolist()) and set(docs.tolist()) == {0, 1}  # two documents, no tail
        starts = torch.nonzero(pos == 0).flatten().tolist()
        assert starts == [0, int((docs == 0).sum())]  # positions restart where the second document begins
    assert batch.trained_tokens == batch.targets.numel()  # pairs fill rows exactly: nothing padded

    pad_cfg = _config(dataset, "pad", *LLAMA)
    pad, _ = build_loaders(pad_cfg.data, 256, 0, 2 * PACKED_ROWS, 2 * PACKED_ROWS, 0, 1)
    (padded,) = pad.next_step()
    assert padded.positions is None
    # the same documents, in the same order: each packed row is two padded rows side by side
    for row in range(PACKED_ROWS):
        halves = [padded.targets[2 * row + k] for k in (0, 1)]
        kept = torch.cat([h[h != IGNORE_INDEX] for h in halves])
        assert torch.equal(kept, batch.targets[row])
    assert padded.trained_tokens == batch.trained_tokens < padded.targets.numel()


def _losses_in_process(cfg, family_spec) -> dict[str, float]:
    """Mean token loss over trained tokens of the first step's rows, after a few steps on them: packed with document
    attention, packed naively (no positions or documents: causal over the row), and padded one document per row."""
    from scaletrain.data import build_loaders
    from scaletrain.models.loss import token_loss_sum

    spec = family_spec
    model = spec.build("cpu")
    spec.init_weights(model, 0)
    spec.init_buffers(model)
    packed, _ = build_loaders(cfg.data, 256, 0, PACKED_ROWS, PACKED_ROWS, 0, 1)
    pad_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"packing": "pad"})})
    pad, _ = build_loaders(pad_cfg.data, 256, 0, 2 * PACKED_ROWS, 2 * PACKED_ROWS, 0, 1)
    (b,) = packed.next_step()
    (p,) = pad.next_step()
    n = b.trained_tokens
    # fit the rows a little first: an untrained model predicts nearly uniformly, whatever it attends to
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(10):
        opt.zero_grad()
        (token_loss_sum(model(p.inputs), p.targets) / p.trained_tokens).backward()
        opt.step()
    with torch.no_grad():
        doc = token_loss_sum(model(b.inputs, positions=b.positions, documents=b.documents), b.targets) / n
        naive = token_loss_sum(model(b.inputs), b.targets) / n
        padded = token_loss_sum(model(p.inputs), p.targets) / p.trained_tokens
    return {"document": doc.item(), "naive": naive.item(), "pad": padded.item()}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_document_attention_equals_one_document_per_row_and_naive_concat_does_not(dataset, family, request):
    from scaletrain.models.registry import model_spec

    cfg = _config(dataset, "document", *(LLAMA if family == "llama" else request.getfixturevalue("qwen3")))
    got = _losses_in_process(cfg, model_spec(cfg.model))
    assert abs(got["document"] - got["pad"]) <= TOL, got
    # functionary #265's effect: attending across documents (and positions running on) changes the loss
    assert abs(got["naive"] - got["pad"]) > 0.01, got


def test_flex_block_mask_masks_as_the_sdpa_mask():
    """The CUDA kernel's block mask (flex_attention, here run eagerly forward: CPU has no flex backward) lets each
    query see exactly what the CPU path's boolean mask does, grouped-query heads included."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from scaletrain.models.document_attention import document_attention, document_mask

    torch.manual_seed(0)
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2] * 2, [0] * 5 + [1] * 11])
    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    want = document_attention(q, k, v, document_mask(documents, "sdpa"), gqa_in_kernel=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention warns that it runs uncompiled
        got = flex_attention(q, k, v, block_mask=document_mask(documents, "flex").block_mask(), enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5)


# -- every layout, through the trainer (tests/parallel_runner.py: one launch per world size) ---------------------


@pytest.fixture(scope="module")
def masked(tmp_path_factory) -> Path:
    """The paired documents with a loss mask as chat data has one: the first third of each document (the
    "prompt") is not trained."""
    folder = tmp_path_factory.mktemp("packing_masked") / "data"
    docs = {"train": paired_documents(40, 0), "val": paired_documents(4, 1)}
    trained = {k: [[int(i >= len(d) // 3) for i in range(len(d))] for d in v] for k, v in docs.items()}
    write_prepared(folder, docs, docs_per_shard=7, trained=trained)
    return folder


ONE_PROCESS = ["parallel.dp_shard=1"]
LAYOUTS = {
    "fsdp2": ["parallel.activation_checkpoint=full"],  # the block's mask keyword through the checkpoint wrapper
    "ddp2": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "ddp2_accum": ["parallel.dp_replicate=2", "parallel.dp_shard=1", "train.micro_batch_size=1"],
    "tp2sp": ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2", "parallel.dp_shard=1"],
    "cp2": ["parallel.cp=2", "parallel.dp_shard=1", "parallel.cp_method=allgather"],
}
HF_LAYOUTS = ("tp2sp", "pp2")  # the HF family's own forward adaptation: the layouts that cut or shard it


def _run_layouts(masked: Path, qwen3: list[str], out: Path, layouts: list[str]) -> dict[str, Path]:
    """One-process references (pad and document, each family; a masked token stream), then the named layouts of
    document packing in one 2-rank launch."""
    families = {"llama": LLAMA, "qwen3": qwen3}
    single = {
        f"{f}_{p}_single": _job(masked, p, *m, *ONE_PROCESS) for f, m in families.items() for p in ("pad", "document")
    }
    # item 1: a masked token stream (concat) counts trained tokens only, the same under accumulation on 2 ranks
    stream = [f"data.path={masked}", f"data.seq_len={SEQ}", f"train.steps={STEPS}", "train.global_batch_size=8", *LLAMA]
    single["stream_single"] = [*stream, *ONE_PROCESS]
    if not (out / "single" / "stream_single" / "losses.json").exists():
        launch_runner(1, single, out / "single")
    jobs = {f"llama_{n}": _job(masked, "document", *LLAMA, *LAYOUTS[n]) for n in layouts}
    jobs |= {f"qwen3_{n}": _job(masked, "document", *qwen3, *LAYOUTS[n]) for n in layouts if n in HF_LAYOUTS}
    if "ddp2_accum" in layouts:
        jobs["stream_ddp2_accum"] = [*stream, *LAYOUTS["ddp2_accum"]]
    launch_runner(2, jobs, out / "two")
    return {**{n: out / "single" / n for n in single}, **{n: out / "two" / n for n in jobs}}


@pytest.fixture(scope="module")
def runs_fsdp(masked, qwen3, tmp_path_factory) -> dict[str, Path]:
    return _run_layouts(masked, qwen3, tmp_path_factory.mktemp("packing_runs"), ["fsdp2"])


@pytest.fixture(scope="module")
def runs_all(masked, qwen3, tmp_path_factory, runs_fsdp) -> dict[str, Path]:
    out = next(iter(runs_fsdp.values())).parent.parent  # reuse the one-process references
    return _run_layouts(masked, qwen3, out, ["ddp2", "ddp2_accum", "tp2sp", "pp2", "cp2"])


def _assert_same(ref: list[float], got: list[float], what: str) -> None:
    assert len(ref) == len(got) == STEPS
    for step, (a, b) in enumerate(zip(ref, got), 1):
        assert abs(a - b) <= TOL, f"{what} step {step}: {b} vs {a}"


def test_packed_equals_padded_in_one_process_and_on_fsdp2(runs_fsdp):
    for family in ("llama", "qwen3"):
        pad = runner_losses(runs_fsdp[f"{family}_pad_single"])
        _assert_same(pad, runner_losses(runs_fsdp[f"{family}_document_single"]), f"{family} document")
    _assert_same(runner_losses(runs_fsdp["llama_pad_single"]), runner_losses(runs_fsdp["llama_fsdp2"]), "fsdp2")


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout", ["llama_ddp2", "llama_ddp2_accum", "llama_tp2sp", "llama_pp2", "llama_cp2", "qwen3_tp2sp", "qwen3_pp2"]
)
def test_packed_equals_padded_on_every_layout(runs_all, layout):
    family = layout.split("_")[0]
    _assert_same(runner_losses(runs_all[f"{family}_pad_single"]), runner_losses(runs_all[layout]), layout)


@pytest.mark.slow
def test_masked_stream_loss_is_per_trained_token_under_accumulation(runs_all):
    _assert_same(runner_losses(runs_all["stream_single"]), runner_losses(runs_all["stream_ddp2_accum"]), "stream")


def test_document_packing_with_ring_attention_is_refused_before_launch(dataset, tmp_path):
    cp = ["parallel.cp=2", "parallel.dp_shard=1", "parallel.cp_method=auto"]
    proc = run_cli(["train", *_job(dataset, "document", *LLAMA, *cp), "--nproc-per-node", "2"], tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "data.packing" in proc.stderr and "parallel.cp_method=allgather" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_the_count_is_trained_tokens_where_the_data_decides_and_every_position_otherwise(dataset, masked):
    from scaletrain.models.registry import model_spec
    from scaletrain.tasks import task_for

    for data, packing, trained_only in ((dataset, "concat", False), (masked, "concat", True), (dataset, "pad", True)):
        cfg = _config(data, packing, *LLAMA)
        task = task_for(cfg.task)
        train, _ = task.loaders(cfg, model_spec(cfg.model), 4, 0, 1)
        batch = train.next_step()[0]
        assert task.counts_vary is trained_only  # a plain stream's count needs no collective
        want = batch.trained_tokens if trained_only else batch.targets.numel()
        assert task.count(batch) == want
        if trained_only:
            assert want < batch.targets.numel()


def test_plan_prices_attention_per_document_when_documents_are_packed(tmp_path):
    from conftest import run_cli_in_process

    def tokens_per_s(*extra: str) -> float:
        args = ["plan", "--model", "llama-8b", "--gpus", "8", "--seq-len", "8192", "--top", "1", "--json", *extra]
        return json.loads(run_cli_in_process(args, tmp_path).stdout)["layouts"][0]["tokens_per_s"]

    # documents of 512 tokens in rows of 8192: each query attends to ~1/16 of the keys a whole row would give it
    assert tokens_per_s("--doc-len", "512") > 1.1 * tokens_per_s()
