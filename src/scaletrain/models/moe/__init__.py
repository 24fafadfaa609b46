"""The built-in mixture-of-experts decoder family (DeepSeek-style fine-grained routed experts + shared experts):
the model (model.py), expert load and balancing (balance.py), its spec (spec.py) and its presets (below). Expert
parallelism: parallel/expert.py."""

from scaletrain.models.moe.args import MoEArgs
from scaletrain.models.moe.spec import MoESpec

SPEC = MoESpec

PRESETS: dict[str, MoEArgs] = {
    # byte-level toy sizes for CPU ranks
    "moe-tiny": MoEArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=256,
        max_seq_len=512,
        n_experts=8,
        top_k=2,
        expert_dim=32,
    ),  # fmt: skip
    "moe-small": MoEArgs(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=256,
        max_seq_len=1024,
        n_experts=16,
        top_k=4,
        expert_dim=128,
        n_dense_layers=1,
        ffn_dim=704,
    ),  # fmt: skip
    # DeepSeek-V2-Lite's routed shape (64 experts, top 6, 2 shared, first block dense; arXiv 2405.04434 §3.1.2)
    # on GQA attention instead of MLA: for planning and GPU checks, built on meta
    "moe-16b": MoEArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=102400,
        max_seq_len=4096,
        n_experts=64,
        top_k=6,
        expert_dim=1408,
        n_shared_experts=2,
        n_dense_layers=1,
        ffn_dim=10944,
    ),  # fmt: skip
    # DeepSeek-V3's shape (config.json of deepseek-ai/DeepSeek-V3; arXiv 2412.19437 §4.2: 61 blocks, the first 3
    # dense, 256 routed experts of 2048 + 1 shared, top 8, sigmoid scores, 4K-token pre-training sequences) on
    # multi-head attention of the same width instead of MLA (~205M instead of ~187M parameters a block) and without
    # the multi-token-prediction module: 672B parameters against the published 671B. For planning, built on meta
    "moe-671b": MoEArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        vocab_size=129280,
        max_seq_len=4096,
        n_experts=256,
        top_k=8,
        expert_dim=2048,
        n_shared_experts=1,
        n_dense_layers=3,
        ffn_dim=18432,
    ),  # fmt: skip
}

__all__ = ["PRESETS", "SPEC", "MoEArgs", "MoESpec"]
