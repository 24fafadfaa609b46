"""The built-in Llama <-> a Hugging Face `LlamaForCausalLM` folder: names mapped, and the query/key projections
permuted between Meta's interleaved rotary layout and Hugging Face's rotate-half layout (the same permutation as
transformers' convert_llama_weights_to_hf.py)."""

from __future__ import annotations

import dataclasses
import re

import torch

from scaletrain.models.llama.model import LlamaArgs
from scaletrain.models.spec import HFAdapter

HF_NAMES = [  # (scaletrain name, Hugging Face name); {i} is the layer index
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
]


def _rename(name: str, to_hf: bool) -> str:
    for ours, hf in HF_NAMES:
        src, dst = (ours, hf) if to_hf else (hf, ours)
        m = re.fullmatch(re.escape(src).replace(re.escape("{i}"), r"(\d+)"), name)
        if m:
            return dst.replace("{i}", m.group(1)) if m.groups() else dst
    raise KeyError(f"no mapping for parameter {name!r}")


def _to_hf_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _from_hf_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def args_from_hf_config(cfg: dict) -> LlamaArgs:
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    # transformers' LlamaConfig defaults (configuration_llama.py) where config.json leaves a field out
    return LlamaArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        max_seq_len=cfg.get("max_position_embeddings", 2048),
        rope_theta=float(rope),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
    )


class LlamaHF(HFAdapter):
    def __init__(self, args: LlamaArgs):
        self.args = args

    def config(self) -> dict:
        a = self.args
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": a.dim,
            "intermediate_size": a.ffn_dim,
            "num_hidden_layers": a.n_layers,
            "num_attention_heads": a.n_heads,
            "num_key_value_heads": a.n_kv_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "max_position_embeddings": a.max_seq_len,
            "rms_norm_eps": a.norm_eps,
            "rope_theta": a.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state.items():
            if name.endswith("attention.wq.weight"):
                t = _to_hf_rotary(t, self.args.n_heads)
            elif name.endswith("attention.wk.weight"):
                t = _to_hf_rotary(t, self.args.n_kv_heads)
            out[_rename(name, to_hf=True)] = t.contiguous()
        return out

    def from_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in state.items():
            if "rotary_emb" in name:
                continue
            ours = _rename(name, to_hf=False)
            if ours.endswith("attention.wq.weight"):
                t = _from_hf_rotary(t, self.args.n_heads)
            elif ours.endswith("attention.wk.weight"):
                t = _from_hf_rotary(t, self.args.n_kv_heads)
            out[ours] = t
        return out

    def check_config(self, hf_config: dict) -> None:
        """Refuses (one line) a folder the built-in Llama cannot reproduce exactly: another architecture, biases,
        tied embeddings, rotary scaling, another shape, rope_theta or norm epsilon; model.hf=PATH trains
        transformers' own model of any of them instead."""
        fix = "train it as model.hf=FOLDER (transformers' own model) instead"
        kind = hf_config.get("model_type")
        if kind != "llama":
            raise ValueError(f"checkpoint.init_from_hf: the folder holds a {kind!r} model, not Llama; {fix}")
        for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
            if hf_config.get(flag):
                raise ValueError(
                    f"checkpoint.init_from_hf: the folder's config.json sets {flag}, which the built-in Llama lacks; {fix}"
                )
        rope = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            raise ValueError(
                f"checkpoint.init_from_hf: the folder uses {rope.get('rope_type')!r} rotary scaling, which the built-in Llama lacks; {fix}"
            )
        theirs = args_from_hf_config(hf_config)
        mine = dataclasses.replace(self.args, max_seq_len=theirs.max_seq_len)
        if theirs != mine:
            diff = [
                f"{f.name}={getattr(theirs, f.name)} (model: {getattr(mine, f.name)})"
                for f in dataclasses.fields(theirs)
                if getattr(theirs, f.name) != getattr(mine, f.name)
            ]
            raise ValueError(
                f"checkpoint.init_from_hf: the folder's config.json has {', '.join(diff)}; set model.* to match, or {fix}"
            )
