"""Hybrid data/model-parallel K-FAC (Osawa et al. CVPR 2019, §3.3, Fig. 1).

One step on every rank::

    1-2  data parallel   forward/backward on the local batch; the hooks build
                         the local statistics of every block that is due
    3    reduce-scatter  each block's gradient (and, on refresh steps, its
                         packed statistics) is summed onto the block's owner;
                         gradients of other parameters are allreduced
    4-5  model parallel  owners fold statistics, refresh due inverses and
                         precondition their blocks' gradients
    6    all-gather      the preconditioned gradients (and the factors'
                         change rates, which adaptive intervals need) reach
                         every rank; every rank applies the same update

On a stale step only gradients travel: a reduce-scatter plus an all-gather,
the volume of the allreduce of data-parallel SGD. Symmetric factors travel
as their upper triangle (§3.4). Owners come from a cost model
(:func:`chainerkfac.distributed.assign_blocks`), not from a count.
"""
import logging

import chainer
import chainer.links as L
import chainermn
import numpy
from chainer import backend

from chainerkfac import linalg
from chainerkfac.distributed import assignment as assignment_module
from chainerkfac.distributed import communicator as communicator_module
from chainerkfac.optimizers import kfac

logger = logging.getLogger(__name__)


def _pack(stat):
    return linalg.pack_symmetric(stat) if stat.ndim == 2 else stat.ravel()


class HybridParallelStages(kfac.LocalStages):
    """The stages of :class:`~chainerkfac.optimizers.KFAC` under MPI.

    Every rank collects statistics for every block; each block is refreshed
    and preconditioned by its owner only, which alone stores its factors and
    inverses (so a snapshot holds the state of one rank's blocks: save and
    resume one snapshot per rank, with the same number of ranks).

    Optimizer hooks run between stages 3 and 4, on the reduced gradients of
    the blocks a rank owns: per-parameter hooks (``WeightDecay``, ``Lasso``)
    act exactly as in one process; a hook that needs every gradient at once
    (``GradientClipping``) is rejected with an error.
    """

    def __init__(self, communicator):
        self.comm = communicator
        self.assignment = None
        self._needs_broadcast = True
        self._layout = None

    # -- set-up -----------------------------------------------------------

    def setup(self, optimizer):
        communicator_module.check_same_structure(self.comm, optimizer.target)
        self._broadcast_parameters(optimizer)

    def _broadcast_parameters(self, optimizer):
        # Every rank starts from rank 0's parameters; lazily initialised
        # ones are broadcast once they exist, before their first update.
        params = list(optimizer.target.params(include_uninit=True))
        self.comm.bcast_data(optimizer.target)
        self._needs_broadcast = any(p.array is None for p in params)

    def prepare(self, optimizer):
        if self._needs_broadcast:
            self._broadcast_parameters(optimizer)
        # Chainer keeps hooks in a private registry; reading it is the only
        # way to reject a whole-model hook before it sees partial gradients.
        pre_hooks = optimizer._hookable._pre_update_hooks
        for name, hook in pre_hooks.items():
            if not getattr(hook, 'call_for_each_param', False):
                raise ValueError(
                    'optimizer hook {!r} needs every gradient at once, which '
                    'distributed K-FAC does not gather before '
                    'preconditioning; use per-parameter hooks such as '
                    'WeightDecay or Lasso'.format(name))

    # -- stage 3 ------------------------------------------------------------

    def _assign(self, optimizer):
        # Only owners keep a block's factors, so the placement must come out
        # the same when a run resumes: it follows the intervals of a fresh
        # run's first iteration, which the options alone decide.
        self.assignment = assignment_module.assign_blocks(
            [assignment_module.BlockCost(b.name, *b.assignment_cost())
             for b in optimizer.blocks], self.comm.size,
            [1 / b.inverse_reuse() for b in optimizer.blocks])
        if self.comm.rank == 0:
            logger.info('K-FAC blocks on %d ranks: load imbalance (max/mean) '
                        '%.2f, idle ranks %s', self.comm.size,
                        self.assignment.load_imbalance,
                        list(self.assignment.idle_ranks))
        covered = {id(p) for b in optimizer.blocks for p in b.params()}
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
        # layout[i]: (key, shape, size) of what block i sends, gradient first.
        parts, layout = [], {}
        for i in self.assignment.buffer_order():
            block = blocks[i]
            grad = block.gradient()
            stats = block.take_statistics(block.params()[0]._loss_scale)
            entries = [('grad', grad.shape, grad.ravel())]
            entries += [(f, stats[f].shape, _pack(stats[f]))
                        for f in block.factors if f in stats]
            layout[i] = [(key, shape, flat.size)
                         for key, shape, flat in entries]
            parts += [flat for _, _, flat in entries]
        sizes = [sum(size for _, _, size in layout[i])
                 for i in range(len(blocks))]
        xp = backend.get_array_module(parts[0])
        counts = self.assignment.segment_counts(sizes)
        mine = self.comm.reduce_scatter_v(xp.concatenate(parts), counts)
        mine /= self.comm.size
        self._layout = layout
        self._allreduce_replicated_state()

        stats_of_owned = {}
        offset = 0
        for i in self.assignment.blocks_of(self.comm.rank):
            block = blocks[i]
            stats = {}
            for key, shape, size in layout[i]:
                flat = mine[offset:offset + size]
                offset += size
                if key == 'grad':
                    block.set_gradient(flat.reshape(shape))
                elif len(shape) == 2:
                    stats[key] = linalg.unpack_symmetric(flat, shape[0])
                else:
                    stats[key] = flat.reshape(shape)
            if stats:
                stats_of_owned[block] = stats
        return stats_of_owned

    def _allreduce_replicated_state(self):
        """Averages what every rank keeps a full copy of, in one allreduce.

        Gradients of parameters outside the blocks (momentum SGD on every
        rank), and BatchNorm running means and variances: averaging these
        every step equals averaging them before evaluation or a snapshot
        (their update is linear), and keeps the replicas identical.
        """
        arrays = [p.grad for p in self._other_params if p.grad is not None]
        for link in self._running_statistics:
            arrays += [link.avg_mean, link.avg_var]
        if not arrays:
            return
        xp = backend.get_array_module(arrays[0])
        flat = xp.concatenate([a.ravel().astype(arrays[0].dtype, copy=False)
                               for a in arrays])
        self.comm.allreduce_mean(flat)
        offset = 0
        for a in arrays:
            a[...] = flat[offset:offset + a.size].reshape(a.shape)
            offset += a.size

    def agree(self, ok):
        return bool(self.comm.allreduce_obj(int(not ok)) == 0)

    # -- stages 4-6 -----------------------------------------------------------

    def owned(self, blocks):
        mine = set(self.assignment.blocks_of(self.comm.rank))
        return [b for i, b in enumerate(blocks) if i in mine]

    def gather(self, optimizer, rates):
        blocks = optimizer.blocks
        refreshed = {i: [key for key, _, _ in self._layout[i] if key != 'grad']
                     for i in range(len(blocks))}
        # Per block: its gradient, then one change rate per refreshed factor.
        sizes = [self._layout[i][0][2] + len(refreshed[i])
                 for i in range(len(blocks))]
        parts = []
        for i in self.assignment.blocks_of(self.comm.rank):
            block = blocks[i]
            grad = block.gradient()
            xp = backend.get_array_module(grad)
            block_rates = rates.get(block, {})
            measured = [block_rates.get(f) for f in refreshed[i]]
            parts.append(grad.ravel())
            parts.append(xp.asarray(
                [numpy.nan if r is None else r for r in measured],
                dtype=grad.dtype))
        grad0 = blocks[0].params()[0].grad
        xp = backend.get_array_module(grad0)
        send = xp.concatenate(parts) if parts else xp.empty(0, grad0.dtype)
        everything = self.comm.all_gather_v(
            send, self.assignment.segment_counts(sizes))
        chainer.report({'kfac/bytes/' + name: value for name, value
                        in self.comm.reset_bytes_moved().items()})
        mine = set(self.assignment.blocks_of(self.comm.rank))
        step = optimizer.t
        offset = 0
        for i in self.assignment.buffer_order():
            shape = self._layout[i][0][1]
            n_grad = self._layout[i][0][2]
            grad = everything[offset:offset + n_grad]
            offset += n_grad
            measured = everything[offset:offset + len(refreshed[i])]
            offset += len(refreshed[i])
            if i in mine:
                continue
            blocks[i].set_gradient(grad.reshape(shape))
            for f, r in zip(refreshed[i], measured.tolist()):
                blocks[i].schedules[f].mark(
                    step, None if numpy.isnan(r) else r)


def create_multi_node_optimizer(actual_optimizer, communicator):
    """Makes an optimizer distributed, as ChainerMN's function of that name.

    For :class:`~chainerkfac.optimizers.KFAC` the optimizer itself is
    returned, now running the hybrid-parallel stages of
    :class:`HybridParallelStages` over ``communicator``; other optimizers are
    wrapped by :func:`chainermn.create_multi_node_optimizer` (data-parallel
    gradient averaging).
    """
    if isinstance(actual_optimizer, kfac.KFAC):
        actual_optimizer.use_stages(HybridParallelStages(communicator))
        return actual_optimizer
    return chainermn.create_multi_node_optimizer(actual_optimizer,
                                                 communicator)
