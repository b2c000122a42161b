"""Ranking systems from per-example scores with paired permutation tests (megatron_ext.eval.ranking).

Exact p-values (n <= 13 examples) are checked against hand-computed values; Monte Carlo ones use a
fixed seed and margins far from the threshold, so nothing here can flake.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_ext.eval.ranking import (
    RankedSystem,
    format_ranking,
    paired_permutation_test,
    rank_systems,
)


def _as_scores(**columns: list[float]) -> dict[str, dict[str, float]]:
    return {name: {f"ex{i}": float(v) for i, v in enumerate(values)} for name, values in columns.items()}


def _ranks(ranked: list[RankedSystem]) -> list[tuple[str, int]]:
    return [(r.system, r.rank) for r in ranked]


def _bernoulli_systems(n: int, probabilities: dict[str, float], seed: int = 0) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    return {
        name: {f"q{i}": 100.0 * float(x) for i, x in enumerate(rng.random(n) < p)}
        for name, p in probabilities.items()
    }


# --- the paired test ---------------------------------------------------------------------------


def test_exact_sign_flip_p_values():
    # 3 wins, 1 loss, 6 ties: |sum| >= 2 for 10 of the 16 sign patterns of the 4 non-zero differences.
    a = [1, 1, 1, 0] + [1] * 3 + [0] * 3
    b = [0, 0, 0, 1] + [1] * 3 + [0] * 3
    assert paired_permutation_test(a, b) == pytest.approx(10 / 16)
    # One-sided: sum >= 2 for 5 of 16 (sum 4: 1 pattern, sum 2: 4 patterns).
    assert paired_permutation_test(a, b, alternative="greater") == pytest.approx(5 / 16)
    # Five wins and nothing else: the one-sided sign test's 2^-5.
    assert paired_permutation_test([1] * 5, [0] * 5, alternative="greater") == pytest.approx(1 / 32)
    assert paired_permutation_test([0] * 5, [1] * 5, alternative="greater") == pytest.approx(1.0)


def test_identical_systems_have_p_value_one():
    values = np.linspace(0, 100, 50)
    assert paired_permutation_test(values, values) == 1.0
    assert paired_permutation_test(values, values + 1e-12) == 1.0  # floating-point noise is a tie


def test_monte_carlo_p_value_matches_normal_approximation():
    # The sign-flip distribution of sum(d) is close to N(0, sum(d^2)) for n = 500.
    rng = np.random.default_rng(1)
    d = rng.normal(0.1, 1.0, 500)
    z = d.sum() / math.sqrt((d**2).sum())
    expected = math.erfc(abs(z) / math.sqrt(2))
    assert 0.01 < expected < 0.5
    p = paired_permutation_test(d, np.zeros_like(d), seed=3)
    assert p == pytest.approx(expected, abs=0.02)


def test_paired_test_input_errors():
    with pytest.raises(ValueError, match="equal length"):
        paired_permutation_test([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="alternative"):
        paired_permutation_test([1, 2], [2, 1], alternative="less")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-finite"):
        paired_permutation_test([1, float("nan")], [2, 1])


# --- ranking -----------------------------------------------------------------------------------


def test_clearly_different_systems_get_ordered_ranks():
    scores = _bernoulli_systems(400, {"weak": 0.5, "strong": 0.9, "middle": 0.7})
    ranked = rank_systems(scores)
    assert _ranks(ranked) == [("strong", 1), ("middle", 2), ("weak", 3)]
    assert [r.mean for r in ranked] == sorted((r.mean for r in ranked), reverse=True)
    assert all(r.n_examples == 400 for r in ranked)
    assert ranked[0].p_value_vs_previous is None and ranked[0].p_value_vs_cluster is None
    assert all(r.p_value_vs_previous < 0.001 for r in ranked[1:])


def test_identical_and_near_identical_systems_share_a_rank():
    scores = _bernoulli_systems(300, {"base": 0.8, "weak": 0.4})
    scores["copy"] = dict(scores["base"])
    scores["noisy_copy"] = {k: v + 1e-11 for k, v in scores["base"].items()}
    ranked = rank_systems(scores)
    by_name = {r.system: r for r in ranked}
    assert by_name["base"].rank == by_name["copy"].rank == by_name["noisy_copy"].rank == 1
    assert by_name["weak"].rank == 2
    # The name breaks the tie between equal means; float-noise differences are ties (p = 1).
    assert [r.system for r in ranked[:3]] == ["noisy_copy", "base", "copy"]
    assert by_name["base"].p_value_vs_previous == 1.0 and by_name["copy"].p_value_vs_previous == 1.0


def test_better_on_average_but_not_significant_shares_the_rank():
    scores = _as_scores(
        a=[1, 1, 1, 0] + [1] * 3 + [0] * 3,  # mean 0.6
        b=[0, 0, 0, 1] + [1] * 3 + [0] * 3,  # mean 0.4
    )
    ranked = rank_systems(scores)
    assert _ranks(ranked) == [("a", 1), ("b", 1)]
    assert ranked[0].mean == pytest.approx(0.6) and ranked[1].mean == pytest.approx(0.4)
    assert ranked[1].p_value_vs_previous == pytest.approx(10 / 16)


def test_new_cluster_when_any_member_of_the_cluster_is_significantly_better():
    # a-b and b-c each differ on 5 examples (two-sided p = 2/32), a-c on all 10 (p = 2/1024).
    scores = _as_scores(
        a=[1] * 10,
        b=[0] * 5 + [1] * 5,
        c=[0] * 10,
    )
    ranked = rank_systems(scores)
    assert _ranks(ranked) == [("a", 1), ("b", 1), ("c", 2)]
    assert ranked[2].p_value_vs_previous == pytest.approx(2 / 32)
    assert ranked[2].p_value_vs_cluster == pytest.approx(2 / 1024)
    # EncodEval's one-sided convention: 1/32 < 0.05 separates every step.
    one_sided = rank_systems(scores, alternative="greater")
    assert _ranks(one_sided) == [("a", 1), ("b", 2), ("c", 3)]
    # A stricter threshold merges everything.
    assert {r.rank for r in rank_systems(scores, p_threshold=0.001)} == {1}


def test_only_shared_examples_are_compared():
    scores = _as_scores(a=[1] * 8 + [0] * 8, b=[0] * 8 + [1] * 8)  # equal on 16 shared examples
    # Extra examples scored only for one system would make it look far better (or worse).
    scores["a"].update({f"only_a{i}": 100.0 for i in range(50)})
    scores["b"].update({f"only_b{i}": 0.0 for i in range(50)})
    ranked = rank_systems(scores)
    assert all(r.n_examples == 16 for r in ranked)
    assert {r.system: r.mean for r in ranked} == {"a": 0.5, "b": 0.5}
    assert _ranks(ranked) == [("a", 1), ("b", 1)]


def test_practical_margin_and_tie_epsilon():
    n = 2000
    base = [100.0 * (i % 2) for i in range(n)]
    better = list(base)
    for i in range(0, 120, 2):  # 60 more examples right: +3 points, p at its Monte Carlo floor
        better[i] = 100.0
    scores = _as_scores(base=base, better=better)
    assert _ranks(rank_systems(scores)) == [("better", 1), ("base", 2)]
    assert _ranks(rank_systems(scores, min_difference=5.0)) == [("better", 1), ("base", 1)]

    # Every example 0.5 points better: significant by default, ties with tie_epsilon = 1.
    shifted = _as_scores(x=[v + 0.5 for v in base[:50]], y=base[:50])
    default = rank_systems(shifted)
    assert _ranks(default) == [("x", 1), ("y", 2)]
    assert default[1].p_value_vs_previous == pytest.approx(1 / 10_001)
    assert "| 2 | y | 50.00 | 1.0e-04 | 1.0e-04 | 50 |" in format_ranking(default)
    loose = rank_systems(shifted, tie_epsilon=1.0)
    assert _ranks(loose) == [("x", 1), ("y", 1)] and loose[1].p_value_vs_previous == 1.0


def test_ranking_p_values_are_the_paired_tests():
    scores = _bernoulli_systems(200, {"a": 0.62, "b": 0.55, "c": 0.5}, seed=5)
    ranked = rank_systems(scores, seed=7)
    ids = sorted(scores["a"])
    for upper, lower in zip(ranked, ranked[1:]):
        p = paired_permutation_test(
            [scores[upper.system][i] for i in ids], [scores[lower.system][i] for i in ids], seed=7
        )
        assert lower.p_value_vs_previous == p


def test_deterministic_and_independent_of_input_order():
    scores = _bernoulli_systems(150, {"a": 0.6, "b": 0.55, "c": 0.45, "d": 0.44}, seed=2)
    first = rank_systems(scores)
    assert rank_systems(scores) == first
    reordered = {
        name: dict(reversed(list(scores[name].items()))) for name in reversed(list(scores))
    }
    assert rank_systems(reordered) == first
    assert format_ranking(rank_systems(reordered)) == format_ranking(first)


def test_errors_name_the_systems():
    with pytest.raises(ValueError, match="no systems"):
        rank_systems({})
    with pytest.raises(ValueError, match="no scored examples: empty"):
        rank_systems({"full": {"x": 1.0, "y": 0.0}, "empty": {}})
    disjoint = {"alpha": {"x": 1.0, "y": 0.0}, "beta": {"z": 1.0, "w": 1.0}, "gamma": {"x": 1.0, "y": 1.0}}
    with pytest.raises(ValueError, match=r"only 0 example.*alpha=2, beta=2, gamma=2.*alpha/beta, beta/gamma"):
        rank_systems(disjoint)
    one_shared = {"alpha": {"x": 1.0, "y": 0.0}, "beta": {"x": 0.0, "z": 1.0}}
    with pytest.raises(ValueError, match=r"only 1 example.*need at least 2"):
        rank_systems(one_shared)
    with pytest.raises(ValueError, match="non-finite scores .*: beta"):
        rank_systems({"alpha": {"x": 1.0, "y": 0.0}, "beta": {"x": float("nan"), "y": 1.0}})
    with pytest.raises(ValueError, match="p_threshold"):
        rank_systems(_as_scores(a=[1, 0], b=[0, 1]), p_threshold=0.0)


def test_single_system_is_rank_one():
    ranked = rank_systems(_as_scores(only=[1, 0, 1]))
    assert _ranks(ranked) == [("only", 1)] and ranked[0].mean == pytest.approx(2 / 3)


def test_format_ranking_is_a_markdown_table():
    scores = _as_scores(**{"a|b": [100] * 10, "c": [0] * 5 + [100] * 5, "d": [0] * 10})
    table = format_ranking(rank_systems(scores))
    lines = table.strip().splitlines()
    assert lines[0] == "| Rank | System | Mean | p vs previous | p vs cluster | Examples |"
    assert lines[1] == "|---:|:---|---:|---:|---:|---:|"
    assert lines[2] == "| 1 | a\\|b | 100.00 | - | - | 10 |"
    assert lines[3] == "| 1 | c | 50.00 | 0.062 | 0.062 | 10 |"
    assert lines[4] == "| 2 | d | 0.00 | 0.062 | 0.002 | 10 |"
    assert len(lines) == 5


def test_monte_carlo_p_values_are_within_their_error_of_the_exact_ones():
    """scipy's Monte Carlo sign flips (10,000 by default) against the exact enumeration of every sign
    assignment (2**16 for 16 examples): within four standard errors, for p-values from ~0.01 to 1."""
    import numpy as np

    rng = np.random.default_rng(7)
    for shift in (0.0, 0.2, 0.5, 0.8):
        a = rng.normal(size=16) + shift
        b = rng.normal(size=16)
        exact = paired_permutation_test(a, b, n_permutations=2**16)
        sampled = paired_permutation_test(a, b, seed=3)
        error = (exact * (1 - exact) / 10_000) ** 0.5
        assert abs(sampled - exact) <= 4 * error + 1 / 10_001, (shift, exact, sampled)
