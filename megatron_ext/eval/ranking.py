"""Rank systems (models) on one task from their per-example scores with paired significance tests.

The paper (arXiv 2507.00994) does not only compare mean test scores: its harness EncodEval ranks
the models of each task with head-to-head paired tests on the same test examples and clusters
them, so that models whose difference is not significant share a rank
(``encodeval/system_ranking.py``). This module does the same from the per-example scores each
fine-tuning run saves (:attr:`megatron_ext.eval.finetuning.RunResult.per_example`).

EncodEval's method
------------------
* Input: a table of segment-level scores, one column per system and one row per test example
  (per subset / language): 0/1 correctness for sequence classification, per-query NDCG@10 for
  retrieval. For metrics that exist only at corpus level (Spearman for similarity, micro-F1 for
  token classification) it draws 100 bootstrap resamples of the test set (the same indices for
  every system, unseeded ``np.random``) and uses the 100 corpus-level scores as the "segments".
* Head-to-heads: for every ordered pair of systems a one-sided paired t-test
  (``scipy.stats.ttest_rel(a, b, alternative="greater")``), plus counts of wins, losses and ties,
  where a per-example difference under ``tie_epsilon`` (0.01) is a tie. The counts are only
  reported; clustering uses the p-values alone.
* Clustering: sort systems by mean score, best first, and walk down the list. A system joins the
  current cluster unless some system already in that cluster is significantly better than it
  (p < 0.05); then it opens a new cluster. A system's rank is its cluster's index (1 = best), so
  ranks are dense and tied systems share one. Per-subset ranks are averaged into a "borda" column.
* Optional ``bootstrap_resampling`` (``sample_size`` = 100 examples drawn with replacement,
  ``num_splits`` = 100 means) before the tests. In that file the flag's parameter shadows the
  helper function of the same name, so turning it on raises ``TypeError``; the harness never does.

Where this module differs
-------------------------
* **The test**: a paired sign-flip permutation test on the mean difference
  (:func:`paired_permutation_test`) instead of the t-test. Systems are ordered by their mean, so
  the test is on the mean difference, with no normality assumption: per-example scores are 0/1,
  or piled at 0 and 100 (a question's F1, a query's NDCG@10, a sentence's entity F1), with many
  exact ties. Under the null hypothesis that the two systems are exchangeable on every example,
  each paired difference is equally likely to have either sign; the p-value is the share of sign
  assignments whose summed difference is at least as extreme as the observed one. It is exact
  (every assignment enumerated) when ``2 ** n <= n_permutations``, otherwise a Monte Carlo
  estimate ``(1 + hits) / (1 + n_permutations)`` from a fixed seed, so results are deterministic.
  When every difference is zero the p-value is 1 (the t-test gives NaN). The Wilcoxon
  signed-rank test was not chosen because it tests the location of the differences' ranks
  (pseudo-median), not the mean the ranking is by, and with 0/1 scores it reduces to a sign test
  whose result hangs on the zero-handling convention.
* **Two-sided by default**: which system is "better" is read off the same data (the means), so a
  one-sided test at 0.05 after choosing the direction is a two-sided test at 0.10.
  ``alternative="greater"`` gives EncodEval's one-sided convention.
* **tie_epsilon** zeroes per-example differences within epsilon before the test (they count as
  ties, as zeros do in the sign-flip test); its default only absorbs floating-point noise.
  ``min_difference`` (absent from EncodEval, 0 by default) additionally keeps systems whose means
  differ by no more than it in one cluster however significant the difference: with large test
  sets negligible differences become significant.
* **Inputs** are mappings ``{system: {example id: score}}``; only examples scored for every system
  are compared, and too small an overlap is an error naming the systems (EncodEval assumes
  aligned columns).
* **No bootstrap**: every system needs per-example scores. Testing bootstrap replicates as if
  they were independent examples makes p-values shrink with the number of replicates drawn, so
  metrics that exist only at corpus level (Spearman for similarity) are not ranked here; token
  classification is ranked on per-sentence entity F1, which the harness saves per example.
* The clustering rule and the dense ranks are EncodEval's. Neither corrects for multiple
  comparisons.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

Alternative = Literal["two-sided", "greater"]

DEFAULT_TIE_EPSILON = 1e-9
"""Per-example differences at most this large count as ties: floating-point noise on either the
0-1 or the 0-100 scale. Raise it (in the scores' units) to treat small differences as ties."""
DEFAULT_N_PERMUTATIONS = 10_000
"""Monte Carlo sign assignments per test: the standard error of a p-value near 0.05 is ~0.002."""


@dataclass(frozen=True, kw_only=True)
class RankedSystem:
    """One system's place in a ranking (see :func:`rank_systems`)."""

    system: str
    """The system's name, as in the scores mapping."""
    rank: int
    """Index of its cluster, 1 = best. Systems in one cluster (not significantly different) share
    it; ranks are dense (1, 1, 2, 3, ...)."""
    mean: float
    """Mean score over the examples shared by every system."""
    n_examples: int
    """Number of examples the ranking compared (the same for every system)."""
    p_value_vs_previous: float | None
    """p-value of the paired test against the system listed just above it (higher mean); ``None``
    for the first system."""
    p_value_vs_cluster: float | None
    """Smallest p-value of the tests against the systems of the cluster it was compared with: the
    systems above it in the current cluster when it was placed. Below ``p_threshold`` (and with a
    mean difference above ``min_difference``) it opened a new cluster; otherwise it joined that
    cluster. ``None`` for the first system."""


def paired_permutation_test(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    alternative: Alternative = "two-sided",
    n_permutations: int = DEFAULT_N_PERMUTATIONS,
    seed: int = 0,
    tie_epsilon: float = DEFAULT_TIE_EPSILON,
) -> float:
    """p-value of a paired sign-flip permutation test of ``mean(a - b)``.

    ``a[i]`` and ``b[i]`` are two systems' scores on the same example ``i``. The null hypothesis is
    that the systems are exchangeable on every example, so each difference ``a[i] - b[i]`` is as
    likely to have either sign. ``alternative="greater"`` tests ``a`` better than ``b``;
    ``"two-sided"`` tests any difference. Differences with ``|a[i] - b[i]| <= tie_epsilon`` are set
    to zero (ties). The test is exact when ``2 ** n <= n_permutations``; otherwise ``n_permutations``
    random sign assignments from ``seed`` give ``(1 + hits) / (1 + n_permutations)``. The result
    depends only on the differences, ``alternative``, ``n_permutations`` and ``seed``, so
    :func:`rank_systems` reports the same p-values.
    """
    a_arr = np.asarray(a, dtype=np.float64)
    b_arr = np.asarray(b, dtype=np.float64)
    if a_arr.ndim != 1 or a_arr.shape != b_arr.shape:
        raise ValueError(
            f"a and b must be 1-D and of equal length, got shapes {a_arr.shape} and {b_arr.shape}"
        )
    if a_arr.size < 1:
        raise ValueError("a paired test needs at least one example")
    _check_finite({"a": a_arr, "b": b_arr})
    diffs = (a_arr - b_arr)[:, None]
    return float(_permutation_p_values(diffs, alternative, n_permutations, seed, tie_epsilon)[0])


def rank_systems(
    scores: Mapping[str, Mapping[Hashable, float]],
    *,
    p_threshold: float = 0.05,
    tie_epsilon: float = DEFAULT_TIE_EPSILON,
    min_difference: float = 0.0,
    alternative: Alternative = "two-sided",
    n_permutations: int = DEFAULT_N_PERMUTATIONS,
    seed: int = 0,
) -> list[RankedSystem]:
    """Rank systems on one task by clustering them with paired tests on shared examples.

    ``scores[system][example_id]`` is a system's score on one test example, higher is better
    (0/1 or 0-100 correctness, a question's F1, a query's NDCG@10, a sentence's entity F1). Only
    examples scored for every system are compared. Systems are sorted by mean score (ties by name)
    and walked down: a system opens a new cluster when some system of the current cluster beats it
    with p < ``p_threshold`` (:func:`paired_permutation_test` with ``alternative``,
    ``n_permutations``, ``seed`` and ``tie_epsilon``) by more than ``min_difference`` in mean score;
    otherwise it joins the current cluster. Returns the systems best first; the result is
    deterministic.

    Raises ``ValueError`` when ``scores`` is empty, a system has no scores, a score is not finite,
    or fewer than two examples are scored for every system (naming the systems and their counts).
    """
    if not 0.0 < p_threshold <= 1.0:
        raise ValueError(f"p_threshold must be in (0, 1], got {p_threshold}")
    if min_difference < 0.0:
        raise ValueError(f"min_difference must be >= 0, got {min_difference}")
    systems = list(scores)
    if not systems:
        raise ValueError("no systems to rank")
    empty = [system for system in systems if not scores[system]]
    if empty:
        raise ValueError(f"systems with no scored examples: {', '.join(map(str, empty))}")

    ids = _shared_examples(scores)
    matrix = {system: np.array([scores[system][i] for i in ids], dtype=np.float64) for system in systems}
    _check_finite(matrix)
    means = {system: float(np.mean(values)) for system, values in matrix.items()}
    order = sorted(systems, key=lambda system: (-means[system], str(system)))

    ranked: list[RankedSystem] = []
    cluster: list[str] = []
    rank = 1
    for system in order:
        p_previous = p_cluster = None
        if cluster:
            diffs = np.stack([matrix[member] - matrix[system] for member in cluster], axis=1)
            p_values = _permutation_p_values(diffs, alternative, n_permutations, seed, tie_epsilon)
            separated = any(
                p < p_threshold and means[member] - means[system] > min_difference
                for member, p in zip(cluster, p_values)
            )
            # The previous system is always the last member of the current cluster.
            p_previous, p_cluster = float(p_values[-1]), float(min(p_values))
            if separated:
                cluster, rank = [], rank + 1
        cluster.append(system)
        ranked.append(
            RankedSystem(
                system=system,
                rank=rank,
                mean=means[system],
                n_examples=len(ids),
                p_value_vs_previous=p_previous,
                p_value_vs_cluster=p_cluster,
            )
        )
    return ranked


def format_ranking(ranked: Sequence[RankedSystem], *, digits: int = 2) -> str:
    """A markdown table of a ranking: rank, system, mean (``digits`` decimals), p-values, examples."""
    lines = [
        "| Rank | System | Mean | p vs previous | p vs cluster | Examples |",
        "|---:|:---|---:|---:|---:|---:|",
    ]
    for entry in ranked:
        name = str(entry.system).replace("|", "\\|")
        lines.append(
            f"| {entry.rank} | {name} | {entry.mean:.{digits}f} | {_format_p(entry.p_value_vs_previous)} "
            f"| {_format_p(entry.p_value_vs_cluster)} | {entry.n_examples} |"
        )
    return "\n".join(lines) + "\n"


def _format_p(p: float | None) -> str:
    if p is None:
        return "-"
    return f"{p:.1e}" if p < 1e-3 else f"{p:.3f}"


def _shared_examples(scores: Mapping[str, Mapping[Hashable, float]]) -> list[Hashable]:
    """Example ids scored for every system, in a fixed order; an error if fewer than two."""
    systems = list(scores)
    shared = set(scores[systems[0]])
    for system in systems[1:]:
        shared &= set(scores[system])
    if len(shared) >= 2:
        return sorted(shared, key=lambda i: (str(i), type(i).__name__))
    counts = ", ".join(f"{system}={len(scores[system])}" for system in systems)
    disjoint = [
        f"{x}/{y}"
        for k, x in enumerate(systems)
        for y in systems[k + 1 :]
        if not set(scores[x]).intersection(scores[y])
    ]
    detail = f"; pairs with no example in common: {', '.join(disjoint)}" if disjoint else ""
    raise ValueError(
        f"only {len(shared)} example(s) are scored for every system of {len(systems)} "
        f"(need at least 2); examples per system: {counts}{detail}"
    )


def _check_finite(values: Mapping[str, np.ndarray]) -> None:
    bad = [str(name) for name, array in values.items() if not np.all(np.isfinite(array))]
    if bad:
        raise ValueError(f"non-finite scores (NaN or inf) for: {', '.join(bad)}")


def _permutation_p_values(
    diffs: np.ndarray, alternative: Alternative, n_permutations: int, seed: int, tie_epsilon: float
) -> np.ndarray:
    """Sign-flip p-values for each column of ``diffs`` (n examples x k pairs): scipy's
    ``permutation_test`` of the sum of the differences (two-sided: of its absolute value), one sample, ``permutation_type="samples"``
    (each difference's sign flipped independently). Exact when ``2 ** n <= n_permutations``; else
    Monte Carlo from ``seed``, ``(1 + hits) / (1 + n_permutations)``. Each column's p-value equals
    what it would get alone (the resamples depend only on ``n``, ``n_permutations`` and ``seed``)."""
    from scipy.stats import permutation_test

    if alternative not in ("two-sided", "greater"):
        raise ValueError(f"alternative must be 'two-sided' or 'greater', got {alternative!r}")
    if n_permutations < 1:
        raise ValueError(f"n_permutations must be >= 1, got {n_permutations}")
    if tie_epsilon < 0.0:
        raise ValueError(f"tie_epsilon must be >= 0, got {tie_epsilon}")
    diffs = np.where(np.abs(diffs) <= tie_epsilon, 0.0, diffs)
    # Two-sided as |sum| at least the observed |sum| (scipy's own two-sided doubles the smaller tail).
    two_sided = alternative == "two-sided"

    def statistic(x: np.ndarray, axis: int) -> np.ndarray:
        total = np.sum(x, axis=axis)
        return np.abs(total) if two_sided else total

    result = permutation_test((diffs,), statistic, permutation_type="samples", vectorized=True,
                              n_resamples=n_permutations, alternative="greater", axis=0,
                              rng=np.random.default_rng(seed))
    return np.atleast_1d(np.minimum(result.pvalue, 1.0))
