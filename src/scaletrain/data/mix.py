"""Which dataset each global sample comes from, when several are mixed by weight.

Weights become exact integer quotas q_k over a period of D = sum(q) samples (each normalised weight as a fraction
with a denominator <= 1,000: 0.7/0.3 -> 7/3 of 10). Inside the period, sample n goes to the dataset with the largest
deficit (n+1)·q_k/D − (samples it already has), ties to the first listed; the period then repeats. Guarantee,
checked when the schedule is built: after every prefix of n global samples, dataset k has contributed within ±1 of
n·q_k/D samples, so any window of m consecutive samples holds m·q_k/D ± 2 of them and every aligned window of D
samples exactly q_k. Sample i maps to (dataset, its local sample number) in O(1) from two arrays of length D, so the
mix has no state beyond the loader's one number and resumes exactly at any world size.
"""

from __future__ import annotations

from fractions import Fraction
from functools import reduce
from math import gcd, lcm

import numpy as np

MAX_DENOMINATOR = 1_000  # weights are read to ~3 significant digits: 0.333 and 1/3 both become 1/3
MAX_PERIOD = 100_000  # samples per period: the two arrays stay below 1 MB and build in well under a second


def quotas(weights: list[float]) -> list[int]:
    """Integer quotas proportional to the weights (ValueError when their period would exceed MAX_PERIOD)."""
    total = sum(weights)
    fractions = [Fraction(w / total).limit_denominator(MAX_DENOMINATOR) for w in weights]
    if any(f == 0 for f in fractions):
        raise ValueError(f"a weight below 1/{MAX_DENOMINATOR} of the total leaves its dataset unused; drop it")
    denominator = lcm(*(f.denominator for f in fractions))
    q = [int(f * denominator) for f in fractions]
    g = reduce(gcd, q)
    q = [x // g for x in q]
    if sum(q) > MAX_PERIOD:
        raise ValueError(f"the weights repeat only every {sum(q)} samples (> {MAX_PERIOD}); round them to fewer digits")
    return q


class MixSchedule:
    """Global sample index -> (dataset, that dataset's own sample count before it)."""

    def __init__(self, weights: list[float]):
        self.quotas = quotas(weights) if len(weights) > 1 else [1]
        period = sum(self.quotas)
        counts = [0] * len(self.quotas)
        dataset = np.empty(period, dtype=np.int32)
        local = np.empty(period, dtype=np.int64)
        for n in range(period):
            k = max(range(len(counts)), key=lambda k: ((n + 1) * self.quotas[k] - counts[k] * period, -k))
            dataset[n], local[n] = k, counts[k]
            counts[k] += 1
        self.period, self.dataset, self.local = period, dataset, local
        for k, q in enumerate(self.quotas):  # the documented guarantee, on the one period that repeats
            prefix = np.cumsum(dataset == k)
            if np.abs(prefix - np.arange(1, period + 1) * q / period).max() > 1 + 1e-9:
                raise AssertionError(f"mix schedule off by more than one sample for quotas {self.quotas}")

    @property
    def weights(self) -> list[float]:
        return [q / self.period for q in self.quotas]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, local sample number) of each global sample index."""
        cycle, pos = np.divmod(np.asarray(indices, dtype=np.int64), self.period)
        ds = self.dataset[pos]
        quota = np.asarray(self.quotas, dtype=np.int64)[ds]
        return ds, cycle * quota + self.local[pos]
