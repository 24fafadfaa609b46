"""`scaletrain doctor`: is this host fit for multi-GPU work? Each check says pass, warn, fail or skip, and why."""

from scaletrain.doctor.checks import Check, run_doctor
from scaletrain.doctor.topology import parse_topo_matrix

__all__ = ["Check", "parse_topo_matrix", "run_doctor"]
