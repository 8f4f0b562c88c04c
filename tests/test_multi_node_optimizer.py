"""Distributed K-FAC equals one process on the same global batch.

``mpiexec -n 2`` and ``-n 4`` with per-rank batch b against one process
with batch N b, float64, after steps that mix refresh and stale steps
(adaptive A interval, G every 2 steps, inverses every 3), momentum, EMA,
weight decay in both forms, a parameter outside K-FAC, each step rule
and the bound on the KL change, whose scale per step is compared too.
Replicas (and the bound's scales) are checked identical on every rank
inside the script.
"""
import json
import os
import subprocess
import sys
import time

import numpy
import pytest

from tests import mpi_helpers

SCRIPT = mpi_helpers.script_path('kfac_equivalence.py')


def single_process(tmp_path, options):
    out = str(tmp_path / 'single.npz')
    env = dict(os.environ, PYTHONPATH=mpi_helpers.REPO_ROOT)
    subprocess.run([sys.executable, SCRIPT, out, '--single'] + options,
                   check=True, env=env, timeout=120)
    return numpy.load(out)


def assert_same_parameters(got, expected, what):
    for name in expected.files:
        scale = numpy.nanmax(numpy.abs(expected[name]))
        numpy.testing.assert_allclose(
            got[name], expected[name], rtol=0, atol=1e-5 * scale,
            err_msg='{}, {}'.format(what, name))


@pytest.mark.parametrize('inverse,rule,conv_factors,extra', [
    # One scale for all blocks, from every rank's gathered sums.
    ('cholesky', 'kl_graft', 'expanded', []),
    ('eigen', 'kl_graft', 'expanded', []),
    ('cholesky', 'natural', 'expanded', []),
    ('cholesky', 'kl_graft', 'reduced', []),
    # fc1 doubly factored (Ψ ⊗ K ⊗ G, Ba et al. 2017 §4; explicit
    # inverses under either inverse option).
    ('eigen', 'kl_graft', 'expanded', ['--doubly-factored-from', '16'])])
def test_distributed_equals_single_process(tmp_path, inverse, rule,
                                           conv_factors, extra):
    options = ['--inverse', inverse, '--step-rule', rule,
               '--conv-factors', conv_factors] + extra
    expected = single_process(tmp_path, options)
    # The bound scales most steps, identically on every rank.
    assert (expected['update_scale'] < 1).sum() >= 4, expected['update_scale']
    for n in (2, 4):
        out = str(tmp_path / 'n{}.npz'.format(n))
        mpi_helpers.run_mpi(n, SCRIPT, [out] + options,
                            timeout=180, check=True)
        assert_same_parameters(numpy.load(out), expected,
                               '{} ranks'.format(n))


def test_more_ranks_than_layers_equals_single_process(tmp_path):
    # 4 ranks for the 3 layers of the MLP: with one rank per block
    # (max_load_imbalance=None) one rank owns nothing and idles through
    # stages 4-5 (an empty segment in both v collectives); with splitting
    # (the default) every rank computes parts. Both equal one process.
    expected = single_process(tmp_path, ['--mlp'])
    for imbalance, idle in (('none', 1), ('1.1', 0)):
        out = str(tmp_path / 'n4_{}.npz'.format(imbalance))
        result = mpi_helpers.run_mpi(
            4, SCRIPT, [out, '--mlp', '--max-load-imbalance', imbalance],
            timeout=180, check=True)
        assert_same_parameters(numpy.load(out), expected,
                               '4 ranks, max_load_imbalance ' + imbalance)
        line, = [x for x in result.stdout.splitlines()
                 if x.startswith('parts')]
        busy = {rank for ranks, _, _ in json.loads(
            line.split(' ', 1)[1]).values() for rank in ranks}
        assert len(busy) == 4 - idle, (imbalance, busy)


def test_chainermn_communicator_equals_single_process(tmp_path):
    # chainerkfac.create_multi_node_optimizer(KFAC(...),
    # chainermn.create_communicator('naive')): a ChainerMN user's line.
    expected = single_process(tmp_path, [])
    out = str(tmp_path / 'chainermn.npz')
    mpi_helpers.run_mpi(2, SCRIPT, [out, '--chainermn'], timeout=180,
                        check=True)
    assert_same_parameters(numpy.load(out), expected, 'ChainerMN naive')


@pytest.mark.parametrize('options', [
    ['--float16'], ['--float16', '--transport-dtype', 'float16'],
    ['--transport-dtype', 'float16']])
def test_half_precision_follows_single_process(tmp_path, options):
    # A float16 model (static loss scale 1024), float16 transport of the
    # factors and gradients, or both: the replicas stay identical (checked
    # in the script: every rank takes what it sent back from the
    # all-gather, and the owners' adapted intervals, not their change
    # rates) and within float16's rounding of one process on the same
    # global batch (measured: 1.1e-2, 1.3e-2 and 6.6e-3 of the largest
    # value after 7 steps).
    expected = single_process(tmp_path, [o for o in options
                                         if o == '--float16'])
    out = str(tmp_path / 'half.npz')
    mpi_helpers.run_mpi(2, SCRIPT, [out] + options, timeout=180, check=True)
    got = numpy.load(out)
    for name in expected.files:
        scale = numpy.abs(expected[name].astype(numpy.float64)).max()
        numpy.testing.assert_allclose(
            got[name].astype(numpy.float64), expected[name], rtol=0,
            atol=3e-2 * scale, err_msg=name)


# name: (parts, length of the split side, form, owner's part empty).
@pytest.mark.parametrize('n, options, parts', [
    # Inverses serving 6 steps are explicit; V splits along its longer
    # side: fc1 (A 73 > G 50) by columns, fc2 (G 80 > A 51) by rows.
    (3, ['--inverse-interval', '6'],
     {'fc1': (3, 73, 'explicit', False), 'fc2': (3, 80, 'explicit', False)}),
    # Serving 3 steps, they are Cholesky factors; V splits along its
    # shorter side: fc1 by rows, fc2 by columns.
    (4, [], {'fc1': (2, 50, 'cholesky', False),
             'fc2': (2, 51, 'cholesky', False)}),
    # Hidden widths 80, 20: fc1 (A 73, G 80) explicit, fc2 (A 81, G 20)
    # Cholesky, both split by rows; refreshing costs each owner more than
    # a part, so the owners compute no rows.
    (4, ['80,20'], {'fc1': (4, 80, 'explicit', True),
                    'fc2': (4, 20, 'cholesky', True)}),
    # The ranks of each Cholesky-form block factor its larger factor
    # together, as from SHARED_FACTORIZATION_MIN_DIM on: fc1's G (80) in
    # two panels, fc2's A (51) in one, each over 2 ranks.
    (4, ['--min-shared-dim', '1'], {'fc1': (2, 50, 'cholesky', False),
                                    'fc2': (2, 51, 'cholesky', False)}),
    # fc2's owner then refreshes less and computes rows too; its three
    # ranks factor A_d (two panels: one rank receives the factor only).
    (4, ['80,20', '--min-shared-dim', '1'],
     {'fc1': (4, 80, 'explicit', True), 'fc2': (3, 20, 'cholesky', False)}),
])
def test_split_blocks_equal_single_process(tmp_path, n, options, parts):
    # Blocks split over ranks (max_load_imbalance=1.0): the parts of the
    # preconditioned gradient, computed from what the owner sends whenever
    # it refreshes the inverses (steps 1, 4, 7; 1 and 7 with interval 6),
    # assemble to what one process computes.
    expected = single_process(tmp_path, ['--mlp'] + options)
    out = str(tmp_path / 'split{}.npz'.format(n))
    result = mpi_helpers.run_mpi(
        n, SCRIPT, [out, '--mlp'] + options + ['--max-load-imbalance', '1.0'],
        timeout=180, check=True)
    assert_same_parameters(numpy.load(out), expected,
                           '{} ranks, split blocks'.format(n))
    line, = [x for x in result.stdout.splitlines() if x.startswith('parts')]
    found = json.loads(line.split(' ', 1)[1])
    for name, (count, length, form, owner_empty) in parts.items():
        ranks, bounds, got_form = found[name]
        assert len(ranks) == count == len(set(ranks)) and got_form == form
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        sizes = [stop - start for start, stop in bounds]
        # The owner's part is the smallest: it also refreshes the block.
        if owner_empty:
            assert sizes[0] == 0
        else:
            assert 0 < sizes[0] < min(sizes[1:])


@pytest.mark.parametrize('n', [2, 4])
def test_distributed_batch_norm_equals_accumulated_micro_batches(tmp_path, n):
    # BatchNorm normalises each rank's batch on its own. One process with
    # acc_iters=N runs the same N shards as micro-batches: gradients
    # (averaged over shards), factors (pooled over samples) and so all
    # parameters are exact. BatchNorm's running statistics are not (N ranks
    # average them every step; micro-batches update them one after another)
    # and are not compared; the script checks the ranks agree on them.
    expected = single_process(tmp_path, ['--batch-norm',
                                         '--acc-iters', str(n)])
    out = str(tmp_path / 'bn{}.npz'.format(n))
    mpi_helpers.run_mpi(n, SCRIPT, [out, '--batch-norm'], timeout=180,
                        check=True)
    assert_same_parameters(numpy.load(out), expected,
                           '{} ranks with BatchNorm'.format(n))


def test_stale_steps_move_only_gradients():
    result = mpi_helpers.run_mpi(2, mpi_helpers.script_path('kfac_bytes.py'),
                                 timeout=120, check=True)
    assert 'bytes ok' in result.stdout


@pytest.mark.parametrize('shared', [[], ['--shared']])
def test_split_blocks_move_gradient_copies_and_inverse_slices(shared):
    result = mpi_helpers.run_mpi(3, mpi_helpers.script_path('kfac_bytes.py'),
                                 ['--split'] + shared, timeout=120,
                                 check=True)
    assert 'split bytes ok' in result.stdout


def test_unequal_batches_are_refused_naming_each_rank():
    # 16 samples on rank 0 and 8 on rank 1: averaged with equal weights,
    # rank 1's samples would count twice; every rank says so instead.
    result = mpi_helpers.run_mpi(2, '''
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import chainerkfac
comm = chainerkfac.create_communicator('naive')
model = L.Classifier(L.Linear(4, 3))
optimizer = chainerkfac.create_multi_node_optimizer(
    chainerkfac.optimizers.KFAC(), comm)
optimizer.setup(model)
n = 16 if comm.rank == 0 else 8
rng = numpy.random.RandomState(comm.rank)
optimizer.update(model, rng.randn(n, 4).astype(numpy.float32),
                 rng.randint(0, 3, n))
''', timeout=60)
    assert result.returncode != 0
    assert ('batches of different sizes at iteration 1 (rank 0: 16, '
            'rank 1: 8)') in result.stderr, result.stderr


@pytest.mark.parametrize('rank1_updates', [
    2,  # a rank that leaves its loop early
    0,  # one that leaves before its first update
])
def test_rank_that_leaves_its_loop_is_named(rank1_updates):
    # Rank 0 starts one update more than rank 1 and, 1.1 x 3 + 5 s later
    # (the start of a step waits longer than its middle), names rank 1 and
    # the iteration; the job ends instead of hanging.
    start = time.monotonic()
    result = mpi_helpers.run_mpi(2, '''
import sys
import chainer.links as L
import numpy
import chainerkfac
comm = chainerkfac.create_communicator('naive')
model = L.Classifier(L.Linear(4, 3))
optimizer = chainerkfac.create_multi_node_optimizer(
    chainerkfac.optimizers.KFAC(), comm, arrival_deadline=3)
optimizer.setup(model)
rng = numpy.random.RandomState(comm.rank)
updates = int(sys.argv[1]) + (1 if comm.rank == 0 else 0)
for step in range(updates):
    optimizer.update(model, rng.randn(8, 4).astype(numpy.float32),
                     rng.randint(0, 3, 8))
''', [str(rank1_updates)], timeout=60)
    assert result.returncode != 0
    assert ('ArrivalTimeout: waited 8.3 s in the start of K-FAC iteration '
            '{}: rank(s) 1 did not answer'.format(rank1_updates + 1)) \
        in result.stderr, result.stderr
    assert time.monotonic() - start < 30


def test_unseeded_lazy_links_start_from_rank_0s_weights():
    # Each rank draws its own first weights of L.Linear(None, n) at the
    # first forward pass; the first step is still one process's from
    # rank 0's weights.
    result = mpi_helpers.run_mpi(
        2, mpi_helpers.script_path('unseeded_lazy.py'), ['{}'],
        timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(': ok') == 2


MID_STEP = '''
import sys, time
import chainerkfac
import chainer.functions as F
import chainer.links as L
import numpy
mode = sys.argv[1]
comm = chainerkfac.create_communicator('naive')
model = L.Linear(4, 3)
optimizer = chainerkfac.create_multi_node_optimizer(
    chainerkfac.optimizers.KFAC(), comm, arrival_deadline=3)
optimizer.setup(model)
rng = numpy.random.RandomState(comm.rank)


def loss(x, t):
    if comm.rank == 1 and optimizer.t == 4:
        if mode == 'exit':
            sys.exit(3)
        if mode == 'block':
            time.sleep(1000)
        raise RuntimeError('caught')
    return F.softmax_cross_entropy(model(x), t)


for step in range(8):
    try:
        optimizer.update(loss, rng.randn(8, 4).astype(numpy.float32),
                         rng.randint(0, 3, 8))
    except RuntimeError as e:
        if str(e) != 'caught':
            raise
'''


@pytest.mark.parametrize('mode,message', [
    ('exit', 'SystemExit in the middle of K-FAC iteration 5 on rank 1 of 2'),
    ('block', 'waited 3 s in the reduce-scatter of K-FAC iteration 5: '
     'rank(s) 1 did not answer: stopped, exited or blocked in the middle '
     'of the step'),
    ('catch', 'waited 3 s in the reduce-scatter of K-FAC iteration 5: '
     'rank 1 waits in the start of K-FAC iteration 5 (it left this step'),
])
def test_rank_that_stops_in_the_middle_of_a_step_is_named(mode, message):
    # sys.exit() inside the loss, a loss that blocks, and a rank that
    # catches its own exception and starts the next update: the others,
    # waiting in the step's first collective, end the job within the
    # deadline and the roll call's grace, naming the rank.
    start = time.monotonic()
    result = mpi_helpers.run_mpi(2, MID_STEP, [mode], timeout=60)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert time.monotonic() - start < 30
