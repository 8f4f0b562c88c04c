"""The doubly-factored block against the standard one on a large-input Linear.

    PYTHONPATH=. .venv/bin/python benchmarks/doubly_factored.py cost
    PYTHONPATH=. .venv/bin/python benchmarks/doubly_factored.py train \\
        --jobs 2                                  # the grid, seed 0
    PYTHONPATH=. .venv/bin/python benchmarks/doubly_factored.py train \\
        --seeds 1 --lrs-kfac 0.05 0.8 --lrs-sgd 0.05   # a second seed
    PYTHONPATH=. .venv/bin/python benchmarks/doubly_factored.py --report

Ba, Grosse & Martens (2017, §4) approximate the input factor of a layer
whose input is a large feature map (AlexNet's and VGG's first fully
connected layers) by ``Ψ ⊗ K``: ``C x C`` and ``T x T`` instead of one
``C T x C T`` (``KFAC(doubly_factored_from=N)``,
:class:`chainerkfac.curvature.doubly_factored.DoublyFactoredBlock`).

``cost``: one Linear (``C x side x side`` inputs, ReLU'd Gaussian feature
maps, 512 outputs, then a 10-way Linear) at batch 256, factors and
inverses refreshed every step, one BLAS thread: per step, the statistics,
the inversion and the preconditioning (median of ``--steps`` after one
warm-up step; the library's timing hook), and the bytes the block holds
(factors, the sums kept for the next statistics, inverses:
``FisherBlock.state_bytes``). The standard block runs up to
``--standard-max`` wide inputs; above, its bytes are counted from its
shapes (three ``d x d`` float32 arrays) and its time is not measured.

``train``: a VGG-style network (``VGGStyle``: 3x3 convolutions with
BatchNorm, 16-32 at 24x24, 64-64 at 12x12, 128-256 at 6x6, ``fc1`` on its
9,216 inputs, ``fc2``) on the shapes task (``--n-train`` images, 10
epochs) under compare_shapes.py's recipe at batch 256: MomentumSGD over
``--lrs-sgd``, and K-FAC with ``doubly_factored_from=8192`` (fc1's ``Ψ``
256 x 256 and ``K`` 36 x 36 in place of a 9,217 x 9,217 ``A``) at the
defaults (``kfac_doubly_kl_step_adaptive``), the defaults before
``kl_graft``'s KL change grew like the batch (``kfac_doubly_swap_before``)
and the KL change per step that the run's length sets
(``kfac_doubly_kl_run``), at ``--lrs-kfac``. Runs are kept in
``results/doubly_factored.json`` as they end, not repeated.
"""
import argparse
import multiprocessing
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import chainer.functions as F
import chainer.links as L
import numpy

import compare_shapes
import harness
import shapes

OUT = 'doubly_factored.json'
WIDTH = 8192
#: name -> K-FAC options (None: MomentumSGD).
OPTIMIZERS = {'sgd': None,
              # The defaults (a function of the batch and the run's steps:
              # the bound grows like the batch).
              'kfac_doubly_kl_step_adaptive': lambda batch, steps: dict(
                  compare_shapes.kl_step_options(batch,
                                                 'kfac_kl_step_adaptive'),
                  doubly_factored_from=WIDTH),
              # The defaults before kl_graft's KL change grew like the
              # batch.
              'kfac_doubly_swap_before': lambda batch, steps: dict(
                  compare_shapes.kl_step_options(batch, 'kfac_swap_before'),
                  doubly_factored_from=WIDTH),
              # The same with the KL change per step that the run's length
              # sets: compare_shapes.KL_BUDGET over its steps.
              'kfac_doubly_kl_run': lambda batch, steps: dict(
                  compare_shapes.kl_step_options(batch, 'kfac_kl_run',
                                                 steps),
                  doubly_factored_from=WIDTH)}
#: (channels, side) of the cost measurement's inputs.
COST_SHAPES = ((256, 4), (256, 6), (256, 8), (512, 7))


class VGGStyle(chainer.Chain):
    """Six 3x3 conv-BN-ReLU layers in three stages with max-pooling, then
    two fully connected layers, the first on the 256 x 6 x 6 feature map."""

    WIDTHS = ((16, 32), (64, 64), (128, 256))

    def __init__(self, n_classes=10, hidden=256):
        super().__init__()
        with self.init_scope():
            self.convs = chainer.ChainList()
            self.bns = chainer.ChainList()
            c_in = 3
            for stage in self.WIDTHS:
                for c in stage:
                    self.convs.append(L.Convolution2D(c_in, c, 3, 1, 1,
                                                      nobias=True))
                    self.bns.append(L.BatchNormalization(c))
                    c_in = c
            self.fc1 = L.Linear(c_in * 6 * 6, hidden)
            self.fc2 = L.Linear(hidden, n_classes)

    def forward(self, x):
        h, layer = x, 0
        for i, stage in enumerate(self.WIDTHS):
            for _ in stage:
                h = F.relu(self.bns[layer](self.convs[layer](h)))
                layer += 1
            if i < len(self.WIDTHS) - 1:
                h = F.max_pooling_2d(h, 2)
        # The feature map itself: fc1 flattens it (what the doubly-factored
        # block needs to see its channels and positions).
        return self.fc2(F.relu(self.fc1(h)))


class WideInput(chainer.Chain):
    """A Linear on a ``C x side x side`` map and a 10-way head."""

    def __init__(self, channels, side, hidden=512):
        super().__init__()
        with self.init_scope():
            self.fc1 = L.Linear(channels * side * side, hidden)
            self.fc2 = L.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


# -- cost -----------------------------------------------------------------

def measure_cost(channels, side, doubly, steps, batch=256):
    harness.limit_threads(1)
    numpy.random.seed(0)
    model = WideInput(channels, side)
    width = channels * side * side
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.01, factor_interval=1, inverse_interval=1,
        doubly_factored_from=width if doubly else None)
    optimizer.setup(model)
    rng = numpy.random.RandomState(0)
    x = numpy.maximum(rng.randn(batch, channels, side, side), 0).astype(
        numpy.float32)
    t = rng.randint(0, 10, batch)
    timer = chainerkfac.timing.StageTimer()
    per_step = []
    for step in range(steps + 1):
        timer.reset()
        harness.timed_step(model, optimizer, x, t, timer)
        if step:
            per_step.append(timer.coarse())
    block = optimizer.blocks[0]
    stages = ('statistics', 'inversion', 'precondition')
    return {'width': width, 'channels': channels, 'side': side,
            'block': block.describe(), 'state_bytes': block.state_bytes(),
            'seconds': {s: float(numpy.median([p[s] for p in per_step]))
                        for s in stages}}


def run_cost(args):
    payload = harness.read_json(OUT) or {}
    rows = []
    for channels, side in COST_SHAPES:
        width = channels * side * side
        for doubly in (False, True):
            if not doubly and width > args.standard_max:
                d = width + 1
                rows.append({'width': width, 'channels': channels,
                             'side': side, 'block': 'K-FAC A {0}x{0}, G '
                             '512x512 (not run)'.format(d),
                             'state_bytes': 3 * 4 * (d * d + 512 * 512),
                             'seconds': None, 'counted': True})
                continue
            row = measure_cost(channels, side, doubly, args.steps)
            print(row, flush=True)
            rows.append(row)
    payload['cost'] = {'rows': rows, 'steps': args.steps,
                       'argv': sys.argv[1:],
                       'environment': harness.environment()}
    harness.write_json(OUT, payload)


# -- training ---------------------------------------------------------------

def train(spec):
    """One run: ``spec`` = (optimizer, base lr, seed, epochs, warm-up
    epochs, batch, training images)."""
    name, base_lr, seed, epochs, warmup_epochs, batch, n_train = spec
    harness.limit_threads(1)
    harness.keep_freed_memory()
    (x_tr, y_tr), (x_val, y_val) = shapes.load(n_train=n_train)
    numpy.random.seed(seed)
    model = VGGStyle()
    lr = base_lr * batch / 256
    steps = len(x_tr) // batch
    total, warmup = steps * epochs, steps * warmup_epochs
    options = OPTIMIZERS[name]
    if callable(options):
        options = options(batch, total)
    timer = None
    if options is None:
        optimizer = chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)
    else:
        optimizer = chainerkfac.optimizers.KFAC(lr=lr, momentum=0.9,
                                                **options)
        timer = optimizer.stage_timer = chainerkfac.timing.StageTimer()
    optimizer.setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(
        compare_shapes.WEIGHT_DECAY))
    rng = numpy.random.RandomState(seed)
    curve, wall, it = [], 0.0, 0
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_tr))
        for k in range(steps):
            idx = order[k * batch:(k + 1) * batch]
            optimizer.lr = lr * compare_shapes.schedule_factor(it, total,
                                                               warmup)
            loss_value, seconds = harness.train_step(
                model, optimizer, x_tr[idx], y_tr[idx])
            wall += seconds
            it += 1
        accuracy, val_loss = compare_shapes.evaluate(model, x_val, y_val)
        curve.append({'epoch': epoch, 'seconds': wall,
                      'val_accuracy': accuracy, 'val_loss': val_loss,
                      'train_loss': loss_value})
        print(name, base_lr, seed, curve[-1], flush=True)
        if not numpy.isfinite(loss_value):
            break
    run = {'optimizer': name, 'base_lr': base_lr, 'seed': seed,
           'epochs': epochs, 'warmup_epochs': warmup_epochs, 'batch': batch,
           'n_train': n_train, 'curve': curve}
    if timer is not None:
        run['stage_seconds'] = timer.coarse()
        run['inversions'] = timer.calls['inversion']
        run['fc1'] = {'block': optimizer.blocks[-2].describe(),
                      'state_bytes': optimizer.blocks[-2].state_bytes()}
    return run


def _key(run):
    return (run['optimizer'], run['base_lr'], run['seed'], run['epochs'],
            run['batch'], run['n_train'])


def run_train(args):
    payload = harness.read_json(OUT) or {}
    done = {_key(r) for r in payload.get('runs', [])}
    specs = [(name, lr, seed, args.epochs, args.warmup, args.batch,
              args.n_train)
             for seed in args.seeds for name in args.optimizers
             for lr in (args.lrs_sgd if name == 'sgd' else args.lrs_kfac)]
    specs = [s for s in specs
             if (s[0], s[1], s[2], s[3], s[5], s[6]) not in done]
    # Load the data once before the workers fork.
    shapes.load(n_train=args.n_train)
    with multiprocessing.Pool(args.jobs) as pool:
        for run in pool.imap_unordered(train, specs):
            payload = harness.read_json(OUT) or {}
            payload.setdefault('runs', []).append(run)
            payload['train_environment'] = harness.environment()
            payload['summary'] = summarise(payload['runs'])
            harness.write_json(OUT, payload)
    report(harness.read_json(OUT))


# -- report -------------------------------------------------------------------

def summarise(runs):
    """Per optimizer and base lr, over seeds: the final validation accuracy
    and loss, the training seconds and K-FAC's stage seconds (means), and
    the epochs to the target, the best final accuracy of MomentumSGD's grid
    minus 0.5 point (compare_shapes.py's rule), of each seed."""
    groups = {}
    for run in runs:
        groups.setdefault((run['optimizer'], run['base_lr']), []).append(run)
    finals = {key: float(numpy.mean([r['curve'][-1]['val_accuracy']
                                     for r in group]))
              for key, group in groups.items()}
    sgd = [v for (name, _), v in finals.items() if name == 'sgd']
    target = max(sgd) - 0.005 if sgd else None
    rows = []
    for (name, lr), group in sorted(groups.items()):
        group = sorted(group, key=lambda run: run['seed'])
        row = {'optimizer': name, 'base_lr': lr, 'seeds': len(group),
               'final_accuracy': finals[name, lr],
               'final_val_loss': float(numpy.mean(
                   [r['curve'][-1]['val_loss'] for r in group])),
               'seconds': float(numpy.mean(
                   [r['curve'][-1]['seconds'] for r in group]))}
        if target is not None:
            reached = [compare_shapes._to_target(r, target) for r in group]
            row['epochs_to_target'] = [e if ok else None
                                       for e, _, ok in reached]
        if 'stage_seconds' in group[0]:
            for stage in ('statistics', 'inversion', 'precondition'):
                row[stage + '_seconds'] = float(numpy.mean(
                    [r['stage_seconds'][stage] for r in group]))
            row['fc1'] = group[0]['fc1']
        rows.append(row)
    return {'target': target, 'rows': rows}


def cost_table(cost):
    """The cost measurement as a Markdown table."""
    rows = []
    for r in cost['rows']:
        s = r['seconds']
        rows.append([str(r['width']), '{}x{}x{}'.format(
            r['channels'], r['side'], r['side']), r['block'],
            harness.fmt_bytes(r['state_bytes'])] + (
            ['not run'] * 3 if s is None else
            [harness.fmt_s(s[k]) for k in
             ('statistics', 'inversion', 'precondition')]))
    return harness.table(rows, ['width', 'input', 'block', 'holds',
                                'statistics', 'inversion', 'precondition'])


def train_table(summary):
    """The training runs' summary as a Markdown table."""
    rows = [[r['optimizer'], '{:g}'.format(r['base_lr']), str(r['seeds']),
             '{:.3f}'.format(r['final_accuracy']),
             '{:.3f}'.format(r['final_val_loss']),
             ', '.join('-' if e is None else str(e)
                       for e in r.get('epochs_to_target', [])),
             '{:.0f}'.format(r['seconds'])]
            + ['{:.0f}'.format(r[stage + '_seconds'])
               if stage + '_seconds' in r else '-'
               for stage in ('statistics', 'inversion', 'precondition')]
            + [harness.fmt_bytes(r['fc1']['state_bytes'])
               if 'fc1' in r else '-']
            for r in summary['rows']]
    return harness.table(rows, [
        'optimizer', 'base lr', 'seeds', 'final accuracy',
        'final val. loss', 'epochs to target (per seed)', 'training s',
        'statistics s', 'inversion s', 'precondition s',
        'fc1 block holds'])


def report(payload):
    if payload is None:
        print('no results yet')
        return
    if payload.get('cost'):
        print(cost_table(payload['cost']))
    if payload.get('summary'):
        print('target (MomentumSGD best - 0.5 point): {:.3f}'.format(
            payload['summary']['target']))
        print(train_table(payload['summary']))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument('what', nargs='?', choices=('cost', 'train'))
    parser.add_argument('--report', action='store_true')
    parser.add_argument('--steps', type=int, default=3)
    parser.add_argument('--standard-max', type=int, default=9216)
    parser.add_argument('--optimizers', nargs='+',
                        default=['sgd', 'kfac_doubly_kl_step_adaptive'])
    parser.add_argument('--lrs-sgd', type=float, nargs='+',
                        default=[0.0125, 0.025, 0.05, 0.1, 0.2, 0.4])
    parser.add_argument('--lrs-kfac', type=float, nargs='+',
                        default=[0.05, 0.8])
    parser.add_argument('--seeds', type=int, nargs='+', default=[0])
    parser.add_argument('--epochs', type=int, default=10)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--batch', type=int, default=256)
    parser.add_argument('--n-train', type=int, default=8000)
    parser.add_argument('--jobs', type=int, default=2)
    args = parser.parse_args(argv)
    if args.what == 'cost':
        run_cost(args)
    elif args.what == 'train':
        run_train(args)
    payload = harness.read_json(OUT)
    if payload and payload.get('runs'):
        # Read afresh, so that --report follows the summary's code.
        payload['summary'] = summarise(payload['runs'])
        harness.write_json(OUT, payload)
    report(payload)


if __name__ == '__main__':
    t0 = time.time()
    main()
    print('{:.0f} s'.format(time.time() - t0))
