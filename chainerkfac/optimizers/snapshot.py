"""The header of a snapshot's K-FAC state, and the checks of it.

Each process keeps the curvature of the layers it owns, so a snapshot
resumes only on as many processes, each loading its own file, with the
same inverse form, BatchNorm Fisher and K-FAC layers. The header says so,
and loading names what differs (``ValueError``).
"""
import itertools


def header(rank, size, inverse, bn_fisher, blocks):
    """The header of this process's K-FAC state."""
    return {'rank': rank, 'world_size': size, 'inverse': inverse,
            'bn_fisher': bn_fisher,
            'layers': '; '.join('{}: {}'.format(b.name, b.describe())
                                for b in blocks)}


def check_header(state, mine, blocks):
    """Checks a snapshot's header (in ``state``) against this run's
    (``mine``, from :func:`header`); False when the snapshot has no K-FAC
    state at all."""
    try:
        saved = {key: state['header'](key, value)
                 for key, value in mine.items()}
    except KeyError:
        # No header: a snapshot written before headers existed (its
        # blocks load as they are) or one without K-FAC state.
        return not blocks or blocks[0].in_snapshot(
            state[blocks[0].name])
    if (saved['world_size'], saved['rank']) != (
            mine['world_size'], mine['rank']):
        raise ValueError(
            'snapshot written by rank {} of {} process(es), loaded by '
            'rank {} of {}: each process keeps the curvature of the '
            'layers it owns, so resume on {} process(es), each loading '
            'its own file (.rank<R>)'.format(
                saved['rank'], saved['world_size'], mine['rank'],
                mine['world_size'], saved['world_size']))
    for option in ('inverse', 'bn_fisher'):
        if saved[option] != mine[option]:
            raise ValueError(
                'snapshot written with KFAC {}={!r}, this run has {!r}'
                .format(option, saved[option], mine[option]))
    entries = saved['layers'].split('; ') if saved['layers'] else []
    for block, entry in itertools.zip_longest(blocks, entries):
        name, _, described = (entry or '').partition(': ')
        # A lazily initialised layer has no shapes yet (the Trainer
        # loads the optimizer before the model): its name must agree.
        shaped = block is not None and all(
            p.array is not None for p in block.params())
        if block is None or name != block.name or (
                shaped and described != block.describe()):
            raise ValueError(
                'snapshot and model differ in their K-FAC layers, '
                'first: {!r} in the snapshot, {!r} in this model'.format(
                    entry, block and '{}: {}'.format(
                        block.name, block.describe())))
    return True
