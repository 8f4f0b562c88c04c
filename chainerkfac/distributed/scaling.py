"""Power-of-two scaling of a narrowed transfer (``transport_dtype``).

A buffer sent in float16 holds gradients (times the loss scale), Kronecker
factors and the guard's sums, whose magnitudes differ by more than
float16's range. So each group of elements (each tensor, where the caller
names them) is multiplied by its own power of two before narrowing and
divided by it after: every rank applies the same scale to a group, from
the largest magnitude the ranks agree on. This is this library's own
addition; the paper (Osawa et al. §3.4) computes factors in half precision.
"""
import chainer
import numpy

#: Elements that share one power-of-two scale in a narrowed transfer
#: (``transport_dtype``) when the caller names no groups. One buffer holds
#: gradients (times the loss scale), Kronecker factors and the guard's
#: sums, whose magnitudes differ by more than float16's range: one scale
#: per buffer would flush the small ones to zero. The largest magnitude of
#: each group is exchanged as a float64.
SCALE_BLOCK = 1024


def _overlap(starts, total, offset, size):
    """``(first, lengths)``: the groups that begin at ``starts`` (sorted,
    the last ending at ``total``) and overlap elements ``offset`` to
    ``offset + size``, the first's index and how many of those elements
    each holds."""
    ends = numpy.append(starts[1:], total)
    lengths = (numpy.minimum(ends, offset + size)
               - numpy.maximum(starts, offset))
    held = numpy.flatnonzero(lengths > 0)
    if not len(held):
        return 0, lengths[:0]
    return int(held[0]), lengths[held[0]:held[-1] + 1]


def _group_starts(groups, total):
    """The sorted, distinct starts of the scale groups of a transfer of
    ``total`` elements (every :data:`SCALE_BLOCK` when ``groups`` is
    ``None``); the first group starts at 0 whatever ``groups`` says."""
    if groups is None:
        return numpy.arange(0, total, SCALE_BLOCK)
    starts = numpy.asarray(groups, dtype=numpy.int64)
    if starts.size and (starts.min() < 0 or starts.max() > total):
        raise ValueError('groups must lie in [0, {}], got {} to {}'.format(
            total, starts.min(), starts.max()))
    return numpy.union1d([0], starts)


def _group_index(xp, lengths):
    """Per element of consecutive runs of ``lengths``, its run's index, on
    the device of ``xp``. CuPy before 14 repeats by a list in a Python loop
    (one copy per run), so on a GPU the runs are found by a search."""
    if xp is numpy:
        return numpy.repeat(numpy.arange(len(lengths)), lengths)
    ends = xp.asarray(numpy.cumsum(lengths))
    return xp.searchsorted(ends, xp.arange(int(ends[-1])), side='right')


def _group_max(values, lengths):
    """The largest of each run of ``lengths`` consecutive ``values``, as
    a NumPy array."""
    xp = chainer.backend.get_array_module(values)
    if xp is numpy:
        starts = numpy.concatenate([[0], numpy.cumsum(lengths)[:-1]])
        return numpy.maximum.reduceat(values, starts)
    import cupyx
    out = xp.zeros(len(lengths), dtype=values.dtype)
    cupyx.scatter_max(out, _group_index(xp, lengths), values)
    return out.get()


def _per_element(like, scales, starts, total, offset, size):
    """The group scales of elements ``offset`` to ``offset + size``, an
    array of ``like``'s module and dtype."""
    xp = chainer.backend.get_array_module(like)
    first, lengths = _overlap(starts, total, offset, size)
    chosen = xp.asarray(scales[first:first + len(lengths)], dtype=like.dtype)
    return chosen[_group_index(xp, lengths)]


def encode(array, wire_dtype, offset, total, groups, n_summands,
           allreduce_max):
    """Converts ``array`` to ``wire_dtype``; returns it, the scale of
    each group (``None`` when nothing is scaled) and the bytes the
    ranks exchanged to agree on the scales.

    ``array`` holds elements ``offset`` to ``offset + array.size`` of
    a transfer of ``total`` elements; ``groups`` as in
    :meth:`KfacCommunicatorMixin.reduce_scatter_v
    <chainerkfac.distributed.KfacCommunicatorMixin.reduce_scatter_v>`
    (``None``: every :data:`SCALE_BLOCK` elements). Every rank applies
    the same scale to a group: the ranks agree (``allreduce_max``) on each
    group's largest magnitude, which, times ``n_summands``, must stay
    within half the dtype's range (room for rounding in partial sums). A
    power of two keeps the scaling exact both ways."""
    if wire_dtype is None or wire_dtype == array.dtype:
        return array, None, 0
    if wire_dtype.itemsize > array.dtype.itemsize:
        return array.astype(wire_dtype), None, 0
    starts = _group_starts(groups, total)
    first, lengths = _overlap(starts, total, offset, array.size)
    local = numpy.zeros(len(starts))
    if array.size:
        magnitude = abs(array)
        # NaN compares as Inf everywhere: the group goes unscaled.
        magnitude[magnitude != magnitude] = numpy.inf
        local[first:first + len(lengths)] = _group_max(magnitude,
                                                       lengths)
    bounds = allreduce_max(local) * n_summands
    info = numpy.finfo(array.dtype)
    with numpy.errstate(divide='ignore', invalid='ignore'):
        exponents = numpy.floor(numpy.log2(
            float(numpy.finfo(wire_dtype).max) / 2 / bounds))
    # A group of zeros, or with an Inf or NaN, is sent as it is.
    exponents[~numpy.isfinite(exponents)] = 0
    exponents = numpy.clip(exponents, info.minexp, info.maxexp - 1)
    scales = numpy.ldexp(1.0, exponents.astype(numpy.int32))
    return (array * _per_element(array, scales, starts, total, offset,
                                 array.size)).astype(wire_dtype), \
        (scales, starts, total), local.nbytes


def decode(recvbuf, dtype, scales, offset):
    """``recvbuf`` (elements ``offset`` on of the transfer) back in
    ``dtype``, the group scales of :func:`encode` divided out."""
    out = recvbuf.astype(dtype, copy=False)
    if scales is not None:
        out /= _per_element(out, *scales, offset, out.size)
    return out
