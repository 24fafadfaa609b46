"""The built-in Llama-style decoder family: the model (model.py), its tensor-parallel plan (parallelize.py), its
Hugging Face adapter (hf.py), its spec (spec.py) and its presets (below)."""

from scaletrain.models.llama.args import LlamaArgs
from scaletrain.models.llama.spec import LlamaSpec

SPEC = LlamaSpec

# Shapes of the Llama presets are Meta's published Llama 3.x configurations (config.json of each release);
# large presets exist for planning: built on the meta device they cost no memory and no time.
PRESETS: dict[str, LlamaArgs] = {
    # byte-level toy sizes for CPU ranks
    "tiny": LlamaArgs(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=352, vocab_size=256, max_seq_len=512),
    "small": LlamaArgs(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=704, vocab_size=256, max_seq_len=1024),
    "base": LlamaArgs(dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=1408, vocab_size=256, max_seq_len=1024),
    # Llama 3.2 1B / 3.1 8B / 3.1 70B / 3.1 405B shapes (128,256-token vocabulary, rope theta 500,000)
    "llama-1b": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama-8b": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama-70b": LlamaArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
    "llama-405b": LlamaArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        ffn_dim=53248,
        vocab_size=128256,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),
}

__all__ = ["PRESETS", "SPEC", "LlamaArgs", "LlamaSpec"]
