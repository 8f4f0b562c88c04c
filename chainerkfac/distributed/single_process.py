"""The communicator of one process: every collective the identity.

A K-FAC step in one process is the distributed step
(:class:`chainerkfac.optimizers.stages.Stages`) over this communicator:
one process owns every block, nothing is split, and what the
collectives would sum or gather over one rank is what they were given
(so the gradients and statistics do not enter the step's buffers:
:class:`~chainerkfac.distributed.buffers.Layout`). It needs neither MPI
nor ChainerMN.
"""
import sys

import numpy

from chainerkfac.distributed import arrival


class SingleProcessCommunicator:
    """Rank 0 of 1; the methods the step's stages call on a
    :class:`~chainerkfac.distributed.KfacCommunicatorMixin`, moving
    nothing."""

    rank = 0
    size = 1
    #: Set by the stages at every update; this communicator times nothing.
    stage_timer = None

    def __init__(self):
        #: The step's deadline, which nothing here waits on.
        self.watch = arrival.Watch(None)

    def bcast_data(self, model):
        """Rank 0's parameters are this process's."""

    def reduce_scatter_v(self, sendbuf, counts, groups=None):
        """The sum over one rank of its only segment: ``sendbuf``."""
        return sendbuf

    def all_gather_v(self, sendbuf, counts, groups=None):
        """Every rank's segment, this one's: ``sendbuf``."""
        return sendbuf

    def allreduce_mean(self, array):
        """The mean over one rank: ``array`` as it is."""

    def control_sum(self, values, at_start=False):
        """``values``, summed over one rank, as a float64 NumPy array."""
        return numpy.asarray(values, dtype=numpy.float64)

    def gather_obj(self, obj):
        """The list of every rank's ``obj``."""
        return [obj]

    def bcast_obj(self, obj):
        """Rank 0's ``obj``."""
        return obj

    def get_config(self, name=None):
        """No transport option is set: gradients travel as computed."""
        return None

    def reset_bytes_moved(self):
        """Nothing moved: ``{}``."""
        return {}


def refuse_under_mpi():
    """Raises ``RuntimeError`` when this process is one of several MPI
    processes (mpi4py already initialised, ``COMM_WORLD`` larger than 1).

    K-FAC that was not made distributed by
    :func:`chainerkfac.create_multi_node_optimizer` preconditions with the
    curvature of its own process's batch. Under ChainerMN's
    ``chainermn.create_multi_node_optimizer`` the gradients are averaged,
    the curvature is not, and the replicas drift apart without a word.
    """
    mpi = sys.modules.get('mpi4py.MPI')
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    size = mpi.COMM_WORLD.Get_size()
    if size > 1:
        raise RuntimeError(
            'KFAC runs in one of {} MPI processes without '
            'chainerkfac.create_multi_node_optimizer: every process would '
            'precondition with the curvature of its own batch and the '
            'replicas would drift apart. Use '
            'chainerkfac.create_multi_node_optimizer(optimizer, communicator)'
            ' (a chainermn.create_communicator communicator works too) '
            'instead of chainermn.create_multi_node_optimizer; or, if every '
            'process deliberately trains its own model (a sweep, one model '
            'per rank), KFAC(..., independent_processes=True)'.format(size))
