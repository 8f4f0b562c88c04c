"""Checks that every rank runs the same model with the same options.

Ranks that disagree would pack buffers of different layouts, or call
collectives at different steps, and either hang, crash in MPI with an error
that names nothing ("Message truncated"), or train silently on different
trajectories. Each check at set-up is one object all-gather (nothing at
size 1) and raises the same ``ValueError`` on every rank, naming the first
item that differs and which ranks hold which version of it; at every update
the ranks check that they start the same iteration and feed equal batches.
"""
import zlib

import numpy

from chainerkfac import timing


def check_same(comm, items, subject, what):
    """Raises ``ValueError`` on every rank unless all ranks pass the same
    ``items``, a list of ``(name, description)`` pairs; the message says
    ``SUBJECT differs between ranks, first at WHAT 'NAME'``."""
    if comm.size == 1:
        return
    everyone = comm.mpi_comm.allgather(list(items))
    if all(theirs == everyone[0] for theirs in everyone[1:]):
        return
    per_rank = [dict(theirs) for theirs in everyone]
    order = [name for theirs in everyone for name, _ in theirs]
    for name in dict.fromkeys(order):
        versions = {}
        for rank, described in enumerate(per_rank):
            versions.setdefault(described.get(name, 'missing'),
                                []).append(rank)
        if len(versions) > 1:
            raise ValueError(
                '{} differs between ranks, first at {} {!r}: {}'.format(
                    subject, what, name, '; '.join(
                        '{} on rank{} {}'.format(
                            version, 's' if len(ranks) > 1 else '',
                            ', '.join(map(str, ranks)))
                        for version, ranks in versions.items())))
    raise ValueError('the {}s are in a different order on some ranks: {}'
                     .format(what, '; '.join(
                         'rank {}: {}'.format(rank, ', '.join(
                             name for name, _ in theirs))
                         for rank, theirs in enumerate(everyone))))


def check_same_structure(comm, link):
    """Raises ``ValueError`` on every rank unless all ranks hold the same
    parameters: the name, shape and dtype of every parameter of ``link``,
    in name order."""
    check_same(comm, [(name, _describe(param))
                      for name, param in sorted(link.namedparams())],
               'the model', 'parameter')


def check_same_options(comm, optimizer, extra=()):
    """Raises ``ValueError`` on every rank unless all ranks built the
    optimizer with the same options and hyperparameters
    (:meth:`chainerkfac.optimizers.KFAC.option_values`), the same K-FAC
    links in the same order, and the same ``extra`` ``(name, text)``
    options of the caller."""
    items = list(optimizer.option_values().items()) + list(extra)
    items.append(('K-FAC links', ', '.join(b.name for b in optimizer.blocks)))
    check_same(comm, items, 'KFAC', 'option')


def options_digest(optimizer):
    """A number in ``[0, 2039)`` that differs, but for one chance in 2039,
    between processes whose options or hyperparameters differ. It rides the
    all-gather of every step, so a value changed on some ranks only (an
    extension that only rank 0 runs) is found within a step; a float16
    buffer holds the integers below 2048 exactly."""
    text = repr(sorted(optimizer.option_values().items()))
    return zlib.crc32(text.encode()) % 2039


def _describe(param):
    if param.array is None:
        return 'uninitialized'
    return 'shape {} {}'.format(tuple(param.shape), param.dtype)


def check_same_step(comm, optimizer, deadline):
    """Every rank starts the update within ``deadline`` seconds (the
    communicator's watch names the others), at the same iteration, and
    each resuming from a snapshot or none: a rank that left its loop, or a
    snapshot loaded on some ranks only, would leave the others waiting in
    a collective for ever. One non-blocking allreduce of three numbers an
    update, ``[t, t², resuming]``, whose sums are ``P`` times the local
    ones exactly when every rank's are the same (``Σ (t_r − t)² = 0``;
    exact in float64 up to ``t`` of about 10⁶ at 1,024 ranks); otherwise
    the rendezvous (:meth:`KfacCommunicatorMixin.arrive
    <chainerkfac.distributed.KfacCommunicatorMixin.arrive>`) gathers each
    rank's and every rank raises ``ValueError`` naming them."""
    t, resuming = optimizer.t, int(optimizer.resuming)
    local = numpy.array([t, t * t, resuming], dtype=numpy.float64)
    with timing.timed(comm.stage_timer, 'communication_control'):
        sums = comm.control_sum(local, at_start=True)
        if (sums == comm.size * local).all():
            return
        states = comm.arrive((optimizer.t, optimizer.resuming), deadline,
                             'K-FAC iteration {}'.format(optimizer.t + 1))
    loaded = [rank for rank, (_, resuming) in enumerate(states) if resuming]
    raise ValueError(
        'the ranks are at different iterations or not all resume a '
        'snapshot: {}. Every rank loads its own snapshot files '
        '(chainerkfac.snapshot_files) before the next update{}'.format(
            ', '.join('rank {} at iteration {}{}'.format(
                rank, t, ', snapshot loaded' if resuming else '')
                for rank, (t, resuming) in enumerate(states)),
            '' if not loaded else ' (loaded on rank(s) {} only)'.format(
                ', '.join(map(str, loaded)))))


def check_equal_batches(sizes, step):
    """Raises ``ValueError`` naming each rank's batch where the ranks fed
    batches of different sizes (``sizes``, in rank order) at iteration
    ``step``: the gradients and statistics are averaged over ranks with
    equal weights, which would count each sample of a smaller batch more
    than one process on the same samples does. (A rank whose forward
    passes were not counted, 0, is left alone.)"""
    if min(sizes) > 0 and len(set(sizes)) > 1:
        raise ValueError(
            'the ranks fed batches of different sizes at iteration {} ({}): '
            'distributed K-FAC averages the ranks with equal weights, '
            'which equals one process on the same samples only when every '
            'rank has as many; give every rank the same batch size '
            '(chainermn.scatter_dataset shards of equal length, a '
            'repeating iterator)'.format(step, ', '.join(
                'rank {}: {}'.format(rank, n)
                for rank, n in enumerate(sizes))))
