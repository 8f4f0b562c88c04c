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

:class:`Stages` itself is one process, where nothing moves (its
:class:`LocalStages` refuses to run under MPI);
:class:`chainerkfac.distributed.HybridParallelStages` overrides what moves
in the paper's hybrid data/model-parallel scheme under MPI (§3.3). The
optimizer's step is the same code for both.
"""
import sys

from chainer import backend
import numpy

from chainerkfac import cpu_parallel
from chainerkfac import step_rule


class Stages:
    """The interface between the optimizer's step and where blocks live,
    and its one-process implementation, where nothing moves: every block
    is this process's, each collective the identity."""

    def setup(self, optimizer):
        """Called at the end of :meth:`KFAC.setup
        <chainerkfac.optimizers.KFAC.setup>`."""

    def prepare(self, optimizer):
        """Called at the start of every :meth:`KFAC.update
        <chainerkfac.optimizers.KFAC.update>`."""

    def broadcast_new_parameters(self, optimizer):
        """Called after the step's forward and backward passes: gives the
        parameters that lazily initialised links created in them rank 0's
        values on every process; returns whether it did (the gradients
        are then to be computed again)."""
        return False

    def abandon(self, error):
        """Called when ``error`` stops this process in the middle of an
        update, before it propagates: ends the other processes, waiting in
        the step's collectives, where nothing else would."""

    def redistribute(self, optimizer, resume):
        """After loading a snapshot (``resume``, a
        :class:`~chainerkfac.optimizers.snapshot.Resume`), at the first
        update: checks that the processes loaded every file and moves each
        block's curvature to its owner in this run's placement (in one
        process, only the files are checked)."""
        resume.check_complete(resume.loaded)

    def reduce(self, optimizer):
        """Gradients and statistics after backward, before the hooks.

        Returns ``{block: {factor: batch mean}}`` for the blocks this
        process refreshes.
        """
        pending = [block for block in optimizer.blocks
                   if block.has_pending_statistics()]
        if not pending:
            return {}
        with optimizer.timing('statistics_fold'):
            return {block: block.take_statistics(
                block.gradient_loss_scale()) for block in pending}

    def agree(self, ok):
        """Whether every process can take the step (``ok`` is local)."""
        return ok

    def rank_and_size(self):
        """``(rank, number of processes)`` of this process."""
        return 0, 1

    def placement(self, blocks):
        """Where each of ``blocks`` lives, as text, one per block (for
        :meth:`KFAC.describe <chainerkfac.optimizers.KFAC.describe>`), or
        ``None`` in one process."""
        return None

    def owned(self, blocks):
        """The blocks this process refreshes."""
        return blocks

    def share_inverses(self, optimizer, refreshed):
        """Called after the due inverses were refreshed (``refreshed`` are
        the blocks whose inverse this process recomputed), before
        preconditioning."""

    def precondition(self, optimizer, weight_decay):
        """Replaces the gradients of the blocks (or parts of blocks) this
        process preconditions by ``V = F̂⁻¹ ∇``; returns this process's part
        of the step rule's sums, an array ``(len(optimizer.blocks),
        step_rule.N_TERMS)`` (:func:`chainerkfac.step_rule.block_sums`;
        zero rows for the blocks it does not precondition)."""
        return stack(cpu_parallel.map_blocks(
            lambda block: precondition(block, weight_decay),
            self.owned(optimizer.blocks),
            cpu_parallel.block_work('precondition_cost')))

    def gather(self, optimizer, terms, samples):
        """Shares preconditioned gradients and the refresh schedules of the
        factors this process refreshed. ``terms`` is this process's part of
        the step rule's sums (what :meth:`precondition` returned),
        ``samples`` the size of its batch; returns their sums over every
        process, ``(NumPy array like terms, number)``, the same numbers on
        each."""
        return backend.CpuDevice().send(terms).astype(numpy.float64), samples


class LocalStages(Stages):
    """The stages of one K-FAC step in a single process, which refuse to
    run in one of several MPI processes."""

    def __init__(self):
        self._checked_mpi = False

    def prepare(self, optimizer):
        """At the first update, refuses to run in one of several MPI
        processes (see :func:`refuse_under_mpi`) unless the optimizer was
        told its processes are independent."""
        if not self._checked_mpi:
            self._checked_mpi = True
            if not optimizer.independent_processes:
                refuse_under_mpi()


def precondition(block, weight_decay):
    """Puts ``V = F̂⁻¹ ∇`` in ``block``'s gradients; returns its row of
    :func:`chainerkfac.step_rule.block_sums`."""
    V, grad = block.direction(weight_decay)
    # The sums before set_gradient: the gradient of a layer without a bias
    # (and without the decay term) is a view of param.grad, which
    # set_gradient overwrites with V.
    row = step_rule.block_sums(V, grad)
    if V is not grad:  # a block without an inverse keeps its gradient
        block.set_gradient(V)
    return row


def stack(rows):
    """Rows of :func:`chainerkfac.step_rule.block_sums` as one ``(blocks,
    N_TERMS)`` array of their module (a NumPy one without rows)."""
    if not rows:
        return numpy.zeros((0, step_rule.N_TERMS))
    return backend.get_array_module(rows[0]).stack(rows)


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
