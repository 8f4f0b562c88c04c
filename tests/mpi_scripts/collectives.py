"""Rank script: the K-FAC collectives against NumPy references.

Usage: mpiexec -n {2,4} python collectives.py [naive|pure_nccl]

Every rank builds every rank's inputs from seeds, so it can compute the
expected results itself. Exits non-zero (through the global except hook) on
the first mismatch; prints "rank R: ok" at the end.
"""
import sys

import chainerkfac  # NOQA: the NumPy-2 shims come before Chainer
import numpy
from numpy.testing import assert_allclose
from numpy.testing import assert_array_equal

import chainer
import chainer.links as L

from chainerkfac.distributed import check_same_structure
from chainerkfac.distributed import create_communicator
from chainerkfac.distributed import global_except_hook
from chainerkfac.distributed.scaling import SCALE_BLOCK


NAME = sys.argv[1] if len(sys.argv) > 1 else 'naive'
if NAME == 'pure_nccl':
    import cupy as xp
    to_cpu = chainer.backends.cuda.to_cpu
else:
    xp = numpy

    def to_cpu(a):
        return a

# Uneven segment sizes, zeros included (ranks that own nothing).
COUNTS = {
    2: [[5, 0], [3, 4], [0, 0]],
    4: [[3, 0, 5, 1], [0, 0, 0, 2], [2, 2, 2, 2]],
}
FLOAT64 = numpy.dtype(numpy.float64).itemsize


def data(seed, n, scale=1.0):
    return numpy.random.default_rng(seed).standard_normal(n) * scale


def offsets(counts):
    return numpy.concatenate([[0], numpy.cumsum(counts)]).astype(int)


def check_v_collectives(comm, counts):
    rank, size = comm.rank, comm.size
    total, off = sum(counts), offsets(counts)
    comm.reset_bytes_moved()

    sendbuf = xp.asarray(data(rank, total))
    before = sendbuf.copy()
    out = comm.reduce_scatter_v(sendbuf, counts)
    expected = sum(data(r, total) for r in range(size))
    assert out.dtype == numpy.float64 and out.shape == (counts[rank],)
    assert_allclose(to_cpu(out), expected[off[rank]:off[rank + 1]],
                    rtol=1e-13, atol=1e-13)
    assert_array_equal(to_cpu(sendbuf), to_cpu(before))

    mine = xp.asarray(data(100 + rank, counts[rank]))
    out = comm.all_gather_v(mine, counts)
    expected = numpy.concatenate(
        [data(100 + r, counts[r]) for r in range(size)])
    assert out.dtype == numpy.float64
    assert_array_equal(to_cpu(out), expected)

    assert comm.reset_bytes_moved() == {
        'reduce_scatter_v': total * FLOAT64, 'all_gather_v': total * FLOAT64,
        'alltoall_v': 0, 'allreduce': 0, 'bcast': 0}


def check_alltoall_v(comm):
    # Rank r sends rank d (d + 2 r) % 3 elements, none to some ranks and,
    # on rank 0, something to itself; every rank can compute every segment.
    rank, size = comm.rank, comm.size

    def segment(source, dest):
        return data(1000 * source + dest, (dest + 2 * source) % 3)

    counts = [(d + 2 * rank) % 3 for d in range(size)]
    sendbuf = xp.asarray(numpy.concatenate(
        [segment(rank, d) for d in range(size)]))
    comm.reset_bytes_moved()
    out, recv_counts = comm.alltoall_v(sendbuf, counts)
    assert recv_counts == [(rank + 2 * s) % 3 for s in range(size)]
    assert out.dtype == numpy.float64
    assert_array_equal(to_cpu(out), numpy.concatenate(
        [segment(s, rank) for s in range(size)]))
    # Only what leaves the rank is counted.
    assert comm.reset_bytes_moved() == {
        'alltoall_v': (sum(counts) - counts[rank]) * FLOAT64,
        'reduce_scatter_v': 0, 'all_gather_v': 0, 'allreduce': 0,
        'bcast': 0}


def check_half_precision(comm, counts):
    # Values far outside float16's range (max 65504, smallest subnormal
    # 6e-8) both ways: the power-of-two scaling must keep them.
    rank, size = comm.rank, comm.size
    total, off = sum(counts), offsets(counts)
    eps16 = 2.0 ** -11
    for scale in (1e6, 1e-9):
        comm.reset_bytes_moved()
        inputs = [data(r, total, scale) for r in range(size)]
        largest = max(numpy.abs(a).max(initial=0) for a in inputs)
        out = comm.reduce_scatter_v(xp.asarray(inputs[rank]), counts)
        assert out.dtype == numpy.float64
        # Each of the N inputs and N - 1 partial sums (each at most N times
        # the largest value) is rounded once in float16.
        assert_allclose(to_cpu(out), sum(inputs)[off[rank]:off[rank + 1]],
                        rtol=0, atol=size * size * eps16 * largest)

        segments = [data(100 + r, counts[r], scale) for r in range(size)]
        largest = max(numpy.abs(s).max(initial=0) for s in segments)
        out = comm.all_gather_v(xp.asarray(segments[rank]), counts)
        assert_allclose(to_cpu(out), numpy.concatenate(segments),
                        rtol=0, atol=eps16 * largest)

        # Two bytes an element, plus the exchange of the largest value of
        # each block of the transfer.
        exchange = 8 * -(-total // SCALE_BLOCK)
        assert comm.reset_bytes_moved() == {
            'reduce_scatter_v': 2 * total + exchange,
            'all_gather_v': 2 * total + exchange,
            'alltoall_v': 0, 'allreduce': 0, 'bcast': 0}


def assert_within(got, expected, tolerance):
    excess = numpy.abs(got - expected) / tolerance
    assert (excess <= 1).all(), 'error up to {:g}x the tolerance, at {}' \
        .format(excess.max(), numpy.argmax(excess))


def check_mixed_magnitudes(comm):
    # One transfer holding runs 1e12 apart (a loss-scaled gradient beside a
    # factor of small curvature): each run keeps float16's precision, in
    # fixed blocks of SCALE_BLOCK and in groups the caller names (entries
    # of any length, unaligned with the ranks' segments).
    rank, size = comm.rank, comm.size
    counts = [SCALE_BLOCK + 300 * r for r in range(size)]
    total, off = sum(counts), offsets(counts)
    eps16 = 2.0 ** -11
    entries = numpy.cumsum([0, 7, 300, 3, 1500, 1, 2] + [100] * size)
    for groups in (None, entries[entries < total]):
        starts = (numpy.arange(0, total, SCALE_BLOCK) if groups is None
                  else groups)
        group = numpy.searchsorted(starts, numpy.arange(total), 'right') - 1
        magnitude = numpy.where(group % 2, 1e6, 1e-6)

        def group_largest(arrays):
            largest = numpy.abs(arrays).max(axis=0)
            return numpy.array([largest[group == g].max()
                                for g in range(len(starts))])[group]

        inputs = [data(r, total) * magnitude for r in range(size)]
        out = comm.reduce_scatter_v(xp.asarray(inputs[rank]), counts, groups)
        mine = slice(off[rank], off[rank + 1])
        assert_within(to_cpu(out), sum(inputs)[mine],
                      size * size * eps16 * group_largest(inputs)[mine])
        segments = [(data(100 + r, total) * magnitude)[off[r]:off[r + 1]]
                    for r in range(size)]
        expected = numpy.concatenate(segments)
        out = comm.all_gather_v(xp.asarray(segments[rank]), counts, groups)
        assert_within(to_cpu(out), expected,
                      eps16 * group_largest([expected]))


def check_dense_collectives(comm):
    rank, size = comm.rank, comm.size
    comm.reset_bytes_moved()

    array = xp.asarray(data(200 + rank, 6).reshape(2, 3))
    assert comm.allreduce_mean(array) is array
    expected = sum(data(200 + r, 6) for r in range(size)) / size
    assert_allclose(to_cpu(array).ravel(), expected, rtol=1e-13)

    array = xp.asarray(data(300 + rank, 5))
    assert comm.bcast_array(array, root=size - 1) is array
    assert_array_equal(to_cpu(array), data(300 + size - 1, 5))

    assert comm.reset_bytes_moved() == {
        'allreduce': 6 * FLOAT64, 'bcast': 5 * FLOAT64,
        'reduce_scatter_v': 0, 'all_gather_v': 0, 'alltoall_v': 0}


def check_model_collectives(comm):
    # ChainerMN's inherited model-wide collectives, counted.
    rank, size = comm.rank, comm.size
    link = L.Linear(3, 2, initialW=rank + 1.0, initial_bias=-rank)
    if NAME == 'pure_nccl':
        link.to_gpu()
    check_same_structure(comm, link)
    n_params = 3 * 2 + 2
    comm.reset_bytes_moved()

    comm.bcast_data(link)
    assert_array_equal(to_cpu(link.W.array), numpy.ones((2, 3)))
    assert_array_equal(to_cpu(link.b.array), numpy.zeros(2))

    link.cleargrads()
    link.W.grad = xp.full((2, 3), rank + 1.0, dtype=numpy.float32)
    link.b.grad = xp.full((2,), 2.0 * rank, dtype=numpy.float32)
    comm.multi_node_mean_grad(link)
    assert_allclose(to_cpu(link.W.grad), numpy.full((2, 3), (size + 1) / 2))
    assert_allclose(to_cpu(link.b.grad), numpy.full(2, size - 1.0))

    assert comm.reset_bytes_moved() == {
        'bcast': 4 * n_params, 'allreduce': 4 * n_params,
        'reduce_scatter_v': 0, 'all_gather_v': 0, 'alltoall_v': 0}


def main():
    comm = create_communicator(NAME)
    if NAME == 'pure_nccl':
        chainer.backends.cuda.get_device_from_id(comm.intra_rank).use()
    # The default abort_on_exception=True installed the hook at size > 1.
    assert sys.excepthook is global_except_hook._abort_on_uncaught_exception
    half = create_communicator(NAME, transport_dtype=numpy.float16)
    for counts in COUNTS[comm.size]:
        check_v_collectives(comm, counts)
        check_half_precision(half, counts)
    check_mixed_magnitudes(half)
    check_alltoall_v(comm)
    check_dense_collectives(comm)
    check_model_collectives(comm)
    print('rank {}: ok'.format(comm.rank), flush=True)


main()
