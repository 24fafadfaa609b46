"""What a vision-language spec is bound to: the model's config.json (canonical JSON text, hashable, recorded whole
in a checkpoint manifest), the folder it came from (weights, processor) and which parts training leaves frozen.
No torch."""

from __future__ import annotations

import json
from dataclasses import dataclass

PARTS = ("vision", "projector", "language")  # what model.freeze names: the vision tower, the projector, the LM


@dataclass(frozen=True)
class VLMArgs:
    config: str  # config.json's text, canonical JSON (sorted keys)
    path: str = ""  # the folder the config came from ("" when rebuilt from a checkpoint manifest)
    freeze: str = ""  # the frozen parts, comma-separated in PARTS order (a string: the args stay hashable)

    @property
    def config_dict(self) -> dict:
        return json.loads(self.config)

    @property
    def frozen(self) -> tuple[str, ...]:
        return tuple(p for p in self.freeze.split(",") if p)


def freeze_parts(value: object) -> str:
    """model.freeze (a list of part names, or one comma-separated string) as VLMArgs.freeze; ValueError (one line)
    naming an unknown part or a policy that trains nothing."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise ValueError(f"model.freeze: give a list of parts among {', '.join(PARTS)} (got {value!r})")
    names = [x.strip() for x in items if x.strip()]
    for name in names:
        if name not in PARTS:
            raise ValueError(f"model.freeze: unknown part {name!r}; choose among {', '.join(PARTS)}")
    if set(names) == set(PARTS):
        raise ValueError("model.freeze: every part frozen leaves nothing to train; leave at least one out")
    return ",".join(p for p in PARTS if p in names)
