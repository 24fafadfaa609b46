"""Advice on top of the search: does it fit on one GPU, what is the smallest setup that works, and what a token
budget costs on different GPU types (time, GPU-hours, money, energy, power per node)."""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.hardware.cluster import DEFAULT_PUE, Cluster, ClusterFields, make_cluster
from scaletrain.plan.layout import Workload
from scaletrain.plan.search import PlanResult, PlanRow, SearchOptions, search_layouts

MAX_GPUS_TRIED = 65536


@dataclass
class Fit:
    """Answer to "does this fit on N GPUs?": the best layout, or the reason it does not."""

    gpus: int
    fits: bool
    reason: str
    row: PlanRow | None


@dataclass
class Budget:
    """What training `tokens` tokens costs with the best layout on a cluster. Seconds, GPU-hours, USD, kWh, kW."""

    gpu: str
    gpus: int
    nodes: int
    layout: str
    step_s: float
    tokens_per_s: float
    mfu: float
    time_to_train_s: float
    gpu_hours: float
    cost_usd: float
    energy_kwh: float
    node_kw: float
    cluster_kw: float
    fits: bool = True
    note: str = ""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def fit_reason(result: PlanResult) -> str:
    """Why the best layout of a search fits, or why nothing does (the smallest memory need and its biggest lines)."""
    cap = result.cluster.memory_bytes / 1e9
    if result.rows:
        r = result.rows[0]
        return f"fits: {r.layout.describe()} needs {r.memory_total / 1e9:.1f} of {cap:.0f} GB"
    if not len(result.mem_total):
        return (
            f"model states alone (16 bytes per parameter: fp32 weights, gradients, AdamW) exceed "
            f"{cap:.0f} GB on every layout of {result.cluster.gpus} GPU(s)"
        )
    i = int(result.mem_total.argmin())
    r = result.row_at(i)
    top = sorted(r.memory.items(), key=lambda kv: -kv[1])[:2]
    return (
        f"does not fit: the leanest layout ({r.layout.describe()}) needs {r.memory_total / 1e9:.1f} GB > "
        f"{cap:.0f} GB ({', '.join(f'{k} {v / 1e9:.1f} GB' for k, v in top)})"
    )


def fits_on(work: Workload, cluster: Cluster, opts: SearchOptions | None = None) -> Fit:
    res = search_layouts(work, cluster, opts)
    return Fit(cluster.gpus, res.fits, fit_reason(res), res.rows[0] if res.rows else None)


def gpu_counts(gpus_per_node: int, limit: int = MAX_GPUS_TRIED) -> list[int]:
    """1, 2, 4 ... up to one node, then whole nodes doubling: the setups people buy or rent."""
    counts, n = [], 1
    while n < gpus_per_node:
        counts.append(n)
        n *= 2
    n = gpus_per_node
    while n <= limit:
        counts.append(n)
        n *= 2
    return counts


def smallest_setup(work: Workload, cluster: Cluster, opts: SearchOptions | None = None) -> Fit | None:
    """The fewest GPUs of the cluster's kind (1, 2, 4, ..., one node, 2 nodes, 4, ...) on which a layout fits."""
    for n in gpu_counts(cluster.gpus_per_node):
        fit = fits_on(work, cluster.with_gpus(n), opts)
        if fit.fits:
            return fit
    return None


def no_fit_message(work: Workload, cluster: Cluster, result: PlanResult, opts: SearchOptions | None = None) -> str:
    """One line for a search where nothing fits: why, and the smallest setup of this GPU that works, if any."""
    smallest = smallest_setup(work, cluster, opts)
    where = (
        f"the smallest setup that works is {smallest.gpus} x {cluster.gpu.name} ({smallest.row.layout.describe()})"
        if smallest and smallest.row
        else f"it fits on no count of {cluster.gpu.name} up to {MAX_GPUS_TRIED:,}"
    )
    return f"{work.model_name} does not fit on {cluster.gpus} x {cluster.gpu.name}: {fit_reason(result)}; {where}"


def setup_advice(work: Workload, cluster: Cluster, result: PlanResult, opts: SearchOptions | None = None) -> list[str]:
    """Lines on the setup itself: is one GPU of this kind enough, and if not, the smallest setup that fits."""
    one = fits_on(work, cluster.with_gpus(1), opts) if cluster.gpus > 1 else None
    if one is None:
        return [f"one {cluster.gpu.name}: {fit_reason(result)}"]
    advice = [f"one {cluster.gpu.name}: {one.reason}"]
    if not one.fits:
        smallest = smallest_setup(work, cluster, opts)
        if smallest and smallest.row:
            nodes = (
                "one server"
                if smallest.gpus <= cluster.gpus_per_node
                else f"{smallest.gpus // cluster.gpus_per_node} nodes"
            )
            advice.append(
                f"smallest setup that fits: {smallest.gpus} x {cluster.gpu.name} ({nodes}): "
                f"{smallest.row.layout.describe()}"
            )
    return advice


def budget_for(result: PlanResult, tokens: float) -> Budget:
    """Time, GPU-hours, cost and energy of training `tokens` tokens with the best layout of `result`."""
    c = result.cluster
    if not result.rows:
        return Budget(
            c.gpu.name,
            c.gpus,
            c.nodes,
            "-",
            float("nan"),
            0.0,
            0.0,
            float("inf"),
            float("inf"),
            float("inf"),
            float("inf"),
            c.node_power_w / 1e3,
            c.nodes * c.node_power_w / 1e3,
            False,
            fit_reason(result),
        )
    row = result.rows[0]
    seconds = tokens / row.tokens_per_s
    hours = seconds / 3600
    cluster_w = c.nodes * c.node_power_w
    return Budget(
        c.gpu.name,
        c.gpus,
        c.nodes,
        row.layout.describe(),
        row.step_s,
        row.tokens_per_s,
        row.mfu,
        seconds,
        c.gpus * hours,
        c.gpus * hours * c.usd_per_gpu_hour,
        cluster_w * c.pue * hours / 1e3,
        c.node_power_w / 1e3,
        cluster_w / 1e3,
    )


def compare_gpus(
    work: Workload,
    gpu_names: list[str],
    gpus: int,
    tokens: float,
    opts: SearchOptions | None = None,
    inter_link: str | None = None,
    usd_per_gpu_hour: float | None = None,
    pue: float | None = None,
) -> list[Budget]:
    """The same workload and token budget on `gpus` GPUs of each type, each with its usual links. ValueError naming
    --compare-gpus for an unknown type."""
    out = []
    fields = ClusterFields(gpu="--compare-gpus")
    for name in gpu_names:
        probe = make_cluster(name, gpus, fields=fields)
        interconnect = f"{probe.intra_link.name},{inter_link}" if inter_link else None
        cluster = make_cluster(
            name,
            gpus,
            interconnect,
            usd_per_gpu_hour=usd_per_gpu_hour,
            pue=DEFAULT_PUE if pue is None else pue,
            fields=fields,
        )
        out.append(budget_for(search_layouts(work, cluster, opts), tokens))
    return out
