"""The K-FAC part of a snapshot: its header, the checks of it, and resuming
on another number of processes.

Each process keeps the curvature of the layers it owns, so each writes its
own file, whose header names the process (rank and number of processes),
the inverse form, the BatchNorm Fisher, every K-FAC layer with its factor
shapes, and the layers whose curvature the file holds. Loading checks the
header and names what differs (``ValueError``). The header also names the
step rule; a snapshot taken under another one resumes under this run's,
which is said (:func:`serialize_step_rule`).

On as many processes, each loads its own file. On another number (a job
resized between allocations, or one process), each process loads the files
:func:`files` gives it: together they hold every layer's curvature once;
the first update then moves each layer's factors, inverse and schedules to
its owner in the new placement (:class:`Resume`).
"""
import contextlib
import glob
import itertools
import logging
import os
import re
import typing
import zipfile
import zlib

import chainer
import numpy
from chainer import serializers

logger = logging.getLogger(__name__)


#: The version of what a snapshot holds. Loading refuses any other by
#: name: 1 (unnumbered) stored every inverse's arrays; 2 stores the kind
#: and damping of an inverse built from the factors as they are, which
#: loading rebuilds from them; 3 drops the state of the step rules,
#: bounds and backtracking that are no longer.
FORMAT = 3


def header(rank, size, inverse, bn_fisher, blocks):
    """The header of this process's K-FAC state."""
    return {'format': FORMAT, 'rank': rank, 'world_size': size,
            'inverse': inverse,
            'bn_fisher': bn_fisher,
            'layers': '; '.join('{}: {}'.format(b.name, b.describe())
                                for b in blocks)}


def held(blocks):
    """The header entry naming the layers whose curvature a file holds."""
    return '; '.join(b.name for b in blocks if b.holds_curvature())


class Resume:
    """Snapshot files of ``saved_size`` processes loaded since the last
    update: which files (their ranks) this process loaded, and the layers
    whose curvature it took from them (:attr:`held`), until the first
    update moves each to its owner in this run's placement
    (:meth:`Stages.redistribute
    <chainerkfac.optimizers.stages.Stages.redistribute>`), which on as
    many processes is usually where it already is."""

    def __init__(self, saved_size):
        self.saved_size = saved_size
        self.loaded = set()
        self.held = set()

    def add(self, saved_rank, saved_size, names):
        if saved_size != self.saved_size:
            raise ValueError(
                'snapshot files of {} and of {} processes loaded into one '
                'optimizer: load the files of one snapshot'.format(
                    self.saved_size, saved_size))
        self.loaded.add(saved_rank)
        self.held.update(names)

    def check_complete(self, loaded):
        """Raises ``ValueError`` unless the ranks in ``loaded`` (the files
        every process loaded) cover the snapshot's processes."""
        missing = sorted(set(range(self.saved_size)) - set(loaded))
        if missing:
            raise ValueError(
                'snapshot written by {} processes resumed on another number,'
                ' but no process loaded the file(s) of rank(s) {}, which '
                'hold the curvature of the layers those ranks owned: load '
                'the files chainerkfac.snapshot_files() gives each '
                'process'.format(self.saved_size,
                                 ', '.join(map(str, missing))))


class Writer(typing.NamedTuple):
    """The process that wrote a snapshot file."""

    rank: int
    size: int
    #: The layers whose curvature the file holds, when written by another
    #: number of processes; ``None``: every layer loads, as saved.
    held: typing.Optional[set]


def check_header(state, mine, blocks):
    """Checks a snapshot's header (in ``state``) against this run's
    (``mine``, from :func:`header`).

    Returns ``None`` when the snapshot has no K-FAC state at all
    (another optimizer's), else the :class:`Writer` of the file. A
    snapshot of another :data:`FORMAT` is refused, naming it.
    """
    try:
        saved_format = int(state['header']('format', 0))
    except KeyError:
        saved_format = None
    if saved_format is None:
        try:
            state['header']('rank', 0)
        except KeyError:
            if not blocks or not blocks[0].in_snapshot(
                    state[blocks[0].name]):
                return None
        saved_format = 1
    if saved_format != FORMAT:
        raise ValueError(
            'snapshot of K-FAC state format {}, written by an earlier '
            'version of chainerkfac; this version reads format {} only: '
            'resume with the version that wrote it, or start the '
            'curvature afresh (load the model and a MomentumSGD '
            'snapshot)'.format(saved_format, FORMAT))
    saved = {key: state['header'](key, value) for key, value in mine.items()}
    _check_layers(saved, mine, blocks)
    saved_rank, saved_size = int(saved['rank']), int(saved['world_size'])
    if saved_size == mine['world_size']:
        if saved_rank != mine['rank']:
            raise ValueError(
                'snapshot written by rank {} of {} process(es), loaded by '
                'rank {} of {}: on as many processes each loads its own '
                'file (.rank<R>)'.format(saved_rank, saved_size,
                                         mine['rank'], mine['world_size']))
        return Writer(saved_rank, saved_size, None)
    names = str(state['header']('held', ''))
    return Writer(saved_rank, saved_size, set(names.split('; ')) - {''})


def serialize(serializer, optimizer, momentum, resume, parts):
    """Saves or loads a set-up ``optimizer``'s K-FAC state with
    ``serializer``: the header (rank, process count, inverse form, layers
    and factor shapes), which loading checks, naming what differs;
    ``momentum()``, which serializes the update rules; each of ``parts``
    (``{name: serialize(serializer)}``); the step rule; and the curvature
    of every block the file holds (the schedules of the others). Each
    process keeps the layers it owns; another process count loads the
    files :func:`files` gives it. A MomentumSGD snapshot loads the momentum
    and step count; the curvature then starts afresh. Returns the
    :class:`Resume` of the files loaded since the last update (``resume``,
    the one before, or ``None``)."""
    if getattr(optimizer, 'target', None) is None:
        raise RuntimeError('KFAC saved or loaded before setup(): call '
                           'optimizer.setup(model) first (setup creates '
                           'the state a snapshot holds)')
    state = serializer['kfac']
    loading = isinstance(serializer, chainer.serializer.Deserializer)
    blocks = optimizer.blocks
    rank, size = optimizer.stages.rank_and_size()
    mine = header(rank, size, optimizer.inverse, optimizer.bn_fisher,
                  blocks)
    found = check_header(state, mine, blocks) if loading else None
    if not loading:
        for key, value in mine.items():
            state['header'](key, value)
        state['header']('held', held(blocks))
    momentum()
    if loading and found is None:
        logger.warning('the snapshot holds no K-FAC state (another '
                       "optimizer's?): momentum and step count loaded, "
                       'the curvature starts afresh')
        return resume
    for name, part in parts.items():
        part(state[name])
    serialize_step_rule(state, optimizer.step_rule, optimizer.damping,
                        loading)
    names = {block.name for block in blocks}
    if found is not None:
        names = names if found.held is None else found.held
        if resume is None:
            resume = Resume(found.size)
        resume.add(found.rank, found.size, names)
    for block in blocks:
        if block.name in names:
            block.serialize(state[block.name])
        else:
            block.serialize_schedules(state[block.name])
    return resume


def serialize_step_rule(state, rule, damping, loading):
    """Saves or loads the state of ``rule``, the optimizer's
    :class:`~chainerkfac.step_rule.StepRule` (only a rule that chooses the
    whole update keeps any, under ``adaptive``, with the ``damping`` it
    chose), and its name in the header. Loading a snapshot that names
    another rule is said: the run goes on under ``rule``, whose state
    starts afresh where the snapshot holds none of it."""
    if rule.chooses_update:
        rule.serialize(state['adaptive'], damping)
    name = str(rule.name or type(rule).__name__)
    if not loading:
        state['header']('step_rule', name)
        return
    saved = str(state['header']('step_rule', ''))
    if saved != name:
        logger.warning(
            'the snapshot was taken under step_rule=%r; this run resumes it '
            "under step_rule=%r (pass step_rule= to KFAC to keep the "
            "snapshot's)", saved, name)


def _check_layers(saved, mine, blocks):
    for option in ('inverse', 'bn_fisher'):
        if saved[option] != mine[option]:
            raise ValueError(
                'snapshot written with KFAC {}={!r}, this run has {!r}'
                .format(option, saved[option], mine[option]))
    entries = saved['layers'].split('; ') if saved['layers'] else []
    for block, entry in itertools.zip_longest(blocks, entries):
        name, _, described = (entry or '').partition(': ')
        # A lazily initialised layer has no shapes yet (the Trainer
        # loads the optimizer before the model), nor a doubly-factored one
        # its layout before its first input: its name must agree, and its
        # kind, the description's first word (K-FAC, doubly-factored, BN).
        if block is None or name != block.name or (
                described != block.describe() if block.shapes_known()
                else described.split(' ')[0] !=
                block.describe().split(' ')[0]):
            raise ValueError(
                'snapshot and model differ in their K-FAC layers, '
                'first: {!r} in the snapshot, {!r} in this model'.format(
                    entry, block and '{}: {}'.format(
                        block.name, block.describe())))


def _rank_files(stem):
    """``{rank: path}`` of every file of the snapshot ``stem`` (its
    ``.rank<R>`` and ``.npz`` suffixes stripped), checked complete."""
    stem = re.sub(r'(\.rank\d+)?(\.npz)?$', '', stem)
    pattern = re.compile(re.escape(stem) + r'\.rank(\d+)(\.npz)?$')
    found = {}
    for path in sorted(glob.glob(glob.escape(stem) + '.rank*')):
        match = pattern.match(path)
        if match:
            found.setdefault(int(match.group(1)), path)
    if not found:
        single = [path for path in (stem + '.npz', stem)
                  if os.path.isfile(path)]
        if not single:
            raise ValueError('no snapshot files {0}.rank<R>[.npz] or '
                             '{0}[.npz]'.format(stem))
        found = {0: single[0]}
    saved_size = max(_saved_size(found[min(found)]), max(found) + 1)
    missing = sorted(set(range(saved_size)) - set(found))
    if missing:
        raise ValueError('snapshot {} lacks the files of rank(s) {}'.format(
            stem, ', '.join(map(str, missing))))
    return found


def files(stem, rank, size):
    """The files of the snapshot ``stem`` (``STEM.rank<R>[.npz]``, or
    ``STEM[.npz]`` from one process; ``stem`` may name any of its files)
    that process ``rank`` of ``size`` loads, the first whole and the others
    into its optimizer only.

    On as many processes as wrote it, its own file. On another number, the
    files of the ranks ``r`` with ``r % size == rank``, so that the
    processes load every file once; a process left without one (more
    processes than files) loads file ``rank % saved_size`` for the state
    every process shares (the model, the momentum), and no curvature of
    its own. Raises ``ValueError`` naming the stem when files are missing.
    """
    return _files_of(_rank_files(stem), rank, size)


def _files_of(found, rank, size):
    saved_size = len(found)
    if saved_size == size:
        return [found[rank]]
    mine = [found[r] for r in range(saved_size) if r % size == rank]
    return mine or [found[rank % saved_size]]


def load(stem, target, optimizer, comm=None, path=''):
    """Resumes a ``Trainer`` snapshot ``stem`` (of as many processes or of
    another number) on this process of ``comm`` (``None``: one process), as
    ``chainer.serializers.load_npz(file, target)`` would from one file:
    the first of :func:`files` into ``target`` (the trainer, or an object
    that serializes it under ``path``, e.g. ``'trainer/'``), the others
    into ``optimizer``, the trainer's main optimizer. On another number of
    processes the training iterator's place in its epoch, which belonged
    to a shard of another size, is left out: each process starts its
    epoch over its new shard (the epoch count loads). Returns whether the
    number of processes changed."""
    found = _rank_files(stem)
    rank, size = (0, 1) if comm is None else (comm.rank, comm.size)
    paths = _files_of(found, rank, size)
    resized = len(found) != size
    iterator = path + 'updater/iterator:main/'
    with _reading(paths[0]):
        serializers.load_npz(paths[0], target, ignore_names=[
            iterator + 'order', iterator + 'current_position'] if resized
            else None)
    for other in paths[1:]:
        with _reading(other):
            serializers.load_npz(other, optimizer,
                                 path=path + 'updater/optimizer:main/')
    return resized


@contextlib.contextmanager
def _reading(path):
    """Names ``path`` in the error of a file that is not a whole ``.npz``
    (empty, truncated, corrupt), which NumPy's and zlib's errors do not."""
    try:
        yield
    except (zipfile.BadZipFile, EOFError, zlib.error) as e:
        raise ValueError('cannot read snapshot file {} (empty, truncated or '
                         'corrupt?): {}: {}'.format(path, type(e).__name__,
                                                    e)) from e


def _saved_size(path):
    """The number of processes the K-FAC header of the file at ``path``
    names (0 without one)."""
    with _reading(path), numpy.load(path) as state:
        keys = [key for key in state.files
                if key.endswith('kfac/header/world_size')]
        return int(state[keys[0]]) if keys else 0


def redistribute(comm, assignment, split_blocks, blocks, resume):
    """Checks that the processes together loaded every file of
    ``resume`` (a :class:`Resume`), then moves every block's curvature
    from the process that loaded it to its owner in ``assignment``, over
    communicator ``comm``, one object message per moved block, in block
    order on every rank. On as many processes it is usually where it was
    saved; a lazily initialised layer that got its shape after the
    snapshot's placement can move blocks. Processes that loaded a block
    they do not own drop it, and the owner of a block that
    ``split_blocks`` (:class:`~chainerkfac.distributed.split.SplitBlocks`)
    splits holds its inverse in the kind the split needs
    (:meth:`Split.adopt <chainerkfac.distributed.split.Split.adopt>`)."""
    mine = [i for i, block in enumerate(blocks)
            if block.name in resume.held and block.holds_curvature()]
    everyone = comm.bcast_obj(comm.gather_obj(
        (sorted(resume.loaded), mine)))
    resume.check_complete({r for loaded, _ in everyone for r in loaded})
    holders = {}
    for rank, (_, held) in enumerate(everyone):
        for i in held:
            holders.setdefault(i, rank)
    rank = comm.rank
    for i, holder in sorted(holders.items()):
        owner = assignment.owners[i]
        if holder == owner:
            continue
        if rank == holder:
            comm.send_obj(block_state(blocks[i]), owner)
        elif rank == owner:
            load_block_state(blocks[i], comm.recv_obj(holder))
    for i in mine:
        if assignment.owners[i] != rank:
            blocks[i].clear_curvature()
    for i, split in split_blocks.splits.items():
        if assignment.owners[i] == rank and blocks[i].ready():
            blocks[i].form = split.adopt(blocks[i].form)
    logger.info('rank %d: K-FAC curvature of a snapshot of %d '
                'process(es) placed on %d', rank, resume.saved_size,
                comm.size)


def block_state(block):
    """The state :meth:`FisherBlock.serialize
    <chainerkfac.curvature.FisherBlock.serialize>` saves, as a dict of
    NumPy arrays (what travels to a block's new owner)."""
    state = {}
    serializers.DictionarySerializer(state).save(block)
    return state


def load_block_state(block, state):
    """Loads what :func:`block_state` returned into ``block``."""
    serializers.NpzDeserializer(state).load(block)
