"""The stages of a K-FAC step: what moves between processes, and when.

:class:`~chainerkfac.optimizers.KFAC` runs one step in the order of Osawa
et al. (CVPR 2019) Algorithm 1 and hands every stage that depends on where
the blocks live to a :class:`Stages` object::

    prepare          once per update, before the step
    broadcast_new_parameters
                     after backward: lazily initialised weights from rank 0
    reduce           gradients and statistics after backward (stage 3)
    agree            every process takes the step, or none
    owned            the blocks this process refreshes (stages 4-5)
    share_inverses   after the refresh: what split blocks' parts need
    precondition     V = F̂⁻¹ ∇ for this process's blocks (stage 5)
    gather           V and the step rule's sums on every process (stage 6)

:class:`LocalStages` is one process, where nothing moves;
:class:`chainerkfac.distributed.HybridParallelStages` is the paper's hybrid
data/model-parallel scheme under MPI (§3.3). The optimizer's step is the
same code for both.
"""
import abc
import sys

from chainer import backend
import numpy

from chainerkfac import cpu_parallel
from chainerkfac import step_rule


class Stages(abc.ABC):
    """The interface between the optimizer's step and where blocks live."""

    @abc.abstractmethod
    def setup(self, optimizer):
        """Called at the end of :meth:`KFAC.setup
        <chainerkfac.optimizers.KFAC.setup>`."""

    @abc.abstractmethod
    def prepare(self, optimizer):
        """Called at the start of every :meth:`KFAC.update
        <chainerkfac.optimizers.KFAC.update>`."""

    @abc.abstractmethod
    def broadcast_new_parameters(self, optimizer):
        """Called after the step's forward and backward passes: gives the
        parameters that lazily initialised links created in them rank 0's
        values on every process; returns whether it did (the gradients
        are then to be computed again)."""

    @abc.abstractmethod
    def abandon(self, error):
        """Called when ``error`` stops this process in the middle of an
        update, before it propagates: ends the other processes, waiting in
        the step's collectives, where nothing else would."""

    @abc.abstractmethod
    def redistribute(self, optimizer, resume):
        """After loading a snapshot (``resume``, a
        :class:`~chainerkfac.optimizers.snapshot.Resume`), at the first
        update: checks that the processes loaded every file and moves each
        block's curvature to its owner in this run's placement."""

    @abc.abstractmethod
    def reduce(self, optimizer):
        """Gradients and statistics after backward, before the hooks.

        Returns ``{block: {factor: batch mean}}`` for the blocks this
        process refreshes.
        """

    @abc.abstractmethod
    def agree(self, ok):
        """Whether every process can take the step (``ok`` is local)."""

    @abc.abstractmethod
    def rank_and_size(self):
        """``(rank, number of processes)`` of this process."""

    @abc.abstractmethod
    def placement(self, blocks):
        """Where each of ``blocks`` lives, as text, one per block (for
        :meth:`KFAC.describe <chainerkfac.optimizers.KFAC.describe>`), or
        ``None`` in one process."""

    @abc.abstractmethod
    def owned(self, blocks):
        """The blocks this process refreshes."""

    @abc.abstractmethod
    def share_inverses(self, optimizer, refreshed):
        """Called after the due inverses were refreshed (``refreshed`` are
        the blocks whose inverse this process recomputed), before
        preconditioning."""

    @abc.abstractmethod
    def precondition(self, optimizer, weight_decay):
        """Replaces the gradients of the blocks (or parts of blocks) this
        process preconditions by ``V = F̂⁻¹ ∇``; returns this process's part
        of the step rule's sums, an array ``(len(optimizer.blocks),
        step_rule.N_TERMS)`` (:func:`chainerkfac.step_rule.block_terms`;
        zero rows for the blocks it does not precondition)."""

    @abc.abstractmethod
    def gather(self, optimizer, terms, samples):
        """Shares preconditioned gradients and the refresh schedules of the
        factors this process refreshed. ``terms`` is this process's part of
        the step rule's sums (what :meth:`precondition` returned),
        ``samples`` the size of its batch; returns their sums over every
        process, ``(NumPy array like terms, number)``, the same numbers on
        each."""


class LocalStages(Stages):
    """The stages of one K-FAC step in a single process: nothing moves."""

    def __init__(self):
        self._checked_mpi = False

    def setup(self, optimizer):
        pass

    def prepare(self, optimizer):
        """At the first update, refuses to run in one of several MPI
        processes (see :func:`refuse_under_mpi`) unless the optimizer was
        told its processes are independent."""
        if not self._checked_mpi:
            self._checked_mpi = True
            if not optimizer.independent_processes:
                refuse_under_mpi()

    def broadcast_new_parameters(self, optimizer):
        return False

    def abandon(self, error):
        pass

    def redistribute(self, optimizer, resume):
        """One process holds every block: only the files are checked."""
        resume.check_complete(resume.loaded)

    def reduce(self, optimizer):
        pending = [block for block in optimizer.blocks
                   if block.has_pending_statistics()]
        if not pending:
            return {}
        with optimizer.timing('statistics_fold'):
            return {block: block.take_statistics(
                block.gradient_loss_scale()) for block in pending}

    def agree(self, ok):
        return ok

    def rank_and_size(self):
        return 0, 1

    def placement(self, blocks):
        return None

    def owned(self, blocks):
        return blocks

    def share_inverses(self, optimizer, refreshed):
        pass

    def precondition(self, optimizer, weight_decay):
        return step_rule.stack_terms(cpu_parallel.map_blocks(
            lambda block: block.precondition(weight_decay),
            self.owned(optimizer.blocks),
            cpu_parallel.block_work('precondition_cost')))

    def gather(self, optimizer, terms, samples):
        return backend.CpuDevice().send(terms).astype(numpy.float64), samples


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
