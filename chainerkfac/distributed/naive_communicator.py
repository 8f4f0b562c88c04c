"""K-FAC collectives over MPI (mpi4py), on the arrays themselves.

NumPy arrays work with any MPI; CuPy arrays need a CUDA-aware MPI, as with
ChainerMN's ``naive`` communicator. See
:mod:`chainerkfac.distributed.communicator`.
"""
import mpi4py.MPI
import numpy

import chainer
from chainermn.communicators import naive_communicator

from chainerkfac.distributed.communicator import KfacCommunicatorMixin


class NaiveCommunicator(KfacCommunicatorMixin,
                        naive_communicator.NaiveCommunicator):
    """ChainerMN's ``naive`` communicator with the K-FAC collectives.

    Args:
        mpi_comm: An mpi4py communicator.
        transport_dtype: See
            :func:`~chainerkfac.distributed.create_communicator`.
    """

    def __init__(self, mpi_comm, transport_dtype=None):
        super().__init__(mpi_comm)
        self._init_kfac(transport_dtype)
        # A communicator of its own keeps group broadcasts from matching
        # other point-to-point traffic on the user's; Dup is collective,
        # so it cannot wait for the first group broadcast.
        self._group_comm = mpi_comm.Dup()

    def _reduce_scatter_v(self, sendbuf, counts):
        xp = chainer.backend.get_array_module(sendbuf)
        recvbuf = xp.empty(counts[self.rank], dtype=sendbuf.dtype)
        _wait_for_device(xp)
        self.watch.wait(self.mpi_comm.Ireduce_scatter(
            sendbuf, recvbuf, recvcounts=counts, op=mpi4py.MPI.SUM),
            'the reduce-scatter')
        return recvbuf

    def _all_gather_v(self, sendbuf, counts):
        xp = chainer.backend.get_array_module(sendbuf)
        recvbuf = xp.empty(sum(counts), dtype=sendbuf.dtype)
        _wait_for_device(xp)
        self.watch.wait(self.mpi_comm.Iallgatherv(sendbuf, [recvbuf, counts]),
                        'the all-gather')
        return recvbuf

    def _alltoall_v(self, sendbuf, counts, recv_counts):
        xp = chainer.backend.get_array_module(sendbuf)
        recvbuf = xp.empty(sum(recv_counts), dtype=sendbuf.dtype)
        _wait_for_device(xp)
        self.watch.wait(self.mpi_comm.Ialltoallv(
            [sendbuf, counts], [recvbuf, recv_counts]), 'the all-to-all')
        return recvbuf

    def _allreduce_sum(self, array):
        _wait_for_device(chainer.backend.get_array_module(array))
        self.watch.wait(self.mpi_comm.Iallreduce(
            mpi4py.MPI.IN_PLACE, array, op=mpi4py.MPI.SUM), 'the allreduce')

    def _bcast(self, array, root):
        _wait_for_device(chainer.backend.get_array_module(array))
        self.watch.wait(self.mpi_comm.Ibcast(array, root=root),
                        'the broadcast')

    def _group_bcast(self, array, root, others):
        _wait_for_device(chainer.backend.get_array_module(array))
        if self.rank == root:
            requests = [self._group_comm.Isend(array, dest=r) for r in others]
        else:
            requests = [self._group_comm.Irecv(array, source=root)]
        return lambda: mpi4py.MPI.Request.Waitall(requests)

    def _allreduce_max(self, values):
        buf = numpy.array(values, dtype=numpy.float64)
        self.mpi_comm.Allreduce(mpi4py.MPI.IN_PLACE, buf, op=mpi4py.MPI.MAX)
        return buf

    @staticmethod
    def _grad_wire_itemsize(array):
        # ChainerMN's MPI path sends float16 as float32.
        return 4 if array.dtype == numpy.float16 else array.dtype.itemsize

    _data_wire_itemsize = _grad_wire_itemsize


def _wait_for_device(xp):
    # MPI reads device memory directly: kernels still queued on the null
    # stream must have written it first.
    if xp is not numpy:
        chainer.backends.cuda.Stream.null.synchronize()
