"""The stages of a K-FAC step, in one process or many (Osawa et al. CVPR
2019, §3.3, Fig. 1), over a communicator: one of
:func:`chainerkfac.create_communicator`, or in one process the
:class:`~chainerkfac.distributed.single_process.SingleProcessCommunicator`,
whose collectives are the identity. One step on every rank::

    1-2  data parallel   forward/backward on the local batch; the hooks build
                         the local statistics of every block that is due
    3    reduce-scatter  each block's gradient (and, on refresh steps, its
                         statistics, symmetric ones as their upper triangle,
                         §3.4) is summed onto the block's owner
    4-5  model parallel  owners fold statistics, refresh due inverses and
                         precondition their blocks' gradients
    6    all-gather      the preconditioned gradients, the owners' refresh
                         intervals and the step rule's sums reach every
                         rank; every rank applies the same update
"""
import contextlib
import logging
import numbers

import chainer
import chainer.links as L
import numpy
from chainer import backend

from chainerkfac import cpu_parallel
from chainerkfac import linalg
from chainerkfac import timing
from chainerkfac import step_rule
from chainerkfac.distributed import assignment as assignment_module
from chainerkfac.distributed import buffers
from chainerkfac.distributed import consistency
from chainerkfac.distributed import global_except_hook
from chainerkfac.distributed import single_process
from chainerkfac.distributed import split as split_module
from chainerkfac.optimizers import snapshot

logger = logging.getLogger(__name__)


class Stages:
    """The stages of :class:`~chainerkfac.optimizers.KFAC`.

    Each block is refreshed by its owner only, which alone stores its
    factors and inverses, and preconditioned by its owner or, when the
    assignment splits it (``max_load_imbalance``), by several ranks, each
    computing rows or columns of ``G⁻¹ ∇W̄ A⁻¹``
    (:mod:`chainerkfac.distributed.split`).

    Optimizer hooks run between stages 3 and 4, on the reduced gradients:
    under MPI a hook that needs every gradient at once
    (``GradientClipping``) is rejected with an error.

    ``communicator`` comes from :func:`~chainerkfac.create_communicator`
    (``None``: one process, which refuses to be one of several MPI
    processes, :func:`~chainerkfac.distributed.single_process.
    refuse_under_mpi`); ``max_load_imbalance`` (splitting large blocks) and
    ``arrival_deadline`` (seconds the ranks wait for each other in a
    collective of the step) are on the options page (``docs/options.md``).
    """

    def __init__(self, communicator=None, max_load_imbalance=1.1,
                 arrival_deadline=1800):
        if max_load_imbalance is not None and not (
                isinstance(max_load_imbalance, numbers.Real)
                and max_load_imbalance >= 1):
            raise ValueError('max_load_imbalance must be a number >= 1 or '
                             'None, got {!r}'.format(max_load_imbalance))
        if arrival_deadline is not None and not (
                isinstance(arrival_deadline, numbers.Real)
                and arrival_deadline > 0):
            raise ValueError('arrival_deadline must be a number of seconds '
                             '> 0 or None, got {!r}'.format(arrival_deadline))
        self.comm = single_process.SingleProcessCommunicator() \
            if communicator is None else communicator
        self._checked_mpi = False
        self.max_load_imbalance = max_load_imbalance
        self.arrival_deadline = arrival_deadline
        self.assignment = None
        self._uninitialised = []
        self._iteration = None
        self._layout = None
        #: The split blocks (:class:`~chainerkfac.distributed.split.
        #: SplitBlocks`), from the first step on.
        self.split = None
        self._part_results = {}

    # -- set-up -----------------------------------------------------------

    def setup(self, optimizer):
        """At the end of :meth:`KFAC.setup
        <chainerkfac.optimizers.KFAC.setup>`: the same model and options on
        every rank, and rank 0's parameters."""
        consistency.check_same_structure(self.comm, optimizer.target)
        self._check_options(optimizer)
        self._broadcast_parameters(optimizer)

    def _check_options(self, optimizer):
        try:
            consistency.check_same_options(
                self.comm, optimizer,
                [('max_load_imbalance', repr(self.max_load_imbalance))])
        except ValueError as e:
            raise ValueError('{} (at iteration {}: changed on some ranks '
                             'after setup)'.format(e, optimizer.t)) from None

    def _broadcast_parameters(self, optimizer):
        # Every rank starts from rank 0's parameters; lazily initialised
        # ones are broadcast once they exist, before their first update.
        self.comm.bcast_data(optimizer.target)
        self._uninitialised = [
            p for p in optimizer.target.params(include_uninit=True)
            if p.array is None]

    def broadcast_new_parameters(self, optimizer):
        """After the step's forward and backward passes: gives the
        parameters that lazily initialised links created in them rank 0's
        values on every process; returns whether it did (the gradients
        are then to be computed again)."""
        if self.comm.size == 1 or not any(
                p.array is not None for p in self._uninitialised):
            return False
        self._broadcast_parameters(optimizer)
        return True

    def abandon(self, error):
        """A rank that exits (``sys.exit``) or is interrupted in the middle
        of a step aborts the job: the others wait in the step's
        collectives, and the global except hook sees neither."""
        if self.comm.size > 1 and not isinstance(error, Exception):
            global_except_hook.abort(
                '{} in the middle of K-FAC iteration {}'.format(
                    type(error).__name__, self._iteration))

    def rank_and_size(self):
        """``(rank, number of processes)`` of this process."""
        return self.comm.rank, self.comm.size

    def prepare(self, optimizer):
        """At the start of every update: in one process, refuses at the
        first to run in one of several MPI processes (unless the optimizer
        was told its processes are independent); under MPI, every rank at
        the same iteration within the deadline, and no hook that needs
        every gradient at once."""
        self.comm.stage_timer = optimizer.stage_timer
        self._iteration = optimizer.t + 1
        self.comm.watch.deadline = self.arrival_deadline
        self.comm.watch.step = 'K-FAC iteration {}'.format(self._iteration)
        if self.comm.size == 1:
            if not (self._checked_mpi or optimizer.independent_processes):
                single_process.refuse_under_mpi()
            self._checked_mpi = True
            return
        consistency.check_same_step(self.comm, optimizer,
                                    self.arrival_deadline)
        hooks = optimizer.whole_model_hooks()
        if hooks:
            raise ValueError(
                'optimizer hook {!r} needs every gradient at once, which '
                'distributed K-FAC does not gather before preconditioning; '
                'use per-parameter hooks such as WeightDecay or '
                'Lasso'.format(hooks[0]))

    # -- resuming -----------------------------------------------------------

    def redistribute(self, optimizer, resume):
        """:func:`chainerkfac.optimizers.snapshot.redistribute` in this
        run's placement."""
        if self.assignment is None:
            self._assign(optimizer)
        snapshot.redistribute(self.comm, self.assignment, self.split,
                              optimizer.blocks, resume)

    # -- stage 3 ------------------------------------------------------------

    def _assign(self, optimizer):
        blocks = optimizer.blocks
        self.assignment, fractions = assignment_module.place_blocks(
            blocks, self.comm.size, self.max_load_imbalance)
        self.split = split_module.SplitBlocks(self.comm, self.assignment,
                                              blocks, fractions)
        self._layout = buffers.Layout(self.assignment, self.split.splits,
                                      moves_gradients=self.comm.size > 1)
        if self.comm.rank == 0 and self.comm.size > 1:
            logger.info('K-FAC blocks on %d ranks: load imbalance (max/mean) '
                        '%.2f, idle ranks %s, split blocks %s', self.comm.size,
                        self.assignment.load_imbalance,
                        list(self.assignment.idle_ranks),
                        {blocks[i].name: len(self.assignment.shards[i])
                         for i in self.assignment.split_blocks})
        covered = {id(p) for b in blocks for p in b.params()}
        self._other_params = [p for p in optimizer.target.params()
                              if id(p) not in covered]
        self._running_statistics = [
            link for link in optimizer.target.links()
            if isinstance(link, L.BatchNormalization)
            and link.avg_mean is not None]

    def reduce(self, optimizer):
        """Gradients and statistics after backward, before the hooks
        (stage 3); returns ``{block: {factor: batch mean}}`` for the blocks
        this process refreshes."""
        if self.assignment is None:
            self._assign(optimizer)
        blocks = optimizer.blocks
        self._average_replicated()
        if not blocks:
            return {}
        # Timed as statistics on steps that carry some (stale steps pack
        # gradients only, which is the all-gather's counterpart).
        folding = optimizer.timing('statistics_fold') if any(
            b.has_pending_statistics() for b in blocks) else \
            contextlib.nullcontext()
        if not self._layout.moves_gradients:  # one rank: nothing to sum
            with folding:
                return self._layout.hold_statistics(blocks)
        grads = [block.gradient() for block in blocks]
        with folding:
            parts, sizes = self._layout.pack_reduce(blocks, grads)
        xp = backend.get_array_module(grads[0])
        # One transport scale per gradient and per factor.
        groups = numpy.cumsum([0] + [flat.size for flat in parts[:-1]])
        mine = self.comm.reduce_scatter_v(
            xp.concatenate(parts), self.assignment.segment_counts(sizes),
            groups)
        mine /= self.comm.size
        return self._layout.unpack_reduce(blocks, mine, self.split.parts)

    def _average_replicated(self):
        """What every rank keeps whole: gradients of parameters outside the
        blocks (momentum SGD on every rank) and BatchNorm running means
        and variances. Averaging these every step equals averaging them
        before evaluation or a snapshot (their update is linear), and
        keeps the replicas identical."""
        if self.comm.size == 1:
            return
        replicated = [p.grad for p in self._other_params
                      if p.grad is not None]
        for link in self._running_statistics:
            replicated += [link.avg_mean, link.avg_var]
        buffers.average_replicated(self.comm, replicated)

    def agree(self, ok):
        """Whether every process can take the step (``ok`` is local)."""
        if self.comm.size == 1:
            return ok
        with timing.timed(self.comm.stage_timer,
                          'communication_control'):
            return bool(self.comm.control_sum([not ok])[0] == 0)

    # -- stages 4-6 -----------------------------------------------------------

    def placement(self, blocks):
        """``'rank R'`` per block (with the ranks a split block's
        preconditioning is shared with); before the first update, which
        places the blocks once their shapes are known, says so."""
        if self.comm.size == 1:
            return None
        if self.assignment is None:
            return ['rank set at the first update'] * len(blocks)
        return ['rank {}'.format(owner) if len(ranks) == 1 else
                'rank {}, preconditioned by ranks {}'.format(
                    owner, ', '.join(map(str, ranks)))
                for owner, ranks in zip(self.assignment.owners,
                                        self.assignment.shards)]

    def owned(self, blocks):
        """The blocks this process refreshes."""
        mine = set(self.assignment.blocks_of(self.comm.rank))
        return [b for i, b in enumerate(blocks) if i in mine]

    def share_inverses(self, optimizer, refreshed):
        """The parts of split blocks travel from their owners to the other
        ranks of each block (:meth:`SplitBlocks.share
        <chainerkfac.distributed.split.SplitBlocks.share>`)."""
        if self.split.splits:
            with optimizer.timing('inversion'):
                self.split.share(optimizer.blocks, refreshed)

    def precondition(self, optimizer, weight_decay):
        """Replaces the gradients of the blocks (or parts of blocks) this
        process preconditions by ``V = F̂⁻¹ ∇`` (stage 5); returns this
        process's part of the step rule's sums, ``(len(optimizer.blocks),
        step_rule.N_TERMS)`` (:func:`chainerkfac.step_rule.block_sums`;
        zero rows for the blocks it does not precondition)."""
        blocks = optimizer.blocks
        parts = self.split.parts
        mine = sorted(parts)
        index = {id(block): i for i, block in enumerate(blocks)}

        def compute(block):
            """``(this rank's part of V or None, its step-rule sums or
            None)``."""
            i = index[id(block)]
            split = self.split.splits.get(i)
            if split is None:
                return None, precondition(block, weight_decay)
            s = parts[i]
            if split.empty(s):
                # An owner busy enough with the inverses: no part of V.
                return None, None
            form = self.split.part_form(block, i)
            if form is None:
                # As an unsplit block before its first inverse: the raw
                # gradient, without the weight-decay term.
                part = split.part_of(block.gradient(), s)
                return part, step_rule.block_sums(part, part)
            grad = block.gradient(weight_decay)
            part = form.apply(grad)
            return part, step_rule.block_sums(part, split.part_of(grad, s))

        def flops(block):
            i = index[id(block)]
            weight = self.assignment.weights[i][parts[i]]
            return weight * block.cost().precondition_cost

        results = cpu_parallel.map_blocks(
            compute, [blocks[i] for i in mine], flops)
        self._part_results = {i: part for i, (part, _) in zip(mine, results)
                              if part is not None}
        # Zero rows for the blocks this rank leaves alone, and for an owner
        # whose part is empty.
        rows = [(i, terms) for i, (_, terms) in zip(mine, results)
                if terms is not None]
        local = stack([terms for _, terms in rows])
        xp = backend.get_array_module(local)
        everyone = xp.zeros((len(blocks), step_rule.N_TERMS),
                            dtype=local.dtype)
        if rows:
            everyone[[i for i, _ in rows]] = local
        return everyone

    def gather(self, optimizer, terms, samples):
        """All-gathers (stage 6) the preconditioned gradients, the
        owners' refresh intervals, each rank's ``terms`` (the step rule's
        sums of its parts), its batch size ``samples`` and a digest of its
        options (an option changed on some ranks only stops every rank
        here, naming it); returns the terms and batch sizes summed over
        the ranks. Every rank, the owner too, takes the intervals as
        received, and the gradients too where a ``transport_dtype`` rounds
        them: the replicas and their refresh schedules agree."""
        blocks = optimizer.blocks
        if not blocks:
            return backend.CpuDevice().send(terms).astype(numpy.float64), \
                float(samples)
        layout = self._layout
        places, groups, slots, by_rank = layout.gather(step_rule.N_TERMS, 2)
        mine = sorted(self.split.parts.items())
        grad0 = next(p.grad for block in blocks for p in block.params()
                     if p.grad is not None)
        xp = backend.get_array_module(grad0)
        # The preconditioned gradients and the step's terms of a float16
        # model are float32, as computed (a transport_dtype narrows them).
        dtype = linalg.working_dtype(grad0.dtype)
        sendbuf = layout.pack_gather(
            blocks, mine, self._part_results,
            xp.asarray(terms[[i for i, _ in mine]]),
            [samples, consistency.options_digest(optimizer)], dtype)
        counts = numpy.diff([0] + [int(sl[-1]) + 1 for sl in slots]).tolist()
        everything = self.comm.all_gather_v(sendbuf, counts, groups)
        chainer.report({'kfac/bytes/' + name: value for name, value
                        in self.comm.reset_bytes_moved().items()})
        values = backend.CpuDevice().send(
            everything[numpy.concatenate(slots)]).astype(numpy.float64)
        totals, (sizes, digests) = buffers.sum_terms(
            values, slots, by_rank, len(blocks), step_rule.N_TERMS)
        if len(set(digests)) > 1:
            self._check_options(optimizer)
        consistency.check_equal_batches(sizes, optimizer.t)
        # Without a transport_dtype an owner's gradients come back as it
        # sent them: only a rounding transport makes it take the copy.
        rounded = self.comm.get_config('transport_dtype') is not None
        owners, rank = self.assignment.owners, self.comm.rank
        layout.unpack_gather(blocks, everything, places, optimizer.t, dtype,
                             lambda i: not rounded and owners[i] == rank)
        return totals, float(sum(sizes))


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
