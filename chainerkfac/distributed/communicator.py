"""Communicators for distributed K-FAC.

A K-FAC communicator is a ChainerMN communicator (``bcast_data``,
``multi_node_mean_grad``, ``bcast_obj``, ... work as in ChainerMN) with the
collectives of the hybrid data/model-parallel scheme of Osawa et al. (CVPR
2019, §3.3, Fig. 1): :meth:`~KfacCommunicatorMixin.reduce_scatter_v`
(stage 3: every rank's gradients and factors summed onto each block's
owner), :meth:`~KfacCommunicatorMixin.all_gather_v` (stage 6: the owners'
preconditioned gradients to every rank), :meth:`~KfacCommunicatorMixin.
alltoall_v` and :meth:`~KfacCommunicatorMixin.group_bcast` (stages 4-5:
what the parts of a split block need, and their shared factorization,
:mod:`chainerkfac.distributed.cholesky`),
:meth:`~KfacCommunicatorMixin.allreduce_mean` and
:meth:`~KfacCommunicatorMixin.bcast_array` for the rest, and
:meth:`~KfacCommunicatorMixin.arrive`, every rank's small value within a
deadline after which the ranks that did not send theirs are named
(:mod:`chainerkfac.distributed.arrival`).

The two ``v`` collectives together move what one allreduce moves, so
K-FAC communicates about as much as SGD. This module holds what every
implementation shares and imports neither MPI nor CuPy;
:func:`chainerkfac.distributed.create_communicator` imports the
implementation it is asked for.
"""
import abc
import functools

import numpy

from chainerkfac import timing
from chainerkfac.distributed import arrival
from chainerkfac.distributed import buffers
from chainerkfac.distributed import scaling


#: The keys of :attr:`KfacCommunicatorMixin.bytes_moved`. ``'allreduce'``
#: counts ``allreduce_mean`` and ``multi_node_mean_grad``; ``'bcast'`` counts
#: ``bcast_array``, ``bcast_data`` and ``group_bcast``.
COLLECTIVES = ('allreduce', 'reduce_scatter_v', 'all_gather_v', 'alltoall_v',
               'bcast')


def _communication(collective):
    """Times ``collective`` as the ``'communication'`` stage of the
    communicator's :attr:`~KfacCommunicatorMixin.stage_timer`."""
    @functools.wraps(collective)
    def timed(self, *args, **kwargs):
        with timing.timed(self.stage_timer, 'communication'):
            return collective(self, *args, **kwargs)
    return timed


class KfacCommunicatorMixin(abc.ABC):
    """The collectives K-FAC adds to a ChainerMN communicator.

    Mixed in before a ChainerMN communicator class; the subclass calls
    :meth:`_init_kfac` in its constructor and supplies the transport, the
    abstract methods below (a class that misses one cannot be
    instantiated): point-to-group primitives on flat arrays, which the
    public collectives wrap with the checks, the ``transport_dtype``
    narrowing and the byte counts.

    Arrays are flat and of any array module (``chainer.backend
    .get_array_module``); results come back in the module and dtype of the
    input. With one process every collective is a copy or nothing, without
    a call to MPI or NCCL, so a single-process run takes the same code path.

    Every collective adds the bytes it hands to MPI or NCCL on this rank
    (the payload, in the transport dtype) to :attr:`bytes_moved`, under its
    collective's name (nothing with one process; object collectives and
    ChainerMN's experimental array primitives are not counted).
    """

    #: A :class:`~chainerkfac.timing.StageTimer` the collectives add their
    #: time to (the distributed stages set the optimizer's), or ``None``.
    stage_timer = None

    # The transport an implementation supplies.

    @abc.abstractmethod
    def _reduce_scatter_v(self, sendbuf, counts):
        """Sums ``sendbuf`` over ranks; returns this rank's segment
        (``counts[rank]`` elements)."""

    @abc.abstractmethod
    def _all_gather_v(self, sendbuf, counts):
        """Concatenates every rank's ``sendbuf`` (``counts[r]`` elements
        from rank ``r``) in rank order."""

    @abc.abstractmethod
    def _alltoall_v(self, sendbuf, send_counts, recv_counts):
        """Sends ``send_counts[r]`` elements to rank ``r``; returns what
        every rank sent this one, in rank order."""

    @abc.abstractmethod
    def _allreduce_sum(self, array):
        """Sums ``array`` over ranks, in place."""

    @abc.abstractmethod
    def _bcast(self, array, root):
        """Broadcasts ``array`` from ``root``, in place."""

    @abc.abstractmethod
    def _group_bcast(self, array, root, others):
        """Sends ``array`` from ``root`` to the ranks ``others``, point to
        point and in place; returns a function that waits for it."""

    @abc.abstractmethod
    def _allreduce_max(self, values):
        """The element-wise maximum over ranks of ``values``, a float64
        NumPy array in and out."""

    @abc.abstractmethod
    def _grad_wire_itemsize(self, grad):
        """Bytes per element ``multi_node_mean_grad`` sends for ``grad``."""

    @abc.abstractmethod
    def _data_wire_itemsize(self, data):
        """Bytes per element ``bcast_data`` sends for ``data``."""

    def _init_kfac(self, transport_dtype):
        self._bytes_moved = dict.fromkeys(COLLECTIVES, 0)
        self.set_config('transport_dtype', transport_dtype)
        # Here, where every rank creates the communicator: created at the
        # first arrive(), the collective Dup would wait for ever for a
        # rank that never arrives.
        self._arrival_comm = self.mpi_comm.Dup()
        #: The deadline of the collectives of a step
        #: (:class:`~chainerkfac.distributed.arrival.Watch`).
        self.watch = arrival.Watch(self._arrival_comm)

    # Configuration, in ChainerMN's style.

    def set_config(self, name, value=True, **kwargs):
        """ChainerMN's configuration setter, plus ``'transport_dtype'``
        (the dtype of the ``v`` collectives on the wire)."""
        if name == 'transport_dtype':
            if value is not None:
                value = numpy.dtype(value)
                if value.kind != 'f':
                    raise ValueError('transport_dtype must be a float dtype '
                                     'or None, got {}'.format(value))
            with self.config_scope():
                self.transport_dtype = value
        else:
            super().set_config(name, value, **kwargs)

    def get_config(self, name=None):
        """ChainerMN's configuration getter, plus ``'transport_dtype'``."""
        if name == 'transport_dtype':
            return self.transport_dtype
        return super().get_config(name)

    def arrive(self, value, deadline, what):
        """Every rank's ``value`` (a small picklable object), in rank
        order, or :class:`~chainerkfac.distributed.ArrivalTimeout` naming
        the ranks that did not send theirs within ``deadline`` seconds
        (:func:`chainerkfac.distributed.arrival.rendezvous`, on this
        communicator's own duplicate of its MPI communicator)."""
        return arrival.rendezvous(self._arrival_comm, value, deadline, what)

    def control_sum(self, values, at_start=False):
        """The float64 sums over ranks of a few numbers ``values`` (not in
        :attr:`bytes_moved`), within the :attr:`watch`'s deadline; those
        of an update's start (``at_start``) on a communicator of their
        own, which no rank still in the last step's collectives uses."""
        import mpi4py.MPI
        buf = numpy.array(values, dtype=numpy.float64)
        comm = self._arrival_comm if at_start else self.mpi_comm
        if self.size > 1:
            self.watch.wait(comm.Iallreduce(
                mpi4py.MPI.IN_PLACE, buf, op=mpi4py.MPI.SUM),
                'the start' if at_start else 'the agreement', at_start)
        return buf

    # Byte counters.

    @property
    def bytes_moved(self):
        """Bytes moved so far, per collective (a copy)."""
        return dict(self._bytes_moved)

    def reset_bytes_moved(self):
        """Returns :attr:`bytes_moved` and sets every counter to zero."""
        moved = self.bytes_moved
        self._bytes_moved = dict.fromkeys(COLLECTIVES, 0)
        return moved

    def _count(self, collective, nbytes):
        self._bytes_moved[collective] += int(nbytes)

    # The K-FAC collectives.

    @_communication
    def reduce_scatter_v(self, sendbuf, counts, groups=None):
        """Sums over ranks and scatters uneven segments (paper §3.3, stage 3).

        ``sendbuf`` is the concatenation, in rank order, of the segments
        destined for each rank: ``counts[r]`` elements for rank ``r``. Each
        rank receives its own segment summed over all ranks, so every
        rank's Kronecker factors add up on the factors' owner. One
        ``MPI_Reduce_scatter`` (or NCCL reduce per owner).

        Args:
            sendbuf: 1-D array of ``sum(counts)`` elements, the same
                ``counts`` and dtype on every rank.
            counts (sequence of int): Segment sizes, one per rank; zeros
                are allowed (a rank that owns nothing).
            groups: Where a ``transport_dtype`` narrows the transfer:
                the start offsets, in the whole transfer and the same on
                every rank, of the runs of elements that share one
                power-of-two scale (one per tensor, say); ``None``: every
                :data:`~chainerkfac.distributed.scaling.SCALE_BLOCK` elements.

        Returns:
            A new 1-D array of ``counts[rank]`` elements.
        """
        counts, sendbuf = buffers.check_segments(counts, sendbuf, self.size)
        if self.size == 1:
            return sendbuf.copy()
        wire, scales = self._encode(sendbuf, 0, sendbuf.size, groups,
                                    self.size, 'reduce_scatter_v')
        recvbuf = self._reduce_scatter_v(wire, counts)
        self._count('reduce_scatter_v', wire.nbytes)
        return self._decode(recvbuf, sendbuf.dtype, scales,
                            sum(counts[:self.rank]))

    @_communication
    def all_gather_v(self, sendbuf, counts, groups=None):
        """Gathers uneven segments onto every rank (paper §3.3, stage 6):
        rank ``r`` contributes its ``counts[r]`` elements (the gradients it
        preconditioned); every rank receives the concatenation over ranks in
        rank order. One ``MPI_Allgatherv`` (or NCCL broadcast per rank).

        Args:
            sendbuf: 1-D array of ``counts[rank]`` elements, the same dtype
                on every rank.
            counts (sequence of int): Segment sizes, one per rank, the same
                on every rank.
            groups: As in :meth:`reduce_scatter_v`.

        Returns:
            A new 1-D array of ``sum(counts)`` elements.
        """
        counts = buffers.check_counts(counts, self.size)
        sendbuf = buffers.check_flat(sendbuf, 'sendbuf')
        if sendbuf.size != counts[self.rank]:
            raise ValueError('rank {} sends {} elements but counts[{}] is '
                             '{}'.format(self.rank, sendbuf.size, self.rank,
                                         counts[self.rank]))
        if self.size == 1:
            return sendbuf.copy()
        wire, scales = self._encode(sendbuf, sum(counts[:self.rank]),
                                    sum(counts), groups, 1, 'all_gather_v')
        recvbuf = self._all_gather_v(wire, counts)
        self._count('all_gather_v', recvbuf.nbytes)
        return self._decode(recvbuf, sendbuf.dtype, scales, 0)

    @_communication
    def alltoall_v(self, sendbuf, counts):
        """Sends every rank its own uneven segment; receives one from each.

        ``sendbuf`` is the concatenation, in rank order, of the segments
        for each rank (``counts[r]`` elements for rank ``r``; the segment
        for this rank is kept). Each rank receives the concatenation, in
        rank order, of the segments the other ranks addressed to it; the
        receive sizes are exchanged first (a small object collective), so
        ``counts`` may differ between ranks. One ``MPI_Alltoallv`` (or
        grouped NCCL sends and receives), in the arrays' own dtype (they
        are inverses, which a narrow transport would spoil).

        Returns:
            ``(recvbuf, recv_counts)``: a new 1-D array and the number of
            its elements that came from each rank.
        """
        counts, sendbuf = buffers.check_segments(counts, sendbuf, self.size)
        if self.size == 1:
            return sendbuf.copy(), counts
        recv_counts = [int(c) for c in self.mpi_comm.alltoall(counts)]
        recvbuf = self._alltoall_v(sendbuf, counts, recv_counts)
        self._count('alltoall_v', sendbuf.itemsize * (
            sum(counts) - counts[self.rank]))
        return recvbuf, recv_counts

    @_communication
    def allreduce_mean(self, array):
        """Replaces ``array`` by its mean over ranks, in place, and returns
        it: gradients of parameters outside the K-FAC blocks, and statistics
        that every rank needs (the paper's stages have no such parameters;
        its stage 3 reduce-scatters the blocks' gradients)."""
        buffers.check_contiguous_float(array)
        if self.size == 1:
            return array
        self._allreduce_sum(array)
        array /= self.size
        self._count('allreduce', array.nbytes)
        return array

    @_communication
    def bcast_array(self, array, root=0):
        """Overwrites ``array`` with its value on ``root``, in place, and
        returns it. Every rank passes an array of the same shape and
        dtype."""
        buffers.check_contiguous_float(array)
        if self.size == 1:
            return array
        self._bcast(array, root)
        self._count('bcast', array.nbytes)
        return array

    @_communication
    def group_bcast(self, array, root, ranks, wait=True):
        """Overwrites ``array`` with its value on ``root`` on the ``ranks``
        only, in place.

        Only the ranks of the group call it, with arrays of the same shape
        and dtype (in their own dtype: they are Cholesky panels); the others
        go on with their own work. The root sends one message to each other
        rank (MPI or NCCL point to point, no sub-communicator to set up).
        Ranks that take part in several groups must call in the same order
        (the stages go by block, then by panel), so that every send meets
        its receive. The root counts ``len(ranks) - 1`` copies under
        ``'bcast'``.

        Returns ``array``; with ``wait=False`` the root returns at once
        instead, with a function that waits for its sends to complete,
        which it must call before it changes ``array`` (the other ranks
        always wait for their copy).
        """
        buffers.check_contiguous_float(array)
        ranks = [int(r) for r in ranks]
        if root not in ranks or self.rank not in ranks or \
                len(set(ranks)) != len(ranks) or \
                not all(0 <= r < self.size for r in ranks):
            raise ValueError('group_bcast: rank {} with root {} needs '
                             'distinct ranks below {} holding both, got '
                             '{!r}'.format(self.rank, root, self.size, ranks))
        others = [r for r in ranks if r != root]
        done = (self._group_bcast(array, root, others) if others
                else lambda: None)
        if self.rank == root:
            self._count('bcast', array.nbytes * len(others))
        if wait or self.rank != root:
            done()
            return array
        return done

    # ChainerMN's model-wide collectives, counted and free at size 1.

    @_communication
    def multi_node_mean_grad(self, model, zero_fill=False):
        """ChainerMN's gradient averaging, counted in :attr:`bytes_moved`
        and free at world size 1."""
        if self.size == 1:
            if zero_fill:
                for param in model.params():
                    if param.grad is None and param.data is not None:
                        param.grad = param.xp.zeros_like(param.data)
            return
        super().multi_node_mean_grad(model, zero_fill)
        self._count('allreduce', sum(
            param.grad.size * self._grad_wire_itemsize(param.grad)
            for param in model.params() if param.grad is not None))

    @_communication
    def bcast_data(self, model):
        """ChainerMN's parameter broadcast from rank 0, counted in
        :attr:`bytes_moved` and free at world size 1."""
        if self.size == 1:
            return
        super().bcast_data(model)
        self._count('bcast', sum(
            param.data.size * self._data_wire_itemsize(param.data)
            for param in model.params() if param.data is not None))

    def _encode(self, array, offset, total, groups, n_summands,
                collective):
        """:func:`scaling.encode <chainerkfac.distributed.scaling.encode>`
        in the transport dtype, the groups' maxima exchanged (and
        counted) over this communicator."""
        wire, scales, exchanged = scaling.encode(
            array, self.transport_dtype, offset, total, groups, n_summands,
            self._allreduce_max)
        self._count(collective, exchanged)
        return wire, scales

    _decode = staticmethod(scaling.decode)
