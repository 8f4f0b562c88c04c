"""The step's collective buffers: what each one holds, and where.

Stage 3's reduce-scatter-v carries, per part of a block in
:meth:`~chainerkfac.distributed.Assignment.buffer_order`, the block's
gradient (if the part has rows or columns of ``V`` to compute) and, to the
owner's part, its packed statistics (symmetric factors as their upper
triangle, Osawa et al. §3.4). Stage 6's all-gather-v carries every part's
piece of ``V``, the intervals the owner's refresh schedules adapted to, and
each rank's terms of the update-norm guard. Parameters every rank keeps
whole travel in one allreduce (:func:`average_replicated`).
"""
import numpy
from chainer import backend

from chainerkfac import linalg


class Layout:
    """The places of one assignment's blocks in the step's buffers.

    Args:
        assignment: The :class:`~chainerkfac.distributed.Assignment`.
        splits: ``{block: Split}`` of the split blocks
            (:class:`~chainerkfac.distributed.split.Split`).
        moves_gradients: Whether the buffers carry the gradients; with one
            rank they stay in the parameters, where the identity
            collectives would put them back.
    """

    def __init__(self, assignment, splits, moves_gradients=True):
        self.assignment = assignment
        self.splits = splits
        self.moves_gradients = moves_gradients
        #: The shapes of the blocks' gradients, set at every reduce.
        self.shapes = None
        #: ``{(block, part): [(factor, shape, size)]}``: the statistics
        #: the last reduce carried to each owner's part.
        self.statistics = {}

    def part_size(self, i, s):
        """Elements of part ``s`` of block ``i``'s preconditioned
        gradient that the buffers carry."""
        if not self.moves_gradients:
            return 0
        size = int(numpy.prod(self.shapes[i]))
        if i not in self.splits:
            return size
        bounds = self.splits[i].bounds
        start, stop = bounds[s]
        # The last part ends at the length of the split side.
        return size // bounds[-1][1] * (stop - start)

    def pack_reduce(self, blocks, grads):
        """The reduce-scatter's send buffer as a list of flat arrays, and
        the elements per ``(block, part)``. Takes the blocks' pending
        statistics."""
        self.shapes = [grad.shape for grad in grads]
        parts, sizes, self.statistics = [], {}, {}
        for i, s in self.assignment.buffer_order():
            flats = []
            if self.part_size(i, s):
                flats.append(grads[i].ravel())
            if s == 0:
                block = blocks[i]
                stats = block.take_statistics(block.gradient_loss_scale())
                entries = [(f, stats[f].shape, _pack(stats[f]))
                           for f in block.factors if f in stats]
                self.statistics[i] = [(f, shape, flat.size)
                                      for f, shape, flat in entries]
                flats += [flat for _, _, flat in entries]
            sizes[i, s] = sum(flat.size for flat in flats)
            parts += flats
        return parts, sizes

    def hold_statistics(self, blocks):
        """Stage 3 on one rank, which sums nothing: ``{block: {factor:
        batch mean}}`` of the blocks' pending statistics where they are,
        each symmetric factor as the reduce would carry it (its upper
        triangle, mirrored)."""
        self.statistics, held = {}, {}
        for i, block in enumerate(blocks):
            stats = block.take_statistics(block.gradient_loss_scale())
            stats = {f: _mirror_upper(stats[f]) for f in block.factors
                     if f in stats}
            self.statistics[i] = [(f, stats[f].shape, stats[f].size)
                                  for f in stats]
            if stats:
                held[block] = stats
        return held

    def unpack_reduce(self, blocks, mine, parts):
        """Writes the reduced gradients of this rank's ``parts``
        (``{block: part}``) into the blocks; returns ``{block: {factor:
        batch mean}}`` of the owned blocks' statistics."""
        stats_of_owned = {}
        offset = 0
        for i, s in sorted(parts.items()):
            block = blocks[i]
            size = self.part_size(i, s) and int(numpy.prod(self.shapes[i]))
            if size:
                block.set_gradient(mine[offset:offset + size].reshape(
                    self.shapes[i]))
                offset += size
            stats = {}
            carried = self.statistics.get(i, []) if s == 0 else []
            for f, shape, size in carried:
                flat = mine[offset:offset + size]
                offset += size
                if len(shape) == 2:
                    # Into the block's sum, which its own statistics
                    # left once packed.
                    stats[f] = unpack_symmetric(
                        flat, shape[0], block.statistics_out(f, shape, flat))
                else:
                    stats[f] = flat.reshape(shape)
            if stats:
                stats_of_owned[block] = stats
        return stats_of_owned

    def refreshed_factors(self, i):
        """The factors of block ``i`` whose statistics the last reduce
        carried (those the owner refreshed)."""
        return [f for f, _, _ in self.statistics.get(i, [])]

    def pack_gather(self, blocks, mine, part_results, terms, extra, dtype):
        """The all-gather's send buffer, one ``dtype`` array of the
        gradients' module: for each of this rank's parts ``mine`` (``(block,
        part)`` pairs, in order) a split block's part of ``V`` from
        ``part_results`` or an unsplit block's whole ``V``, after each
        owner's part the intervals of its refreshed factors; then the rows
        ``terms``, then the numbers ``extra``. What lives on the host (the
        intervals, ``extra``) reaches the device in one transfer."""
        xp = backend.get_array_module(terms)
        pieces, host, places = [], [], []
        for i, s in mine:
            block = blocks[i]
            piece = None if not self.part_size(i, s) else \
                part_results.get(i) if i in self.splits else block.gradient()
            if piece is not None:
                pieces.append(piece.ravel().astype(dtype, copy=False))
            if s == 0:
                intervals = [block.schedules[f].interval or 0
                             for f in self.refreshed_factors(i)]
                places.append((len(pieces), len(host), len(intervals)))
                pieces.append(None)
                host += intervals
        host = xp.asarray(numpy.asarray(host + list(extra)), dtype=dtype)
        for at, start, n in places:
            pieces[at] = host[start:start + n]
        pieces += [terms.ravel().astype(dtype, copy=False),
                   host[len(host) - len(extra):]]
        return xp.concatenate(pieces)

    def unpack_gather(self, blocks, everything, places, step, dtype, keep):
        """Writes each part's piece of ``V`` from the all-gather's buffer
        ``everything`` (offsets ``places``, of :meth:`gather`) into the
        blocks, a split block's parts assembled whole in ``dtype`` (an
        unsplit block ``i`` keeps its own ``V`` where ``keep(i)``), and has
        each refreshed factor's schedule follow the owner's interval at
        ``step``."""
        xp = backend.get_array_module(everything)
        assembled = {i: xp.empty(self.shapes[i], dtype=dtype)
                     for i in self.splits}
        for (i, s), offset in places.items():
            n_grad = self.part_size(i, s)
            piece = everything[offset:offset + n_grad]
            if i in assembled:
                target = self.splits[i].part_of(assembled[i], s)
                target[...] = piece.reshape(target.shape)
            elif not keep(i):
                blocks[i].set_gradient(piece.reshape(self.shapes[i]))
            if s == 0:
                factors = self.refreshed_factors(i)
                intervals = everything[offset + n_grad:
                                       offset + n_grad + len(factors)]
                for f, interval in zip(factors, intervals.tolist()):
                    blocks[i].schedules[f].follow(step, interval)
        for i, grad in assembled.items():
            blocks[i].set_gradient(grad)

    def gather(self, per_part, extra):
        """Where the all-gather puts what: ``(places, groups, slots,
        by_rank)``.

        Each rank's segment holds its parts, ``by_rank[rank]``, in
        :meth:`buffer_order
        <chainerkfac.distributed.Assignment.buffer_order>`, each part its
        piece of the preconditioned gradient, the owner's part then one
        interval per refreshed factor (:meth:`refreshed_factors`); after
        the parts, the rank's terms: ``per_part`` for each of its parts, in
        the same order, then ``extra``. ``places[part]`` is the offset of a
        part's piece, ``groups`` the starts of the runs that share a
        transport scale (each piece, each part's intervals, each term) and
        ``slots[rank]`` the offsets of the rank's terms."""
        by_rank = [[] for _ in range(self.assignment.world_size)]
        for i, s in self.assignment.buffer_order():
            by_rank[self.assignment.shards[i][s]].append((i, s))
        places, groups, slots, offset = {}, [], [], 0
        for items in by_rank:
            for i, s in items:
                places[i, s] = offset
                groups.append(offset)
                offset += self.part_size(i, s)
                if s == 0:
                    groups.append(offset)
                    offset += len(self.refreshed_factors(i))
            n_terms = per_part * len(items) + extra
            groups += range(offset, offset + n_terms)
            slots.append(numpy.arange(offset, offset + n_terms))
            offset += n_terms
        return places, groups, slots, by_rank


def sum_terms(values, slots, by_rank, n_blocks, n_terms):
    """The gathered terms ``values`` (each rank's at ``slots[rank]``, its
    parts ``by_rank[rank]``, of :meth:`Layout.gather`): ``n_terms`` per
    part, then two numbers per rank. Returns the ``(n_blocks, n_terms)``
    sums over the ranks' parts, in rank order, and the ranks' two numbers,
    ``([first of each rank], [second of each rank])``."""
    totals = numpy.zeros((n_blocks, n_terms))
    firsts, seconds, offset = [], [], 0
    for items, rank_slots in zip(by_rank, slots):
        segment = values[offset:offset + len(rank_slots)]
        offset += len(rank_slots)
        for (i, _), row in zip(items, segment[:-2].reshape(-1, n_terms)):
            totals[i] += row
        firsts.append(int(segment[-2]))
        seconds.append(segment[-1])
    return totals, (firsts, seconds)


def _pack(stat):
    return pack_symmetric(stat) if stat.ndim == 2 else stat.ravel()


def _mirror_upper(stat):
    """A square ``stat`` with its upper triangle mirrored into its lower
    one, in place (:func:`pack_symmetric` then :func:`unpack_symmetric`)
    where it is not symmetric already."""
    xp = backend.get_array_module(stat)
    if stat.ndim == 2 and not bool(xp.array_equal(stat, stat.T)):
        mask = linalg.upper_mask(xp, stat.shape[0],
                                 backend.get_device_from_array(stat))
        stat.T[mask] = stat[mask]
    return stat


def average_replicated(comm, arrays):
    """Averages ``arrays`` over ranks in place, in one allreduce."""
    if not arrays:
        return
    xp = backend.get_array_module(arrays[0])
    flat = xp.concatenate([a.ravel().astype(arrays[0].dtype, copy=False)
                           for a in arrays])
    comm.allreduce_mean(flat)
    offset = 0
    for a in arrays:
        a[...] = flat[offset:offset + a.size].reshape(a.shape)
        offset += a.size


def pack_symmetric(M):
    """Upper triangle of a symmetric matrix as a flat array (d(d+1)/2).

    Symmetric factors travel in this form (Osawa et al. §3.4): half the bytes.
    """
    mask = linalg.upper_mask(backend.get_array_module(M), M.shape[0],
                             backend.get_device_from_array(M))
    return M[mask]


def unpack_symmetric(packed, dim, out=None):
    """Inverse of :func:`pack_symmetric` (into ``out`` if given)."""
    xp = backend.get_array_module(packed)
    mask = linalg.upper_mask(xp, dim, backend.get_device_from_array(packed))
    M = xp.empty((dim, dim), dtype=packed.dtype) if out is None else out
    M[mask] = packed
    # Mᵀ[mask] walks (i, j), i <= j, in the order of ``packed``: it writes
    # M[j, i] = M[i, j], the lower triangle.
    M.T[mask] = packed
    return M


# Checks of a collective's arguments, each a ValueError that says what is
# wrong.

def check_counts(counts, size):
    """``counts`` as ints: one non-negative size per rank of ``size``."""
    counts = [int(c) for c in counts]
    if len(counts) != size or min(counts) < 0:
        raise ValueError('counts must hold {} non-negative sizes, one per '
                         'rank, got {!r}'.format(size, counts))
    return counts


def check_segments(counts, sendbuf, size):
    """``(counts, sendbuf)`` of a send buffer holding one segment per rank
    (:func:`check_counts`, :func:`check_flat`), their sizes agreeing."""
    counts = check_counts(counts, size)
    sendbuf = check_flat(sendbuf, 'sendbuf')
    if sendbuf.size != sum(counts):
        raise ValueError('sendbuf has {} elements but counts sum to '
                         '{}'.format(sendbuf.size, sum(counts)))
    return counts, sendbuf


def check_flat(array, what):
    """``array`` (named ``what``), 1-D, as a contiguous array."""
    if array.ndim != 1:
        raise ValueError('{} must be 1-D, got shape {}'.format(
            what, array.shape))
    return backend.get_array_module(array).ascontiguousarray(array)


def check_contiguous_float(array):
    """In-place collectives need the array's own memory: a C-contiguous
    float array."""
    if not array.flags.c_contiguous or array.dtype.kind != 'f':
        raise ValueError('expected a C-contiguous float array, got dtype '
                         '{} with strides {}'.format(array.dtype,
                                                     array.strides))
