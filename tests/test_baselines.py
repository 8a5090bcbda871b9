"""The gate's baselines as running medians (agent/gate/baselines.py): equal to NumPy's median of the whole list
however it grew, read afresh when the list was replaced, and NumPy's answer where a share is not finite."""

from __future__ import annotations

import numpy as np
import pytest

from agent.gate.baselines import RunningMedians


def test_the_running_median_equals_numpys_as_the_lists_grow() -> None:
    rng = np.random.default_rng(7)
    medians, lists = RunningMedians(), {m: [] for m in range(6)}
    for _ in range(60):
        for m, values in lists.items():
            if rng.random() < 0.8:
                values.append(rng.random(2) * rng.choice([1e-5, 1.0, 40.0]))
            if values and rng.random() < 0.6:
                got = medians.median(m, values)
                assert np.array_equal(got, np.median(np.stack(values), axis=0)), (m, len(values))


def test_a_list_replaced_by_a_shorter_one_is_read_afresh_and_clear_forgets_all() -> None:
    medians = RunningMedians()
    long = [np.array([float(x), 10.0 - x]) for x in range(9)]
    assert medians.median(1, long).tolist() == [4.0, 6.0]
    short = [np.array([100.0, 0.0]), np.array([200.0, 2.0])]
    assert medians.median(1, short).tolist() == [150.0, 1.0], "shorter than what was held: read afresh"
    medians.clear()
    other = [np.array([5.0, 5.0]), np.array([7.0, 1.0]), np.array([6.0, 3.0])]
    assert medians.median(1, other).tolist() == [6.0, 3.0]


def test_a_share_that_is_not_finite_gets_numpys_median() -> None:
    values = [np.array([1.0, 2.0]), np.array([np.nan, 3.0]), np.array([2.0, 4.0])]
    got = RunningMedians().median(0, values)
    expected = np.median(np.stack(values), axis=0)
    assert np.isnan(got[0]) and np.isnan(expected[0]) and got[1] == expected[1]


def test_no_shares_has_no_median() -> None:
    with pytest.raises(ValueError):
        RunningMedians().median(0, [])
