"""K-FAC collectives over NCCL (CuPy arrays), MPI only to set up.

NCCL has no ``v`` (uneven) collectives: the reduce-scatter-v is one NCCL
reduce per owner, the all-gather-v one broadcast per rank and the
all-to-all-v one send and one receive per peer (NCCL 2.7 or later), each
grouped into a single NCCL launch, so every element still travels once, as
in ``MPI_Reduce_scatter`` / ``MPI_Allgatherv`` / ``MPI_Alltoallv``. A
group broadcast is the root's sends to the other ranks of the group.
Importing this module needs CuPy with NCCL. See
:mod:`chainerkfac.distributed.communicator`.
"""
import cupy
from cupy.cuda import nccl

import chainer
from chainermn.communicators import _communication_utility
from chainermn.communicators import pure_nccl_communicator

from chainerkfac.distributed.communicator import KfacCommunicatorMixin


class PureNcclCommunicator(KfacCommunicatorMixin,
                           pure_nccl_communicator.PureNcclCommunicator):
    """ChainerMN's ``pure_nccl`` communicator with the K-FAC collectives.

    Args:
        mpi_comm: An mpi4py communicator.
        transport_dtype: See
            :func:`~chainerkfac.distributed.create_communicator`.
        allreduce_grad_dtype: As in ChainerMN.
    """

    def __init__(self, mpi_comm, transport_dtype=None,
                 allreduce_grad_dtype=None):
        super().__init__(mpi_comm)
        self.set_config('allreduce_grad_dtype', allreduce_grad_dtype)
        # ChainerMN's default: pack gradients with one kernel.
        self.set_config('batched_copy', True)
        self._init_kfac(transport_dtype)

    def _reduce_scatter_v(self, sendbuf, counts):
        self._init_comms()
        recvbuf = cupy.empty(counts[self.rank], dtype=sendbuf.dtype)
        type_id = _communication_utility._get_nccl_type_id(sendbuf.dtype)
        stream = chainer.cuda.Stream.null.ptr
        nccl.groupStart()
        try:
            for root, segment in _segments(sendbuf, counts):
                if segment.size:
                    # Only the root's receive buffer is written.
                    dest = recvbuf if root == self.rank else segment
                    self.nccl_comm.reduce(
                        segment.data.ptr, dest.data.ptr, segment.size,
                        type_id, nccl.NCCL_SUM, root, stream)
        finally:
            nccl.groupEnd()
        return recvbuf

    def _all_gather_v(self, sendbuf, counts):
        self._init_comms()
        recvbuf = cupy.empty(sum(counts), dtype=sendbuf.dtype)
        type_id = _communication_utility._get_nccl_type_id(sendbuf.dtype)
        stream = chainer.cuda.Stream.null.ptr
        nccl.groupStart()
        try:
            for root, segment in _segments(recvbuf, counts):
                if segment.size:
                    # Only the root's send buffer is read.
                    source = sendbuf if root == self.rank else segment
                    self.nccl_comm.broadcast(
                        source.data.ptr, segment.data.ptr, segment.size,
                        type_id, root, stream)
        finally:
            nccl.groupEnd()
        return recvbuf

    def _alltoall_v(self, sendbuf, counts, recv_counts):
        self._init_comms()
        recvbuf = cupy.empty(sum(recv_counts), dtype=sendbuf.dtype)
        type_id = _communication_utility._get_nccl_type_id(sendbuf.dtype)
        stream = chainer.cuda.Stream.null.ptr
        sends = dict(_segments(sendbuf, counts))
        nccl.groupStart()
        try:
            for peer, segment in _segments(recvbuf, recv_counts):
                if peer == self.rank:
                    segment[...] = sends[peer]
                    continue
                if sends[peer].size:
                    self.nccl_comm.send(sends[peer].data.ptr,
                                        sends[peer].size, type_id, peer,
                                        stream)
                if segment.size:
                    self.nccl_comm.recv(segment.data.ptr, segment.size,
                                        type_id, peer, stream)
        finally:
            nccl.groupEnd()
        return recvbuf

    def _allreduce_sum(self, array):
        self._init_comms()
        self.nccl_comm.allReduce(
            array.data.ptr, array.data.ptr, array.size,
            _communication_utility._get_nccl_type_id(array.dtype),
            nccl.NCCL_SUM, chainer.cuda.Stream.null.ptr)

    def _bcast(self, array, root):
        self._init_comms()
        self.nccl_comm.bcast(
            array.data.ptr, array.size,
            _communication_utility._get_nccl_type_id(array.dtype), root,
            chainer.cuda.Stream.null.ptr)

    def _group_bcast(self, array, root, others):
        self._init_comms()
        type_id = _communication_utility._get_nccl_type_id(array.dtype)
        stream = chainer.cuda.Stream.null.ptr
        nccl.groupStart()
        try:
            if self.rank == root:
                for peer in others:
                    self.nccl_comm.send(array.data.ptr, array.size, type_id,
                                        peer, stream)
            else:
                self.nccl_comm.recv(array.data.ptr, array.size, type_id,
                                    root, stream)
        finally:
            nccl.groupEnd()
        # Queued on the stream, which runs whatever is queued after it
        # (a write to the array included) once it is done.
        return lambda: None

    def _allreduce_max(self, values):
        self._init_comms()
        buf = cupy.array(values, dtype=cupy.float64)
        self.nccl_comm.allReduce(
            buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT64,
            nccl.NCCL_MAX, chainer.cuda.Stream.null.ptr)
        return buf.get()

    def _grad_wire_itemsize(self, grad):
        # ChainerMN packs every gradient into one buffer of this dtype.
        dtype = self.allreduce_grad_dtype
        if dtype is None:
            dtype = chainer.get_dtype()
        return dtype.itemsize

    def _data_wire_itemsize(self, data):
        return chainer.get_dtype().itemsize


def _segments(array, counts):
    """Yields (rank, that rank's slice of ``array``)."""
    offset = 0
    for rank, count in enumerate(counts):
        yield rank, array[offset:offset + count]
        offset += count
