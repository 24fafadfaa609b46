"""What an HF spec is bound to: the model's config.json (as text, so the args stay hashable and go into a
checkpoint manifest whole) and the folder it came from (weights, if it holds any). Reading a folder checks what
can be checked without transformers: the folder, config.json, its JSON. No torch."""

from __future__ import annotations

from scaletrain.config.errors import FieldError

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HFArgs:
    config: str  # config.json's text, canonical JSON (sorted keys)
    path: str = ""  # the folder the config came from ("" when rebuilt from a checkpoint manifest)

    @property
    def config_dict(self) -> dict:
        return json.loads(self.config)


def read_folder(path: str) -> HFArgs:
    """HFArgs of a local Hugging Face model folder; ValueError (one line, naming model.hf) when it is not one."""
    folder = Path(path)
    if not folder.is_dir():
        raise FieldError("model.hf", f"{path!r} is not a folder; point it at a local Hugging Face model folder")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FieldError(
            "model.hf",
            f"{path!r} has no config.json; point it at a Hugging Face model folder "
            f"(save_pretrained writes config.json)",
        )
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FieldError("model.hf", f"{cfg_path} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model_type"), str):
        raise FieldError("model.hf", f"{cfg_path} names no model_type; it is not a transformers config.json")
    return HFArgs(config=json.dumps(cfg, sort_keys=True), path=str(folder.resolve()))
