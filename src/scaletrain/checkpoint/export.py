"""Consolidating a distributed checkpoint into one file set, and importing Hugging Face Llama weights.

Formats:
- safetensors: `model.safetensors` with scaletrain's own parameter names (+ `config.json` of the model shape).
- torch: `model.pt`, a plain state dict readable with `torch.load(..., weights_only=True)`.
- hf: a Hugging Face `LlamaForCausalLM` folder (`config.json` + `model.safetensors`): names mapped, and the query/key
  projections permuted from Meta's interleaved rotary layout to Hugging Face's rotate-half layout (the same
  permutation as transformers' convert_llama_weights_to_hf.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from scaletrain.checkpoint.manifest import read_manifest
from scaletrain.models.llama import LlamaArgs

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


def to_hf_state(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if name.endswith("attention.wq.weight"):
            t = _to_hf_rotary(t, args.n_heads)
        elif name.endswith("attention.wk.weight"):
            t = _to_hf_rotary(t, args.n_kv_heads)
        out[_rename(name, to_hf=True)] = t.contiguous()
    return out


def from_hf_state(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in state.items():
        if "rotary_emb" in name:
            continue
        ours = _rename(name, to_hf=False)
        if ours.endswith("attention.wq.weight"):
            t = _from_hf_rotary(t, args.n_heads)
        elif ours.endswith("attention.wk.weight"):
            t = _from_hf_rotary(t, args.n_kv_heads)
        out[ours] = t
    return out


def hf_config(args: LlamaArgs) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim, "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads, "num_key_value_heads": args.n_kv_heads, "head_dim": args.head_dim,
        "vocab_size": args.vocab_size, "max_position_embeddings": args.max_seq_len, "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": "float32",
    }


def args_from_hf_config(cfg: dict) -> LlamaArgs:
    rope = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return LlamaArgs(dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=cfg["num_attention_heads"],
                     n_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                     ffn_dim=cfg["intermediate_size"], vocab_size=cfg["vocab_size"],
                     max_seq_len=cfg.get("max_position_embeddings", 2048), rope_theta=float(rope),
                     norm_eps=cfg.get("rms_norm_eps", 1e-5))


def load_full_model_state(ckpt: Path) -> tuple[dict[str, torch.Tensor], LlamaArgs]:
    """The consolidated model weights of a committed checkpoint, read in this one process (no process group)."""
    from scaletrain.checkpoint.safe_load import load_dcp
    from scaletrain.models.registry import build_model

    manifest = read_manifest(ckpt)
    if manifest is None or "model_args" not in manifest:
        raise ValueError(f"{ckpt}: not a committed scaletrain checkpoint (no manifest.json with model_args); "
                         f"pick a step_NNNNNNNN folder listed by `scaletrain ckpt ls`")
    args = LlamaArgs(**manifest["model_args"])
    model = build_model(args, "meta")
    model.to_empty(device="cpu")
    state = {"model": {k: v for k, v in model.state_dict().items()}}
    load_dcp(state, ckpt, no_dist=True)
    return state["model"], args


def export_checkpoint(ckpt: Path, out: Path, fmt: str) -> list[Path]:
    """Write the consolidated weights of `ckpt` into folder `out` in format safetensors | torch | hf."""
    from safetensors.torch import save_file

    state, args = load_full_model_state(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "torch":
        path = out / "model.pt"
        torch.save(state, path)
        written = [path]
    elif fmt == "safetensors":
        path = out / "model.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=1))
        written = [path, out / "config.json"]
    elif fmt == "hf":
        path = out / "model.safetensors"
        save_file(to_hf_state(state, args), str(path), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf_config(args), indent=1))
        written = [path, out / "config.json"]
    else:
        raise ValueError(f"--format: unknown format {fmt!r}; use safetensors, hf or torch")
    return written


def read_hf_weights(folder: Path, args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Hugging Face Llama safetensors (one file or shards) as scaletrain-named fp32 tensors, shapes checked."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"checkpoint.init_from_hf: no *.safetensors in {str(folder)!r}")
    cfg_path = folder / "config.json"
    if cfg_path.is_file():
        theirs = args_from_hf_config(json.loads(cfg_path.read_text()))
        mine = dataclasses.replace(args, max_seq_len=theirs.max_seq_len, rope_theta=theirs.rope_theta,
                                   norm_eps=theirs.norm_eps)
        if theirs != mine:
            raise ValueError(f"checkpoint.init_from_hf: {cfg_path} describes {theirs}, the model config is {args}; "
                             f"set model.* to match")
    hf = {}
    for f in files:
        hf.update(load_file(str(f)))
    state = {k: v.float() for k, v in from_hf_state(hf, args).items()}
    return state


def load_hf_weights(model, folder: Path, args: LlamaArgs) -> None:
    """Overwrite the (possibly sharded) model's weights with a Hugging Face Llama checkpoint's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state = read_hf_weights(folder, args)
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))
