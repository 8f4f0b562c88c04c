"""Hybrid data/model-parallel K-FAC (Osawa et al. CVPR 2019, §3.3, Fig. 1).

One step on every rank::

    1-2  data parallel   forward/backward on the local batch; the hooks build
                         the local statistics of every block that is due
    3    reduce-scatter  each block's gradient (and, on refresh steps, its
                         packed statistics) is summed onto the block's owner;
                         gradients of other parameters are allreduced
    4-5  model parallel  owners fold statistics, refresh due inverses and
                         precondition their blocks' gradients (a split
                         block: its ranks share the preconditioning and,
                         in the Cholesky form, the factorization)
    6    all-gather      the preconditioned gradients (and the intervals
                         the owners' refresh schedules adapted to) reach
                         every rank; every rank applies the same update

On a stale step only gradients travel: a reduce-scatter plus an all-gather,
the volume of the allreduce of data-parallel SGD. Symmetric factors travel
as their upper triangle (§3.4). Owners come from a cost model
(:func:`chainerkfac.distributed.assign_blocks`), not from a count.
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
from chainerkfac.distributed import split as split_module
from chainerkfac.optimizers import snapshot
from chainerkfac.optimizers import stages

logger = logging.getLogger(__name__)


class HybridParallelStages(stages.Stages):
    """The stages of :class:`~chainerkfac.optimizers.KFAC` under MPI.

    Every rank collects statistics for every block; each block is refreshed
    by its owner only, which alone stores its factors and inverses (so a
    snapshot holds the state of one rank's blocks: save and resume one
    snapshot per rank, with the same number of ranks).

    A block is preconditioned by its owner, or, when the assignment splits
    it (``max_load_imbalance``), by several ranks, each computing rows or
    columns of ``G⁻¹ ∇W̄ A⁻¹`` with what the owner sends them
    (:mod:`chainerkfac.distributed.split`).

    Optimizer hooks run between stages 3 and 4, on the reduced gradients of
    the blocks a rank preconditions: per-parameter hooks (``WeightDecay``,
    ``Lasso``) act exactly as in one process; a hook that needs every
    gradient at once (``GradientClipping``) is rejected with an error.

    ``communicator`` comes from :func:`~chainerkfac.create_communicator`;
    ``max_load_imbalance`` (splitting large blocks over ranks) and
    ``arrival_deadline`` (seconds the ranks wait for each other in a
    collective of the step) are on the options page (``docs/options.md``).
    """

    def __init__(self, communicator, max_load_imbalance=1.1,
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
        self.comm = communicator
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
        if not any(p.array is not None for p in self._uninitialised):
            return False
        self._broadcast_parameters(optimizer)
        return True

    def abandon(self, error):
        """A rank that exits (``sys.exit``) or is interrupted in the middle
        of a step aborts the job: the others wait in the step's
        collectives, and the global except hook sees neither."""
        if not isinstance(error, Exception):
            global_except_hook.abort(
                '{} in the middle of K-FAC iteration {}'.format(
                    type(error).__name__, self._iteration))

    def rank_and_size(self):
        return self.comm.rank, self.comm.size

    def prepare(self, optimizer):
        self.comm.stage_timer = optimizer.stage_timer
        self._iteration = optimizer.t + 1
        self.comm.watch.deadline = self.arrival_deadline
        self.comm.watch.step = 'K-FAC iteration {}'.format(self._iteration)
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
        self._layout = buffers.Layout(self.assignment, self.split.splits)
        if self.comm.rank == 0:
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
        if self.assignment is None:
            self._assign(optimizer)
        blocks = optimizer.blocks
        grads = [block.gradient() for block in blocks]
        # Timed as statistics on steps that carry some (stale steps pack
        # gradients only, which is the all-gather's counterpart).
        folding = optimizer.timing('statistics_fold') if any(
            b.has_pending_statistics() for b in blocks) else \
            contextlib.nullcontext()
        with folding:
            parts, sizes = self._layout.pack_reduce(blocks, grads)
        xp = backend.get_array_module(grads[0])
        # One transport scale per gradient and per factor.
        groups = numpy.cumsum([0] + [flat.size for flat in parts[:-1]])
        mine = self.comm.reduce_scatter_v(
            xp.concatenate(parts), self.assignment.segment_counts(sizes),
            groups)
        mine /= self.comm.size
        # What every rank keeps whole: gradients of parameters outside the
        # blocks (momentum SGD on every rank) and BatchNorm running means
        # and variances. Averaging these every step equals averaging them
        # before evaluation or a snapshot (their update is linear), and
        # keeps the replicas identical.
        replicated = [p.grad for p in self._other_params
                      if p.grad is not None]
        for link in self._running_statistics:
            replicated += [link.avg_mean, link.avg_var]
        buffers.average_replicated(self.comm, replicated)
        return self._layout.unpack_reduce(blocks, mine, self.split.parts)

    def agree(self, ok):
        with timing.timed(self.comm.stage_timer,
                          'communication_control'):
            return bool(self.comm.control_sum([not ok])[0] == 0)

    # -- stages 4-6 -----------------------------------------------------------

    def placement(self, blocks):
        """``'rank R'`` per block (with the ranks a split block's
        preconditioning is shared with); before the first update, which
        places the blocks once their shapes are known, says so."""
        if self.assignment is None:
            return ['rank set at the first update'] * len(blocks)
        return ['rank {}'.format(owner) if len(ranks) == 1 else
                'rank {}, preconditioned by ranks {}'.format(
                    owner, ', '.join(map(str, ranks)))
                for owner, ranks in zip(self.assignment.owners,
                                        self.assignment.shards)]

    def owned(self, blocks):
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
                return None, stages.precondition(block, weight_decay)
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
        local = stages.stack([terms for _, terms in rows])
        xp = backend.get_array_module(local)
        everyone = xp.zeros((len(blocks), step_rule.N_TERMS),
                            dtype=local.dtype)
        if rows:
            everyone[[i for i, _ in rows]] = local
        return everyone

    def gather(self, optimizer, terms, samples):
        """All-gathers the preconditioned gradients, with the intervals
        the owners' schedules adapted to after refreshing factors, each
        rank's terms (the step rule's sums of the parts it computed,
        :mod:`chainerkfac.step_rule`, then its batch size), which every
        rank adds up in rank order, and a digest of its options
        (:func:`~chainerkfac.distributed.consistency.options_digest`): an
        option changed on some ranks only after setup stops every rank
        here, naming it.

        Every rank, the owner too, takes the owners' intervals as received
        (not the change rates: a rate rounded on the way could fall on the
        other side of an adaptive schedule's threshold), and the gradients
        too where a ``transport_dtype`` rounds them (float16 holds integers
        exactly up to 2048 only): the replicas and their refresh schedules
        agree."""
        blocks = optimizer.blocks
        layout = self._layout
        refreshed = {i: layout.refreshed_factors(i)
                     for i in range(len(blocks))}
        places, groups, slots, by_rank = layout.gather(step_rule.N_TERMS, 2)
        parts = []
        splits = self.split.splits
        mine = sorted(self.split.parts.items())
        for i, s in mine:
            block = blocks[i]
            if i in splits:
                piece = self._part_results.get(i)
            else:
                piece = block.gradient()
            if piece is not None:
                parts.append(piece.ravel())
            if s == 0:
                parts.append(numpy.asarray(
                    [block.schedules[f].interval or 0 for f in refreshed[i]]))
        grad0 = next(p.grad for block in blocks for p in block.params()
                     if p.grad is not None)
        xp = backend.get_array_module(grad0)
        # The preconditioned gradients and the step's terms of a float16
        # model are float32, as computed (a transport_dtype narrows them).
        dtype = linalg.working_dtype(grad0.dtype)
        parts.append(xp.asarray(terms[[i for i, _ in mine]],
                                dtype=dtype).ravel())
        parts.append(xp.asarray([samples, consistency.options_digest(
            optimizer)]))
        parts = [xp.asarray(p, dtype=dtype) for p in parts]
        counts = numpy.diff([0] + [int(sl[-1]) + 1 for sl in slots]).tolist()
        everything = self.comm.all_gather_v(xp.concatenate(parts), counts,
                                            groups)
        chainer.report({'kfac/bytes/' + name: value for name, value
                        in self.comm.reset_bytes_moved().items()})
        values = backend.CpuDevice().send(
            everything[numpy.concatenate(slots)]).astype(numpy.float64)
        totals = numpy.zeros((len(blocks), step_rule.N_TERMS))
        sizes, digests, offset = [], [], 0
        for items, rank_slots in zip(by_rank, slots):
            segment = values[offset:offset + len(rank_slots)]
            offset += len(rank_slots)
            rows = segment[:-2].reshape(-1, step_rule.N_TERMS)
            for (i, _), row in zip(items, rows):
                totals[i] += row
            sizes.append(int(segment[-2]))
            digests.append(segment[-1])
        if len(set(digests)) > 1:
            self._check_options(optimizer)
        consistency.check_equal_batches(sizes, optimizer.t)
        step = optimizer.t
        assembled = {i: xp.empty(layout.shapes[i], dtype=dtype)
                     for i in splits}
        # Without a transport_dtype an owner's gradients come back as it
        # sent them: only a rounding transport makes it take the copy.
        rounded = self.comm.get_config('transport_dtype') is not None
        for (i, s), offset in places.items():
            n_grad = layout.part_size(i, s)
            piece = everything[offset:offset + n_grad]
            if i in assembled:
                target = splits[i].part_of(assembled[i], s)
                target[...] = piece.reshape(target.shape)
            elif rounded or self.assignment.owners[i] != self.comm.rank:
                blocks[i].set_gradient(piece.reshape(layout.shapes[i]))
            if s == 0:
                intervals = everything[offset + n_grad:offset + n_grad
                                       + len(refreshed[i])]
                for f, interval in zip(refreshed[i], intervals.tolist()):
                    blocks[i].schedules[f].follow(step, interval)
        for i, grad in assembled.items():
            blocks[i].set_gradient(grad)
        return totals, float(sum(sizes))
