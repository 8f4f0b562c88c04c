"""Distributed K-FAC: placement of the curvature blocks on ranks and the
communicator that moves factors and gradients between them (Osawa et al.,
CVPR 2019, §3.3).

Nothing here imports MPI or CuPy until a communicator is created.
"""
import chainer
import chainermn

from chainerkfac.distributed.assignment import assign_blocks  # NOQA
from chainerkfac.distributed.assignment import assign_blocks_by_count  # NOQA
from chainerkfac.distributed.assignment import Assignment  # NOQA
from chainerkfac.distributed.assignment import BlockCost  # NOQA
from chainerkfac.distributed.consistency import check_same_options  # NOQA
from chainerkfac.distributed.consistency import check_same_structure  # NOQA
from chainerkfac.distributed.arrival import ArrivalTimeout  # NOQA
from chainerkfac.distributed.communicator import KfacCommunicatorMixin  # NOQA
from chainerkfac.distributed.global_except_hook import (  # NOQA
    install_global_except_hook)
from chainerkfac.optimizers import kfac
from chainerkfac.optimizers import stages


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
            :meth:`~KfacCommunicatorMixin.all_gather_v` (not in the paper);
            each tensor is scaled by a power of two so that its largest
            value, times the number of summands, stays within half the
            dtype's range. Off by default: float16 keeps about 3
            significant digits.
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
        if not chainer.backends.cuda.available:
            raise ImportError(
                "communicator 'pure_nccl' needs CuPy with NCCL and one GPU "
                "per process, and CuPy is not available here; 'naive' is "
                'the CPU choice (MPI through mpi4py)')
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


def create_multi_node_optimizer(actual_optimizer, communicator,
                                max_load_imbalance=1.1,
                                arrival_deadline=1800):
    """Makes an optimizer distributed, as ChainerMN's function of that name.

    For :class:`~chainerkfac.optimizers.KFAC` the optimizer itself is
    returned, now running its :class:`~chainerkfac.optimizers.stages.Stages`
    over ``communicator`` (with
    ``max_load_imbalance`` and ``arrival_deadline``, 30 minutes by default,
    see there); other optimizers are wrapped by
    :func:`chainermn.create_multi_node_optimizer` (data-parallel gradient
    averaging).

    ``communicator`` is one of :func:`create_communicator`, or one of
    :func:`chainermn.create_communicator`: K-FAC then runs over a K-FAC
    communicator of the same kind on the same MPI communicator (``'naive'``
    for ChainerMN's ``naive`` and ``flat``, ``'pure_nccl'`` for its NCCL
    communicators).
    """
    if isinstance(actual_optimizer, kfac.KFAC):
        if actual_optimizer.independent_processes:
            raise ValueError(
                'create_multi_node_optimizer given a KFAC with '
                'independent_processes=True: a distributed KFAC shares one '
                'model and its curvature over the processes; leave '
                'independent_processes False')
        actual_optimizer.use_stages(stages.Stages(
            _kfac_communicator(communicator), max_load_imbalance,
            arrival_deadline))
        return actual_optimizer
    return chainermn.create_multi_node_optimizer(actual_optimizer,
                                                 communicator)


def _kfac_communicator(communicator):
    if isinstance(communicator, KfacCommunicatorMixin):
        return communicator
    from chainermn.communicators import flat_communicator
    from chainermn.communicators import mpi_communicator_base
    from chainermn.communicators import naive_communicator
    if not isinstance(communicator,
                      mpi_communicator_base.MpiCommunicatorBase):
        raise TypeError(
            'create_multi_node_optimizer needs a communicator of '
            'chainerkfac.create_communicator or chainermn.create_communicator,'
            ' got {}'.format(type(communicator).__name__))
    if isinstance(communicator, (naive_communicator.NaiveCommunicator,
                                 flat_communicator.FlatCommunicator)):
        return create_communicator('naive', mpi_comm=communicator.mpi_comm)
    return create_communicator(
        'pure_nccl', mpi_comm=communicator.mpi_comm,
        allreduce_grad_dtype=getattr(communicator, 'allreduce_grad_dtype',
                                     None))
