"""Writing one benchmark's section of BENCHMARKS.md: from its `## ` heading to the next one, the rest of the file
(other benchmarks' sections, hand-written notes) left as it is."""

from __future__ import annotations

import datetime
import shlex
import sys
from pathlib import Path


def write_section(
    path: Path,
    section: str,
    script: str,
    argv: list[str] | None,
    report: list[str],
    machine: str,
    note: str = "",
    footer: str = "",
) -> None:
    """Replace `section` of `path` (from that heading to the next '## ' heading) with the run's date, command,
    machine, note and `report` lines, or append it when the file has no such section."""
    args = sys.argv[1:] if argv is None else argv
    command = shlex.join(["python", script, *args])
    body = [
        section,
        "",
        f"Latest run: {datetime.date.today().isoformat()}, produced by `{command}`.",
        "",
        f"Machine: {machine}.",
        "",
        *([note, ""] if note else []),
        *report,
        *([footer, ""] if footer else []),
    ]
    old = path.read_text() if path.exists() else ""
    start = old.find(section)
    if start < 0:
        path.write_text(old.rstrip("\n") + "\n\n" + "\n".join(body))
        return
    end = old.find("\n## ", start + len(section))
    rest = old[end + 1 :] if end >= 0 else ""
    path.write_text(old[:start] + "\n".join(body) + ("\n" + rest if rest else ""))
