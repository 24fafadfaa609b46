"""Metric sinks. JSONL is always written by rank 0: one object per line, `{"step": ..., "loss": ...}`."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf literal; keep the file parseable by strict readers
    return value


class JsonlSink:
    def __init__(self, path: Path, append: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a" if append else "w", buffering=1)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def close(self, summary: dict | None = None, end: str = "finished") -> None:
        self._file.close()  # the summary goes to summary.json, beside this file


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
