"""Distributed K-FAC: placement of the curvature blocks on ranks and the
communicator that moves factors and gradients between them (Osawa et al.,
CVPR 2019, §3.3).

Nothing here imports MPI or CuPy until a communicator is created.
"""
from chainerkfac.distributed.assignment import assign_blocks  # NOQA
from chainerkfac.distributed.assignment import assign_blocks_by_count  # NOQA
from chainerkfac.distributed.assignment import Assignment  # NOQA
from chainerkfac.distributed.assignment import BlockCost  # NOQA
from chainerkfac.distributed.consistency import check_same_options  # NOQA
from chainerkfac.distributed.consistency import check_same_structure  # NOQA
from chainerkfac.distributed.communicator import KfacCommunicatorMixin  # NOQA
from chainerkfac.distributed.global_except_hook import (  # NOQA
    install_global_except_hook)
from chainerkfac.distributed.multi_node_optimizer import (  # NOQA
    create_multi_node_optimizer)
from chainerkfac.distributed.multi_node_optimizer import (  # NOQA
    HybridParallelStages)


def create_communicator(communicator_name='naive', mpi_comm=None,
                        transport_dtype=None, allreduce_grad_dtype=None,
                        abort_on_exception=True):
    """Creates a K-FAC communicator, as :func:`chainermn.create_communicator`
    does a ChainerMN one.

    Args:
        communicator_name (str): ``'naive'``: MPI through mpi4py on the
            arrays themselves (NumPy on CPU; CuPy needs a CUDA-aware MPI).
            ``'pure_nccl'``: NCCL through CuPy for arrays, MPI only to set
            up; call ``chainer.cuda.get_device_from_id(comm.intra_rank).use()``
            before the first collective.
        mpi_comm: An mpi4py communicator; ``MPI.COMM_WORLD`` by default.
        transport_dtype: ``None`` sends arrays in their own dtype. A
            narrower float dtype (``numpy.float16``) halves the traffic of
            :meth:`~KfacCommunicatorMixin.reduce_scatter_v` and
            :meth:`~KfacCommunicatorMixin.all_gather_v` (paper §3.4); the
            arrays are scaled by a power of two so that the largest value,
            times the number of summands, stays within the dtype's range.
            Off by default: float16 keeps about 3 significant digits.
        allreduce_grad_dtype: ``'pure_nccl'`` only, as in ChainerMN: the
            dtype of ``multi_node_mean_grad``'s transfers.
        abort_on_exception (bool): When there is more than one rank, install
            :func:`~chainerkfac.distributed.install_global_except_hook`, so
            that an uncaught exception on any rank ends the whole job
            instead of leaving the other ranks waiting in a collective.

    Returns:
        A communicator with ChainerMN's interface and the methods of
        :class:`KfacCommunicatorMixin`.
    """
    if mpi_comm is None:
        import mpi4py.MPI
        mpi_comm = mpi4py.MPI.COMM_WORLD

    if communicator_name == 'naive':
        if allreduce_grad_dtype is not None:
            raise ValueError("allreduce_grad_dtype is only available with "
                             "the 'pure_nccl' communicator")
        from chainerkfac.distributed.naive_communicator \
            import NaiveCommunicator
        comm = NaiveCommunicator(mpi_comm, transport_dtype=transport_dtype)
    elif communicator_name == 'pure_nccl':
        from chainerkfac.distributed.pure_nccl_communicator \
            import PureNcclCommunicator
        comm = PureNcclCommunicator(
            mpi_comm, transport_dtype=transport_dtype,
            allreduce_grad_dtype=allreduce_grad_dtype)
    else:
        raise ValueError('unknown communicator {!r}; expected \'naive\' or '
                         '\'pure_nccl\''.format(communicator_name))

    if abort_on_exception and comm.size > 1:
        install_global_except_hook()
    return comm
