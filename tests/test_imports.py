"""The package layering of DESIGN.md holds and nothing imports in a circle; the command starts without torch.

The graph is read from the source (every `import scaletrain...` / `from scaletrain... import`, function-level ones
included), so a lazy import inside a function counts as a dependency like any other.
"""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "scaletrain"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the scaletrain modules it imports (for `from pkg import name`, pkg.name when that is a module)."""
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == "scaletrain")
            elif (
                isinstance(node, ast.ImportFrom)
                and node.level == 0
                and node.module
                and node.module.split(".")[0] == "scaletrain"
            ):
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    targets.add(sub if sub in modules else node.module)
        # a module naming its own package reads what Python imported before it (the parent's __init__ runs first)
        graph[name] = {t for t in targets if t in modules and not name.startswith(t + ".") and t != name}
    return graph


def package_of(module: str) -> str:
    """scaletrain.plan.search -> plan; top-level modules (scaletrain, scaletrain.api, ...) -> their own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and (PKG / parts[1]).is_dir() else module


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def edges(graph, src_pkg: str) -> list[tuple[str, str]]:
    return sorted((m, t) for m, ts in graph.items() if package_of(m) == src_pkg for t in ts)


def test_no_module_imports_in_a_circle():
    assert cycles(import_graph()) == []


def test_packages_follow_the_layering():
    graph = import_graph()
    packages: dict[str, set[str]] = {}
    for m, ts in graph.items():
        packages.setdefault(package_of(m), set()).update(package_of(t) for t in ts if package_of(t) != package_of(m))
    # the top-level package module (lazy setup()/Job) may reach api and train; it is not a layer
    packages.pop("scaletrain", None)
    assert cycles(packages) == [], packages

    def bad(src_pkg, allowed):
        return [(m, t) for m, t in edges(graph, src_pkg) if package_of(t) not in allowed | {src_pkg}]

    assert [(m, t) for m, ts in graph.items() for t in ts if package_of(t) == "cli" and package_of(m) != "cli"] == []
    assert [(m, t) for m, t in edges(graph, "cli") if t == "scaletrain.cli.main"] == []  # commands never import main
    assert bad("config", set()) == []
    assert bad("models", {"config"}) == []
    assert bad("parallel", {"config", "models", "scaletrain.exit_codes"}) == []
    # job resolution sits below the trainer, the planner and the command line, which import it from there; it asks
    # monitor whether each tracker of monitor.trackers can open (monitor/sinks.py check_trackers)
    assert bad("resolve", {"config", "models", "data", "parallel", "tasks", "monitor"}) == []
    assert sorted({package_of(m) for m, ts in graph.items() for t in ts if package_of(t) == "resolve"}) == [
        "cli",
        "plan",
        "resolve",
        "train",
    ]
    assert bad("plan", {"config", "hardware", "models", "resolve"}) == []  # the planner never imports the trainer
    assert bad("tasks", {"config", "models", "data"}) == []  # below train: the trainer calls a task, never the reverse
    # the launchers reach the trainer only through its entry points: the worker, and the in-process restart's
    # worker side (launch.restart = "in-process": its store keys and the spare's serve loop)
    entries = ("scaletrain.train.worker", "scaletrain.train.inprocess")
    assert [(m, t) for m, t in edges(graph, "launch") if package_of(t) == "train" and t not in entries] == []
    assert [(m, t) for m, t in edges(graph, "train") if package_of(t) in ("launch", "cli")] == []
    assert bad("scaletrain.exit_codes", set()) == []


def test_cli_imports_no_torch():
    """`scaletrain --help`, `models` and `ckpt ls` answer without torch (~2 s of imports): the command module and
    its subcommands load no heavy package until a command that needs one runs."""
    code = "import sys, scaletrain.cli.main; print(','.join(m for m in ('torch', 'numpy', 'rich') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "", f"scaletrain.cli.main imports {proc.stdout.strip()}"


def test_the_launching_command_imports_no_trainer():
    """`scaletrain train` names the ranks' entry points and reads the rank variables, but only the ranks train: they
    are forked from a server that imported the trainer (launch/local.py RANK_IMPORTS). Importing the trainer, the
    layouts (DTensor, sympy) or DCP in the command too cost ~3.5 s of CPU in every launch before its ranks started."""
    launcher = (
        "scaletrain.parallel.rank_env",
        "scaletrain.resolve",
        "scaletrain.launch.local",
        "scaletrain.launch.inprocess",
        "scaletrain.train.worker",
        "scaletrain.train.inprocess",
    )
    heavy = ("scaletrain.train.loop", "scaletrain.parallel.apply", "torch.distributed.tensor", "sympy")
    code = (
        f"import importlib, sys\nfor m in {launcher!r}: importlib.import_module(m)\n"
        f"print(','.join(m for m in {heavy!r} if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "", f"the launching command imports {proc.stdout.strip()}"
