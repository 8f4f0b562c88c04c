"""A snapshot resumes exactly: k steps, save, fresh process, k more steps."""
import glob
import os
import subprocess
import sys
import warnings

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac.curvature import block_state

from tests import mpi_helpers
from tests import snapshot_helpers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


SCRIPT = os.path.join(HERE, 'resume_run.py')


#: The options of the older snapshots' runs (the defaults of their time).
FIXTURE_OPTIONS = ['--step-rule', 'natural', '--kl-clip', '1e-4']


def run(tmp_path, name, start, stop, inverse, resume=None, extra=()):
    out = str(tmp_path / name)
    cmd = [sys.executable, SCRIPT, str(start), str(stop), out,
           '--inverse', inverse] + list(extra)
    if resume:
        cmd += ['--resume', resume]
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run(cmd, check=True, env=env, timeout=120)
    return out


def run_distributed(tmp_path, name, start, stop, resume=None, n=2,
                    extra=()):
    out = str(tmp_path / name)
    args = [str(start), str(stop), out, '--distributed'] + list(extra)
    if resume:
        args += ['--resume', resume]
    mpi_helpers.run_mpi(n, SCRIPT, args, timeout=120, check=True)
    return out


def assert_identical(straight, resumed):
    straight, resumed = numpy.load(straight), numpy.load(resumed)
    assert set(straight.files) == set(resumed.files)
    for key in straight.files:
        numpy.testing.assert_array_equal(straight[key], resumed[key],
                                         err_msg=key)
    return straight.files


@pytest.mark.parametrize('inverse,extra', [
    ('cholesky', []), ('eigen', []),
    # Inverses refreshed at steps 4 and 7 (inverse_interval 3) take effect
    # 2 steps later: the snapshot after step 5 holds one on its way.
    ('cholesky', ['--inverse-delay', '2']),
    # fc's 4 x 6 x 6 input doubly factored: K, Psi and G, and its form.
    ('cholesky', ['--doubly-factored-from', '144']),
    # The bound binding under a learning rate that moves: its peak.
    ('cholesky', ['--kl-clip', '1e-5'])])
def test_resumed_run_equals_uninterrupted_run(tmp_path, inverse, extra):
    k = 5
    straight = run(tmp_path, 'straight', 0, 2 * k, inverse, extra=extra)
    half = run(tmp_path, 'half', 0, k, inverse, extra=extra)
    if '--inverse-delay' in extra:
        assert numpy.load(half + '.npz')['optimizer/kfac/fc/pending_step'] \
            == 6
    resumed = run(tmp_path, 'resumed', k, 2 * k, inverse, resume=half,
                  extra=extra)
    keys = assert_identical(straight + '.npz', resumed + '.npz')
    # The inverse, built from the factors as they are, is rebuilt from
    # them at load: the snapshot holds its kind alone.
    factors = ('Psi', 'inverse_rebuilt') if '--doubly-factored-from' in \
        extra else ('A', 'inverse_rebuilt')
    for factor in factors:
        assert 'optimizer/kfac/fc/' + factor in keys, factor
    assert 'optimizer/kfac/bound/peak_lr' in keys


def test_distributed_resume_equals_uninterrupted_run(tmp_path):
    # Each of the 2 ranks saves and resumes its own snapshot.
    k = 5
    straight = run_distributed(tmp_path, 'straight', 0, 2 * k)
    half = run_distributed(tmp_path, 'half', 0, k)
    resumed = run_distributed(tmp_path, 'resumed', k, 2 * k, resume=half)
    owned = []
    for rank in (0, 1):
        suffix = '.rank{}.npz'.format(rank)
        keys = assert_identical(straight + suffix, resumed + suffix)
        owned += [key for key in keys
                  if key.endswith('/A') and 'kfac' in key]
    # Every Kronecker factor is stored by exactly one rank, its owner.
    assert sorted(owned) == ['optimizer/kfac/conv/A', 'optimizer/kfac/fc/A']


def test_distributed_resume_with_split_blocks(tmp_path):
    # 2 of 3 ranks share the preconditioning of fc2, from its Cholesky
    # factors. What the other rank holds of them is not in the snapshots:
    # the owner sends it again on the first step after resuming.
    k = 5

    def run3(name, start, stop, resume=None):
        return run_distributed(tmp_path, name, start, stop, resume, n=3,
                               extra=['--mlp'])

    straight = run3('straight', 0, 2 * k)
    half = run3('half', 0, k)
    resumed = run3('resumed', k, 2 * k, resume=half)
    for rank in range(3):
        suffix = '.rank{}.npz'.format(rank)
        assert_identical(straight + suffix, resumed + suffix)


@pytest.mark.parametrize('fixture,inverse,n', [
    # Steps 0-4 of resume_run.py, written before snapshots had a K-FAC
    # header (commit f9eb33b).
    ('snapshot_before_header', 'cholesky', None),
    # Written before inverse forms became objects (commit 7d85877).
    ('snapshot_eigen', 'eigen', None),
    # resume_run.py --mlp on 3 ranks, before the split-block protocol moved
    # to chainerkfac.distributed (commit 7d85877).
    ('snapshot_split', 'cholesky', 3)])
def test_snapshot_of_an_earlier_format_is_refused_by_its_format(
        tmp_path, fixture, inverse, n):
    fixture = os.path.join(HERE, 'fixtures', fixture)
    args = ['5', '10', str(tmp_path / 'resumed'), '--resume', fixture]
    args += ['--distributed', '--mlp'] if n else ['--inverse', inverse]
    stderr = failing_run(args + FIXTURE_OPTIONS, n)
    assert 'snapshot of K-FAC state format 1' in stderr, stderr
    assert 'this version reads format {}'.format(
        chainerkfac.optimizers.snapshot.FORMAT) in stderr, stderr


def failing_run(args, n=None):
    """stderr of a resume_run.py run that must fail."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    if n is None:
        result = subprocess.run([sys.executable, SCRIPT] + args, env=env,
                                capture_output=True, text=True, timeout=120)
    else:
        result = mpi_helpers.run_mpi(n, SCRIPT, args, timeout=120)
    assert result.returncode != 0, result.stdout
    return result.stderr


def run_on(tmp_path, n, name, start, stop, resume=None, extra=()):
    """resume_run.py on ``n`` processes: one plain KFAC process for 1,
    else a distributed run under mpiexec."""
    if n == 1:
        return run(tmp_path, name, start, stop, 'cholesky', resume, extra)
    return run_distributed(tmp_path, name, start, stop, resume, n, extra)


def merged(out):
    """The run's model and momentum (rank 0's file) and, from whichever
    file holds it, every block's factors and refresh schedules."""
    paths = sorted(glob.glob(out + '*.npz'))
    values = {}
    for path in paths:
        state = numpy.load(path)
        for key in state.files:
            name = key.rsplit('/', 1)[-1]
            if '/kfac/' not in key:
                values.setdefault(key, state[key])
            elif name in ('A', 'G', 'F') and state[key + '@present']:
                values[key] = block_state.unpack(
                    state[key], state[key + '@present'])
    return values


@pytest.mark.parametrize('saved,resumed,delay,k', [
    (2, 1, 0, 5), (2, 3, 0, 5), (1, 2, 0, 5), (2, 3, 2, 5),
    # Step 5 refreshes every factor: the first backward after the resume
    # collects statistics of blocks that then move to another owner.
    (1, 2, 0, 4), (2, 3, 0, 4)])
def test_resume_on_another_process_count_equals_uninterrupted_run(
        tmp_path, saved, resumed, delay, k):
    # Every file of the snapshot is loaded by one of the new processes;
    # the first update moves each layer's curvature to its new owner. The
    # MLP has no BatchNorm (whose batch statistics depend on the
    # per-process batch), so that runs on any number of processes agree;
    # on 2 and 3 processes its blocks are split.
    extra = ['--double', '--mlp', '--inverse-delay', str(delay)]
    straight = run_on(tmp_path, resumed, 'straight', 0, 2 * k, extra=extra)
    half = run_on(tmp_path, saved, 'half', 0, k, extra=extra)
    out = run_on(tmp_path, resumed, 'resumed', k, 2 * k, resume=half,
                 extra=extra)
    expected, got = merged(straight), merged(out)
    assert expected.keys() == got.keys()
    factors = [key for key in got if key.endswith(('/A', '/G', '/F'))
               and '/kfac/' in key]
    assert len(factors) == 6, factors
    for key, value in expected.items():
        if value.dtype.kind in 'US':  # the K-FAC header's text
            continue
        numpy.testing.assert_allclose(
            got[key], value, rtol=1e-5,
            atol=1e-5 * max(numpy.abs(value).max(), 1e-30), err_msg=key)


def test_incomplete_or_mixed_snapshot_files_are_refused(tmp_path):
    half = run_distributed(tmp_path, 'half', 0, 5)
    # One process given only rank 0's file of a 2-process snapshot.
    stderr = failing_run(['5', '10', str(tmp_path / 'one'), '--resume',
                          half, '--resume-rank', '0'])
    assert ('snapshot written by 2 processes resumed on another number, '
            'but no process loaded the file(s) of rank(s) 1') in stderr, \
        stderr
    # On as many processes, every rank loading rank 0's file.
    stderr = failing_run(['5', '10', str(tmp_path / 'same'), '--distributed',
                          '--resume', half, '--resume-rank', '0'], n=2)
    assert 'loaded by rank 1 of 2' in stderr, stderr
    # A file missing.
    os.remove(half + '.rank1.npz')
    with pytest.raises(ValueError, match='lacks the files of rank'):
        chainerkfac.snapshot_files(half + '.rank0.npz', 0, 1)
    # A split snapshot of an earlier format, on another process count.
    stderr = failing_run(['5', '10', str(tmp_path / 'old'), '--distributed',
                          '--mlp', '--resume',
                          os.path.join(HERE, 'fixtures', 'snapshot_split')]
                         + FIXTURE_OPTIONS, n=2)
    assert 'snapshot of K-FAC state format 1' in stderr, stderr


@pytest.mark.parametrize('saved,size', [(2, 1), (2, 3), (1, 2), (5, 2),
                                        (3, 3)])
def test_snapshot_files_cover_every_file_once(tmp_path, saved, size):
    stem = str(tmp_path / 'snapshot_iter_8')
    names = ['{}.npz'.format(stem)] if saved == 1 else [
        '{}.rank{}.npz'.format(stem, r) for r in range(saved)]
    for name in names:
        numpy.savez(name, **{'optimizer/kfac/header/world_size': saved})
    given = [chainerkfac.snapshot_files(names[-1], rank, size)
             for rank in range(size)]
    if saved == size:
        assert given == [[name] for name in names]
    # Each file is loaded by exactly one process as a file of its own; a
    # process without one loads a file for the state all processes share.
    own = [files for rank, files in enumerate(given)
           if rank < saved or saved == size]
    assert sorted(name for files in own for name in files) == names
    assert all(len(files) >= 1 for files in given)


class MLP(chainer.Chain):
    def __init__(self, hidden=5, in_size=4):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(in_size, hidden)
            self.l2 = L.Linear(hidden, 3)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def trained(optimizer, model, steps=2):
    optimizer.setup(model)
    rng = numpy.random.RandomState(0)
    for _ in range(steps):
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         rng.randn(8, 4).astype(numpy.float32),
                         rng.randint(0, 3, 8))
    state = {}
    chainer.serializers.DictionarySerializer(state).save(optimizer)
    return state


def load(state, optimizer):
    chainer.serializers.NpzDeserializer(state).load(optimizer)


def test_momentum_sgd_snapshot_starts_kfac_with_fresh_curvature():
    numpy.random.seed(0)
    model = MLP()
    state = trained(chainer.optimizers.MomentumSGD(lr=0.1), model)
    kfac = chainerkfac.optimizers.KFAC(lr=0.1)
    kfac.setup(model)
    load(state, kfac)
    assert kfac.t == 2
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(
            param.update_rule.state['v'], state[name[1:] + '/v'])
    assert all(block.factor['A'] is None for block in kfac.blocks)
    trained(kfac, model, steps=1)
    assert all(block.ready() for block in kfac.blocks)


def test_snapshot_with_other_layers_options_or_nonfinite_is_refused():
    numpy.random.seed(0)
    state = trained(chainerkfac.optimizers.KFAC(), MLP())

    def loading_into(model, optimizer=None):
        optimizer = optimizer or chainerkfac.optimizers.KFAC()
        optimizer.setup(model)
        load(state, optimizer)

    with pytest.raises(ValueError, match="'l1: K-FAC A 5x5, G 5x5' in the "
                       "snapshot, 'l1: K-FAC A 5x5, G 6x6' in this model"):
        loading_into(MLP(hidden=6))
    with pytest.raises(ValueError, match="inverse='cholesky', this run has "
                       "'eigen'"):
        loading_into(MLP(), chainerkfac.optimizers.KFAC(inverse='eigen'))
    with pytest.raises(ValueError, match="'l1: K-FAC A 5x5, G 5x5' in the "
                       'snapshot, "l1: K-FAC A 5x5, G 5x5, '
                       'conv_factors=\'reduced\'" in this model'):
        loading_into(MLP(), chainerkfac.optimizers.KFAC(
            conv_factors='reduced'))
    state['kfac/l2/G'] = state['kfac/l2/G'].copy()
    state['kfac/l2/G'][0] = numpy.inf  # (stored as its upper triangle)
    with pytest.raises(ValueError, match='non-finite G of K-FAC layer l2'):
        loading_into(MLP())


def test_snapshot_of_another_step_rule_resumes_and_says_so(caplog):
    numpy.random.seed(0)
    state = trained(chainerkfac.optimizers.KFAC(step_rule='kl_graft'), MLP())
    assert str(state['kfac/header/step_rule']) == 'kl_graft'

    def resumed_under(rule):
        caplog.clear()
        optimizer = chainerkfac.optimizers.KFAC(step_rule=rule)
        optimizer.setup(MLP())
        with caplog.at_level('WARNING', 'chainerkfac'):
            load(state, optimizer)
        return [r.getMessage() for r in caplog.records
                if 'step rule' in r.getMessage()
                or 'step_rule' in r.getMessage()]

    assert resumed_under('kl_graft') == []
    said, = resumed_under('natural')
    assert "taken under step_rule='kl_graft'" in said
    assert "under step_rule='natural'" in said


def test_lazily_initialised_layers_load_before_the_model():
    # The Trainer's snapshot loads the optimizer before the model, whose
    # lazily initialised layers have no shapes yet.
    numpy.random.seed(0)
    state = trained(chainerkfac.optimizers.KFAC(), MLP())
    model = MLP(in_size=None)
    kfac = chainerkfac.optimizers.KFAC()
    kfac.setup(model)
    load(state, kfac)
    assert kfac.t == 2


def set_up(model, optimizer):
    optimizer.setup(model)
    return model, optimizer


def resumable(make, steps_before, steps_after, step):
    """``step(optimizer, model, i)`` for ``steps_before`` steps, a snapshot
    loaded into a fresh optimizer and model, then ``steps_after`` more;
    also the same steps uninterrupted. Returns the warnings each run
    gave after the snapshot point and what each step raised, in order
    (uninterrupted, resumed)."""
    outcomes = []
    for resume in (False, True):
        numpy.random.seed(0)
        model, optimizer = set_up(MLP(), make())
        for i in range(steps_before):
            step(optimizer, model, i)
        if resume:
            model, optimizer = snapshot_helpers.reloaded(
                model, optimizer, lambda: set_up(MLP(), make()))
        events = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            for i in range(steps_before, steps_before + steps_after):
                try:
                    step(optimizer, model, i)
                except Exception as e:  # what the step raised, compared
                    events.append((i, type(e).__name__))
        events += [w.category.__name__ for w in caught]
        outcomes.append(events)
    return outcomes


def scaled_loss_step(factors):
    """A step whose loss is the MLP's times ``factors[i]``."""
    def step(optimizer, model, i):
        rng = numpy.random.RandomState(i)
        optimizer.update(
            lambda x, t: factors[i] * F.softmax_cross_entropy(model(x), t),
            rng.randn(8, 4).astype(numpy.float32), rng.randint(0, 3, 8))
    return step


def test_divergence_monitor_resumes_with_the_first_loss():
    # The loss falls 100-fold, the run is resumed, its loss rises back to
    # the first one: no divergence for the uninterrupted run, and none for
    # the resumed one (which compared with the loss at the resume).
    for divergence in ('warn', 'raise'):
        straight, resumed = resumable(
            lambda: chainerkfac.optimizers.KFAC(lr=1e-3,
                                                divergence=divergence),
            3, 2, scaled_loss_step([1, 0.01, 0.01, 0.01, 1]))
        assert straight == resumed == [], (straight, resumed)
    # A divergence warned before the snapshot is not warned again.
    straight, resumed = resumable(
        lambda: chainerkfac.optimizers.KFAC(lr=1e-3), 2, 2,
        scaled_loss_step([1, 100, 1, 100]))
    assert straight == resumed == [], (straight, resumed)


def test_stall_count_resumes():
    # 100 steps in a row whose guard scale is under 1e-3 while the loss
    # (of one batch, again and again) does not fall: a StallWarning at
    # step 100, resumed at 60 or not.
    straight, resumed = resumable(
        lambda: chainerkfac.optimizers.KFAC(lr=1e-3, kl_clip=1e-20),
        60, 41, lambda optimizer, model, i: scaled_loss_step([1])(
            optimizer, model, 0))
    assert straight == resumed == ['StallWarning'], (straight, resumed)


def test_skipped_steps_in_a_row_resume():
    # max_skipped_steps=3: two NaN batches, a snapshot, a third one.
    def step(optimizer, model, i):
        rng = numpy.random.RandomState(i)
        x = rng.randn(8, 4).astype(numpy.float32)
        if i >= 2:
            x[0, 0] = numpy.nan
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         x, rng.randint(0, 3, 8))

    straight, resumed = resumable(
        lambda: chainerkfac.optimizers.KFAC(nonfinite='skip',
                                            max_skipped_steps=3), 4, 1, step)
    assert straight == resumed == [(4, 'NonFiniteError')], \
        (straight, resumed)


def test_snapshot_loaded_on_some_ranks_only_is_refused(tmp_path):
    # Rank 0 alone loads its file: instead of every rank waiting in
    # another collective, each says which ranks loaded and which did not.
    half = run_distributed(tmp_path, 'half', 0, 5)
    result = mpi_helpers.run_mpi(2, '''
import sys
import numpy
import chainer
import chainerkfac
from tests import resume_run
model = resume_run.CNN()
optimizer = chainerkfac.create_multi_node_optimizer(
    resume_run.make_optimizer('cholesky', 'kl_graft', None),
    chainerkfac.create_communicator('naive'))
optimizer.setup(model)
if optimizer.stages.rank_and_size()[0] == 0:
    chainer.serializers.NpzDeserializer(
        numpy.load(sys.argv[1] + '.rank0.npz'),
        path='optimizer/').load(optimizer)
x = numpy.zeros((3, 1, 6, 6), numpy.float32)
optimizer.update(lambda x: chainer.functions.sum(model(x)), x)
''', [half], timeout=60)
    assert result.returncode != 0
    assert ('rank 0 at iteration 5, snapshot loaded, rank 1 at iteration 0'
            in result.stderr), result.stderr
    assert 'loaded on rank(s) 0 only' in result.stderr, result.stderr


def one_process_snapshot(tmp_path):
    """``(stem, optimizer)`` of a one-process snapshot after 2 steps."""
    numpy.random.seed(0)
    optimizer = chainerkfac.optimizers.KFAC()
    state = trained(optimizer, MLP())
    stem = str(tmp_path / 'snapshot_iter_2')
    numpy.savez(stem + '.rank0.npz', **state)
    return stem, optimizer


@pytest.mark.parametrize('damage', ['empty', 'truncated', 'corrupt'])
def test_unreadable_snapshot_file_is_named(tmp_path, damage):
    stem, optimizer = one_process_snapshot(tmp_path)
    raw = open(stem + '.rank0.npz', 'rb').read()
    with open(stem + '.rank0.npz', 'wb') as f:
        f.write({'empty': b'', 'truncated': raw[:len(raw) // 2],
                 'corrupt': raw[:40] + bytes(len(raw) - 80) + raw[-40:]}[
                     damage])

    class OneProcess:
        rank, size = 0, 1
    with pytest.raises(ValueError, match='cannot read snapshot file {}'
                       .format(stem + '.rank0.npz')):
        chainerkfac.load_snapshot(stem, optimizer, optimizer, OneProcess())


def test_snapshot_with_a_non_finite_momentum_is_refused():
    numpy.random.seed(0)
    state = trained(chainerkfac.optimizers.KFAC(), MLP())
    key = next(k for k in state if k.endswith('l1/W/v'))
    state[key] = state[key].copy()
    state[key][0, 0] = numpy.nan
    optimizer = chainerkfac.optimizers.KFAC()
    optimizer.setup(MLP())
    with pytest.raises(ValueError, match='non-finite momentum of /l1/W'):
        load(state, optimizer)


def test_load_snapshot_without_a_communicator_is_one_process(tmp_path):
    stem, optimizer = one_process_snapshot(tmp_path)
    numpy.random.seed(1)
    other = MLP()
    resumed = chainerkfac.optimizers.KFAC()
    resumed.setup(other)
    assert not chainerkfac.load_snapshot(stem, resumed, resumed, None)
    assert resumed.t == optimizer.t
