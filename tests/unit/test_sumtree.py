"""apex.native.SumTree against the flat NumPy reference, per the SumTree contract."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from apex.bench.numpy_sumtree import NumpySumTree
from apex.native import SumTree
from tests.reference import ReferenceSumTree

CAPACITIES = [1, 2, 3, 5, 7, 8, 9, 100, 1000, 1025]


def snapshot(tree: SumTree) -> tuple:
    return tree.get(np.arange(len(tree))).tolist(), tree.total, tree.min


@st.composite
def update_batches(draw):
    """A capacity and a few update batches with repeated indices and integer priorities.

    Integer priorities keep every partial sum exact in float64, so the tree and the
    reference must agree bit for bit, boundaries included.
    """
    capacity = draw(st.sampled_from(CAPACITIES))
    batches = []
    for _ in range(draw(st.integers(1, 4))):
        n = draw(st.integers(0, 40))
        idx = draw(st.lists(st.integers(0, capacity - 1), min_size=n, max_size=n))
        prio = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
        batches.append((np.array(idx, dtype=np.int64), np.array(prio, dtype=np.float64)))
    return capacity, batches


@given(update_batches(), st.lists(st.floats(0, 1), min_size=1, max_size=30))
def test_matches_reference(case, fractions):
    capacity, batches = case
    tree, ref = SumTree(capacity), ReferenceSumTree(capacity)
    for idx, prio in batches:
        tree.update(idx, prio)
        ref.update(idx, prio)
        assert tree.total == ref.total
        assert tree.min == ref.min
        np.testing.assert_array_equal(tree.get(np.arange(capacity)), ref.prio)
    if ref.total > 0:
        values = np.array(fractions) * ref.total
        cumsum = np.cumsum(ref.prio)
        boundaries = cumsum[(cumsum > 0) & (cumsum <= ref.total)]  # exact edges, total included
        values = np.concatenate([values, [0.0], boundaries])
        np.testing.assert_array_equal(tree.find_prefixsum(values), ref.find_prefixsum(values))


@given(update_batches(), st.lists(st.floats(0, 1), min_size=1, max_size=30))
def test_numpy_benchmark_tree_matches_reference(case, fractions):
    """The benchmark's baseline must be a correct tree, or the comparison means nothing."""
    capacity, batches = case
    tree, ref = NumpySumTree(capacity), ReferenceSumTree(capacity)
    for idx, prio in batches:
        if len(idx):
            tree.update(idx, prio)
            ref.update(idx, prio)
    assert tree.total == ref.total
    assert tree.min == ref.min
    if ref.total > 0:
        values = np.array(fractions) * ref.total * (1 - 1e-9)  # no leaf-less edge cases
        np.testing.assert_array_equal(tree.find_prefixsum(values), ref.find_prefixsum(values))


@pytest.mark.parametrize("capacity", CAPACITIES)
def test_empty_tree(capacity):
    tree = SumTree(capacity)
    assert len(tree) == capacity == tree.capacity
    assert tree.total == 0.0
    assert tree.min == float("inf")
    np.testing.assert_array_equal(tree.get(np.arange(capacity)), np.zeros(capacity))


def test_repeated_indices_last_write_wins():
    tree = SumTree(4)
    tree.update(np.array([2, 2, 1, 2]), np.array([7.0, 1.0, 3.0, 5.0]))
    np.testing.assert_array_equal(tree.get(np.arange(4)), [0.0, 3.0, 5.0, 0.0])
    assert tree.total == 8.0
    assert tree.min == 3.0


def test_min_counts_leaves_given_zero_and_ignores_unset_leaves():
    tree = SumTree(6)
    tree.update(np.array([1, 4]), np.array([2.0, 0.5]))
    assert tree.min == 0.5
    tree.update(np.array([3]), np.array([0.0]))
    assert tree.min == 0.0
    assert tree.total == 2.5


def test_clear_returns_leaves_to_never_set():
    tree = SumTree(9)
    prio = np.arange(1.0, 10.0)
    tree.update(np.arange(9), prio)
    tree.clear(np.array([0, 4, 4]))
    assert tree.total == prio.sum() - 1.0 - 5.0
    assert tree.min == 2.0  # cleared leaves no longer count, unlike a leaf set to 0
    assert tree.get(np.array([0, 4])).tolist() == [0.0, 0.0]
    assert not set(tree.sample(500, np.random.default_rng(0))[0].tolist()) & {0, 4}
    tree.clear(np.arange(9))
    assert tree.total == 0.0 and tree.min == float("inf")
    with pytest.raises(IndexError):
        tree.clear(np.array([9]))


def test_zero_leaves_never_found_or_sampled():
    tree = SumTree(10)
    tree.update(np.array([2, 3, 7]), np.array([1.0, 0.0, 2.0]))
    values = np.linspace(0, tree.total, 101)
    found = tree.find_prefixsum(values)
    assert set(found.tolist()) == {2, 7}
    idx, prio = tree.sample(1000, np.random.default_rng(0))
    assert set(idx.tolist()) == {2, 7}
    np.testing.assert_array_equal(prio, tree.get(idx))


def test_value_equal_to_total_finds_last_positive_leaf():
    tree = SumTree(8)
    tree.update(np.array([0, 5]), np.array([1.0, 3.0]))
    assert tree.find_prefixsum(np.array([4.0])).tolist() == [5]


def test_rounding_never_lands_on_a_zero_leaf():
    # Priorities whose float sums round: v just below total must still find a positive leaf.
    rng = np.random.default_rng(3)
    tree = SumTree(1000)
    prio = rng.random(1000) * 1e-3
    prio[500:] = 0.0
    tree.update(np.arange(1000), prio)
    values = np.nextafter(tree.total, 0) - np.arange(50) * np.spacing(tree.total)
    found = tree.find_prefixsum(np.concatenate([values, [tree.total]]))
    assert (prio[found] > 0).all()


def test_sample_counts_are_stratified():
    """Stratified sampling puts within 2 of n * p_i / total samples on each leaf, always."""
    rng = np.random.default_rng(1)
    prio = rng.integers(0, 20, size=37).astype(np.float64)
    tree = SumTree(37)
    tree.update(np.arange(37), prio)
    n = 500
    for _ in range(20):
        idx, got = tree.sample(n, rng)
        assert np.all(np.diff(idx) >= 0), "stratified samples come out in leaf order"
        np.testing.assert_array_equal(got, prio[idx])
        counts = np.bincount(idx, minlength=37)
        assert np.all(np.abs(counts - n * prio / prio.sum()) < 2)


def test_sampling_is_proportional_to_priority():
    """Chi-square goodness of fit over many small batches, with a fixed seed."""
    prio = np.array([1.0, 0.0, 2.0, 4.0, 8.0, 0.5, 3.0, 1.5])
    tree = SumTree(len(prio))
    tree.update(np.arange(len(prio)), prio)
    rng = np.random.default_rng(12345)
    counts = np.zeros(len(prio))
    for _ in range(4000):
        idx, _ = tree.sample(3, rng)  # few strata per call, so randomness does the work
        counts += np.bincount(idx, minlength=len(prio))
    expected = counts.sum() * prio / prio.sum()
    positive = expected > 0
    assert counts[~positive].sum() == 0
    chi2 = (((counts - expected) ** 2)[positive] / expected[positive]).sum()
    assert chi2 < 18.5  # chi-square critical value, 6 degrees of freedom, p = 0.005


def test_sample_is_reproducible_with_the_generator():
    tree = SumTree(100)
    tree.update(np.arange(100), np.arange(1, 101, dtype=np.float64))
    a = tree.sample(64, np.random.default_rng(7))
    b = tree.sample(64, np.random.default_rng(7))
    np.testing.assert_array_equal(a[0], b[0])
    assert tree.sample(0, np.random.default_rng(7))[0].shape == (0,)


def test_accepts_other_integer_and_float_dtypes():
    tree = SumTree(10)
    tree.update(np.array([1, 2], dtype=np.uint8), np.array([1, 2], dtype=np.int32))
    tree.update([3], [1.5])
    tree.update(np.array([], dtype=np.float64), np.array([]))  # empty: a no-op
    assert tree.total == 4.5
    assert tree.find_prefixsum(np.array([2.0], dtype=np.float32)).tolist() == [2]


def _filled_tree() -> SumTree:
    tree = SumTree(10)
    tree.update(np.arange(10), np.arange(10, dtype=np.float64))
    return tree


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda t: t.update(np.array([0, 10]), np.array([1.0, 1.0])), IndexError),
        (lambda t: t.update(np.array([-1]), np.array([1.0])), IndexError),
        (lambda t: t.update(np.array([0, 1]), np.array([1.0, np.nan])), ValueError),
        (lambda t: t.update(np.array([0, 1]), np.array([1.0, np.inf])), ValueError),
        (lambda t: t.update(np.array([0, 1]), np.array([1.0, -0.5])), ValueError),
        (lambda t: t.update(np.array([0, 1]), np.array([1.0])), ValueError),
        (lambda t: t.update(np.array([[0, 1]]), np.array([[1.0, 1.0]])), ValueError),
        (lambda t: t.update(np.array([0.0, 1.0]), np.array([1.0, 1.0])), TypeError),
        (lambda t: t.update(np.array(["a"]), np.array([1.0])), TypeError),
        (lambda t: t.update(np.array([1]), np.array(["x"])), TypeError),
        (lambda t: t.update(np.array([2**63 - 1], dtype=np.uint64) + 5, np.array([1.0])), IndexError),
        (lambda t: t.find_prefixsum(np.array([1.0, 45.5])), ValueError),
        (lambda t: t.find_prefixsum(np.array([-1e-9])), ValueError),
        (lambda t: t.find_prefixsum(np.array([np.nan])), ValueError),
        (lambda t: t.get(np.array([10])), IndexError),
        (lambda t: t.sample(-1, np.random.default_rng(0)), ValueError),
        (lambda t: t.sample(4, np.random.RandomState(0)), TypeError),
    ],
)
def test_invalid_input_raises_and_leaves_tree_unchanged(call, error):
    tree = _filled_tree()
    before = snapshot(tree)
    with pytest.raises(error):
        call(tree)
    assert snapshot(tree) == before


def test_empty_tree_cannot_be_searched_or_sampled():
    tree = SumTree(4)
    with pytest.raises(ValueError, match="empty"):
        tree.find_prefixsum(np.array([0.0]))
    with pytest.raises(ValueError, match="empty"):
        tree.sample(1, np.random.default_rng(0))
    tree.update(np.array([1]), np.array([0.0]))  # given a priority, but all zero
    with pytest.raises(ValueError, match="empty"):
        tree.sample(1, np.random.default_rng(0))


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match="capacity"):
        SumTree(capacity)


def test_gil_released_during_batched_calls():
    """Another Python thread runs while a long batched call is inside the native code."""
    tree = SumTree(2**16)
    tree.update(np.arange(2**16), np.ones(2**16))
    values = np.random.default_rng(0).random(3_000_000) * tree.total
    started, finished = threading.Event(), threading.Event()
    ticks_during_call = []

    def search():
        started.set()
        tree.find_prefixsum(values)
        finished.set()

    thread = threading.Thread(target=search)
    thread.start()
    started.wait()
    ticks = 0
    while not finished.is_set():
        ticks += 1
    ticks_during_call.append(ticks)
    thread.join()
    # With the GIL held for the whole call this loop could not run until the call returned.
    assert ticks_during_call[0] > 1000


def test_concurrent_updates_from_threads_stay_consistent():
    tree = SumTree(4096)
    rng = np.random.default_rng(0)
    batches = [
        [(np.arange(t, 4096, 4), rng.integers(1, 10, 1024).astype(np.float64)) for _ in range(200)] for t in range(4)
    ]

    def worker(thread_batches):
        for idx, prio in thread_batches:
            tree.update(idx, prio)

    threads = [threading.Thread(target=worker, args=(b,)) for b in batches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = sum(b[-1][1].sum() for b in batches)
    assert tree.total == expected
    assert tree.min == min(b[-1][1].min() for b in batches)


def test_large_tree_with_float_priorities_matches_reference():
    """Capacities that leave partial groups on every level, with non-integer priorities."""
    rng = np.random.default_rng(11)
    for capacity in (4**6 + 1, 70_001):
        prio = rng.random(capacity) * rng.integers(0, 2, capacity)  # about half are zero
        tree, ref = SumTree(capacity), ReferenceSumTree(capacity)
        idx = rng.permutation(capacity)
        tree.update(idx, prio[idx])
        ref.update(idx, prio[idx])
        assert tree.total == pytest.approx(ref.total, rel=1e-12)
        assert tree.min == ref.min
        values = rng.random(10_000) * ref.total * (1 - 1e-9)
        np.testing.assert_array_equal(tree.find_prefixsum(values), ref.find_prefixsum(values))
        sampled, _ = tree.sample(4096, rng)
        assert (prio[sampled] > 0).all()
