"""Osawa et al.'s Table 1 in miniature: epochs to one target against the batch.

    PYTHONPATH=. .venv/bin/python benchmarks/table1.py --batches 64,2048 \\
        --jobs 2                                   # grids, then best seeds
    PYTHONPATH=. .venv/bin/python benchmarks/table1.py --rows kfac_swap_before
    PYTHONPATH=. .venv/bin/python benchmarks/table1.py --report

Table 1 of the paper trains ResNet-50 on ImageNet at mini-batches 4,096 to
131,072: 313 down to 10 iterations an epoch. ``compare_shapes.py``'s task
(20,000 training images) and model give the same range at batches 64 to
2,048; batch ``B`` stands for the paper's ``64 B`` and takes its
configuration (``examples/imagenet/configs/paper/bs*.json``). The epoch
budget grows with the batch as the paper's did: its epochs times 20/35
(20, 20, 20, 26, 34 and 57 epochs), so that batch 256 runs
``compare_shapes.py``'s 20 (whose MomentumSGD runs there are reused). Rows:

- ``sgd``: MomentumSGD with ``compare_shapes.py``'s large-batch recipe
  (``lr = base · B / 256``, 2 epochs of warm-up, cosine decay to 0,
  momentum 0.9), its base learning rate over ``--lrs-sgd``;
- ``kfac_kl_step_adaptive``: the defaults, the one-line swap
  ``KFAC(lr, 0.9)``; ``kfac_swap_before``, the defaults before
  ``kl_graft``'s KL change grew like the batch; ``kfac_kl_step_natural``,
  the defaults with ``step_rule='natural'``: each with the same recipe at
  ``sgd``'s best base learning rate at that batch;
- ``kfac_paper``: the paper's recipe at that batch: the natural step, no
  bound, factors every step (``cov_ema_decay`` 0), the diagonal BatchNorm
  Fisher with its damping times 16, the polynomial learning-rate decay, the
  momentum adjusted to it and the damping warm-up of the configuration
  (``examples/imagenet/schemes``; its epochs scaled by 20/35, the warm-up's
  steps by this run's steps over the paper's), at the configuration's
  learning rate times each of ``--multipliers``.

Every row has weight decay 5e-4 (the paper: none, and weight rescaling;
mixup and random erasing are not used here). Each row's grid runs seed 0,
doubled (halved) past its largest (smallest) setting while that is the
best, so that the best lies inside; then ``SEEDS`` seeds run at
each row's best setting (the highest seed-0 final accuracy; the swaps'
is MomentumSGD's). The target is
``sgd``'s best final accuracy over every batch less half a point. The
report gives each row's median epochs and seconds to it at each batch, its
critical batch (the largest up to which its median epochs stay within 1.5x
of its smallest; Shallue et al. 2019) and its epochs at the largest batch
over those at the smallest. Runs are kept in ``results/table1.json`` as
they end (those of rows no longer here stay, out of the report); the plot
goes to ``results/table1.png``.
"""
import argparse
import json
import math
import multiprocessing
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, '..', 'examples', 'imagenet'))

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import numpy

import compare_shapes
import harness
import schemes
import shapes

BATCHES = (64, 128, 256, 512, 1024, 2048)
CONFIGS = os.path.join(HERE, '..', 'examples', 'imagenet', 'configs', 'paper')
PAPER = dict(zip(BATCHES, ('bs4k', 'bs8k', 'bs16k', 'bs32k', 'bs64k',
                           'bs128k')))
#: ImageNet's training images: the paper's iterations per epoch.
IMAGENET_TRAIN = 1281167
N_TRAIN = 20000
EPOCH_SCALE = 20 / 35
WARMUP_EPOCHS = 2
#: Seeds at each row's best setting.
SEEDS = 2
ROWS = ('sgd', 'kfac_paper', 'kfac_swap_before', 'kfac_kl_step_adaptive',
        'kfac_kl_step_natural')
KFAC_ROWS = ROWS[1:]
#: The one-line swaps: at MomentumSGD's best learning rate at each batch,
#: with ``compare_shapes.py``'s bound of the step of fixed KL change.
SWAPS = ('kfac_swap_before', 'kfac_kl_step_adaptive',
         'kfac_kl_step_natural')
COLOURS = dict(zip(ROWS, ('tab:blue', 'crimson', 'tab:green',
                          'tab:olive', 'purple')))


def config(batch):
    with open(os.path.join(CONFIGS, PAPER[batch] + '.json')) as f:
        return json.load(f)


def epochs(batch):
    return round(config(batch)['epochs'] * EPOCH_SCALE)


def paper_options(conf):
    """The K-FAC options of the paper's configuration ``conf``."""
    return {'step_rule': 'natural', 'kl_clip': None, 'factor_interval': 1,
            'inverse_interval': 1, 'cov_ema_decay': conf['cov_ema_decay'],
            'bn_fisher': conf['bn_fisher'], 'inverse': conf['inverse'],
            'bn_damping_multiplier': conf['bn_damping_multiplier']}


class PaperSchedule:
    """The configuration's learning rate, momentum and damping at each step
    (Osawa et al. §4.3-4.4) of a run of ``total`` steps: the
    ``schemes.PolynomialDecay`` from ``lr``, its epochs scaled as the run's
    are, ``schemes.MomentumAdjustment``, and ``schemes.DampingWarmup`` over
    the same fraction of the run as the paper's."""

    def __init__(self, conf, lr, steps_per_epoch, total):
        decay, warmup = conf['lr_decay'], conf['damping_warmup']
        scale = total / steps_per_epoch / conf['epochs']
        self.decay = schemes.PolynomialDecay(
            lr, decay['start'] * scale, decay['end'] * scale,
            decay['power'])
        self.momentum = schemes.MomentumAdjustment(conf['momentum'])
        paper_steps = conf['epochs'] * IMAGENET_TRAIN / (
            conf['gpus'] * conf['batchsize'] * conf['acc_iters'])
        self.damping = schemes.DampingWarmup(
            warmup['initial'], conf['damping'],
            max(1, round(warmup['steps'] * total / paper_steps)))
        self.steps_per_epoch = steps_per_epoch
        self.previous = lr

    def __call__(self, iteration):
        lr = self.decay.value(iteration / self.steps_per_epoch)
        momentum = self.momentum.value(lr, self.previous)
        self.previous = lr
        return {'lr': lr, 'momentum': momentum,
                'damping': self.damping.value(iteration)}


def train(spec):
    """One run: ``spec`` = (row, setting, batch, seed); the setting is the
    base learning rate, or ``kfac_paper``'s multiplier."""
    name, setting, batch, seed = spec
    n_epochs = epochs(batch)
    if name == 'kfac_paper':
        conf = config(batch)
        lr = setting * conf['lr']
        steps = N_TRAIN // batch
        run = compare_shapes.train(
            (name, lr * 256 / batch, None, batch, seed, n_epochs, 0),
            schedule=PaperSchedule(conf, lr, steps, steps * n_epochs),
            options=paper_options(conf))
    else:
        bound = None if name == 'sgd' else compare_shapes.KL_STEP_CLIP
        run = compare_shapes.train((name, setting, bound, batch, seed,
                                    n_epochs, WARMUP_EPOCHS))
    run['setting'] = setting
    return run


def _key(run):
    return run['optimizer'], run['setting'], run['batch'], run['seed']


def reused_runs():
    """``compare_shapes.py``'s MomentumSGD runs with this script's recipe
    at a batch (its default variant), seeds below ``SEEDS``."""
    kept = (harness.read_variant('compare_shapes') or {}).get('runs', [])
    return [dict(r, setting=r['base_lr']) for r in kept
            if r['optimizer'] == 'sgd' and r['seed'] < SEEDS
            and r['batch'] in BATCHES and r['epochs'] == epochs(r['batch'])
            and r['warmup_epochs'] == WARMUP_EPOCHS]


def best_settings(runs):
    """``{(batch, row): (setting, its runs)}`` of the rows of :data:`ROWS`:
    the setting of the highest seed-0 final accuracy (the grids run seed
    0), the swaps at MomentumSGD's, and the runs there of seeds below
    ``SEEDS``."""
    runs = [r for r in runs if r['optimizer'] in ROWS]
    chosen = {}
    for run in runs:
        key = run['batch'], run['optimizer']
        final = run['curve'][-1]['val_accuracy']
        if run['seed'] == 0 and (key not in chosen or final > chosen[key][0]):
            chosen[key] = (final, run['setting'])
    best = {}
    for (batch, name), (_, setting) in chosen.items():
        if name in SWAPS:
            if (batch, 'sgd') not in chosen:
                continue
            setting = chosen[batch, 'sgd'][1]
        group = [r for r in runs if (r['batch'], r['optimizer'],
                                     r['setting']) == (batch, name, setting)
                 and r['seed'] < SEEDS]
        if group:
            best[batch, name] = (setting, group)
    return best


def summarise(runs):
    best = best_settings(runs)
    finals = {b: numpy.mean([r['curve'][-1]['val_accuracy'] for r in g])
              for (b, n), (_, g) in best.items() if n == 'sgd'}
    if not finals:
        return None
    top = max(finals, key=finals.get)
    target = finals[top] - 0.005
    rows = {}
    for (batch, name), (setting, group) in sorted(best.items()):
        reached = [compare_shapes._to_target(r, target) for r in group]
        rows.setdefault(name, {})[batch] = {
            'setting': setting, 'seeds': len(group), 'epoch_budget':
            group[0]['epochs'],
            'epochs': [e if ok else None for e, _, ok in reached],
            'median_epochs': compare_shapes._median(
                [e if ok else None for e, _, ok in reached]),
            'median_seconds': compare_shapes._median(
                [s if ok else None for _, s, ok in reached]),
            'final': [r['curve'][-1]['val_accuracy'] for r in group]}
    critical = {n: critical_batch(r) for n, r in rows.items()}
    return {'target': target, 'sgd_best_batch': top, 'rows': rows,
            'critical_batch': critical,
            'kfac_over_sgd': {b: kfac_over_sgd(rows, b) for b in sorted(
                rows.get('sgd', {}))},
            'critical_over_sgd': {
                n: critical[n] / critical['sgd'] for n in KFAC_ROWS
                if critical.get(n) and critical.get('sgd')},
            'largest_over_smallest': {n: largest_over_smallest(r)
                                      for n, r in rows.items()}}


def kfac_over_sgd(rows, batch):
    """``(ratio, bound)``: the better K-FAC row's median epochs to the
    target over MomentumSGD's at ``batch``; ``bound`` is ``'<'`` where
    MomentumSGD missed (its epoch budget is then a lower bound on its
    epochs, the ratio an upper bound); ``(None, '')`` where neither K-FAC
    row has reached the target (or run)."""
    kfac = min((rows[n][batch]['median_epochs'] for n in KFAC_ROWS
                if batch in rows.get(n, {})), default=math.inf)
    if not math.isfinite(kfac):
        return None, ''
    sgd = rows['sgd'][batch]
    if math.isfinite(sgd['median_epochs']):
        return kfac / sgd['median_epochs'], ''
    return kfac / sgd['epoch_budget'], '<'


def largest_over_smallest(row):
    """The median epochs to the target at the row's largest batch over
    those at its smallest (Table 1: 100 over 35); None unless both
    reached it."""
    largest = row[max(row)]['median_epochs']
    smallest = row[min(row)]['median_epochs']
    if math.isfinite(largest) and math.isfinite(smallest):
        return largest / smallest
    return None


def critical_batch(row):
    """The largest batch up to which the median epochs to the target stay
    within 1.5x of the row's smallest; None if they do not at its smallest
    batch (or it never reached the target)."""
    reached = {b: v['median_epochs'] for b, v in row.items()
               if math.isfinite(v['median_epochs'])}
    if not reached:
        return None
    least, critical = min(reached.values()), None
    for batch in sorted(row):
        if row[batch]['median_epochs'] > 1.5 * least:
            break
        critical = batch
    return critical


def report(summary):
    if summary is None:
        return 'no MomentumSGD runs yet'
    lines = ['Target {:.1%}: MomentumSGD\'s best final accuracy (at batch '
             '{}) less half a point. Per row: its best setting, epochs to '
             'the target per seed (`-`: missed), the final accuracy per '
             'seed; the median seconds to the target.'.format(
                 summary['target'], summary['sgd_best_batch']),
             '']
    batches = sorted({b for r in summary['rows'].values() for b in r})
    cells = []
    for batch in batches:
        cell = ['{} ({}, {})'.format(batch, N_TRAIN // batch,
                                     epochs(batch))]
        for name in ROWS:
            v = summary['rows'].get(name, {}).get(batch)
            cell.append('' if v is None else '{:g}: {} ({}); {}'.format(
                v['setting'], ', '.join('-' if e is None else str(e)
                                        for e in v['epochs']),
                ', '.join('{:.3f}'.format(f) for f in v['final']),
                '{:.0f} s'.format(v['median_seconds'])
                if math.isfinite(v['median_seconds']) else '-'))
        ratio, bound = summary['kfac_over_sgd'].get(batch, (None, ''))
        cell.append(compare_shapes._ratio_text(ratio, bound))
        cells.append(cell)
    lines.append(harness.table(cells, [
        'batch (steps an epoch, epochs)', 'MomentumSGD (base lr)',
        'paper\'s recipe (lr multiplier)',
        'kfac_swap_before, the defaults before (base lr)',
        'kfac_kl_step_adaptive, the one-line swap (base lr)',
        'kfac_kl_step_natural (base lr)',
        'better K-FAC / MomentumSGD (median epochs)']))
    critical = summary['critical_batch']
    lines += ['', 'Critical batch: ' + ', '.join(
        '{} {}'.format(n, critical.get(n)) for n in ROWS if n in critical)
        + '; over MomentumSGD\'s: ' + (', '.join(
            '{} {:g}'.format(n, r)
            for n, r in summary['critical_over_sgd'].items()) or '-')
        + '. Median epochs at the largest batch over those at the '
        'smallest: ' + ', '.join(
            '{} {}'.format(n, '-' if r is None else '{:.2f}'.format(r))
            for n, r in ((n, summary['largest_over_smallest'].get(n))
                         for n in ROWS if n in critical))
        + '.']
    return '\n'.join(lines)


def plot(summary, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, row in summary['rows'].items():
        batches = sorted(row)
        left.plot(batches, [row[b]['median_epochs'] for b in batches],
                  'o-', color=COLOURS[name], label=name)
        for b in batches:
            # Each seed that reached the target (the median line skips a
            # batch where half the seeds missed).
            done = [e for e in row[b]['epochs'] if e is not None]
            left.plot([b] * len(done), done, 'x', color=COLOURS[name])
        right.plot(batches, [numpy.mean(row[b]['final']) for b in batches],
                   'o-', color=COLOURS[name], label=name)
    left.set(xscale='log', yscale='log', xlabel='batch',
             ylabel='epochs to {:.1%} (x: each seed)'.format(
                 summary['target']))
    right.set(xscale='log', xlabel='batch', ylabel='final accuracy')
    for ax in (left, right):
        ax.set_xticks(BATCHES, [str(b) for b in BATCHES])
        ax.grid(alpha=0.3)
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write(runs, environment):
    summary = summarise(runs)
    text = report(summary)
    payload = {'script': 'table1', 'environment': environment,
               'summary': summary, 'table': text, 'runs': runs}
    if summary:
        plot(summary, os.path.join(harness.results_dir(), 'table1.png'))
        payload['plot'] = 'table1.png'
    harness.write_json('table1.json', payload)
    return text


def _grid(runs, name, batch, start):
    """Row ``name``'s seed-0 runs at ``batch``: the settings ``start``,
    and once they have run, the next doubling (halving) while the best is
    the largest (smallest), so that the best lies inside the grid."""
    finals = {r['setting']: r['curve'][-1]['val_accuracy'] for r in runs
              if (r['optimizer'], r['batch'], r['seed']) == (name, batch, 0)}
    settings = sorted(set(start) | set(finals))
    if set(settings) <= set(finals):
        top = max(finals, key=finals.get)
        if top == settings[-1]:
            settings.append(top * 2)
        elif top == settings[0]:
            settings.append(top / 2)
    return [(name, s, batch, 0) for s in settings]


def pending(runs, args, batches):
    """The grids' runs of ``args.rows`` not kept yet; with the grids done,
    the best settings' further seeds. Without ``sgd`` among the rows, the
    swaps take MomentumSGD's best setting as its kept grid has it."""
    best = best_settings(runs)
    done = {_key(r) for r in runs}
    specs = []
    for batch in batches:
        grid = _grid(runs, 'sgd', batch, args.lrs_sgd)
        specs += grid + _grid(runs, 'kfac_paper', batch, args.multipliers)
        if (batch, 'sgd') in best and (
                done.issuperset(grid) or 'sgd' not in args.rows):
            # The swap as a MomentumSGD user makes it: at the learning
            # rate tuned for MomentumSGD.
            specs += [(name, best[batch, 'sgd'][0], batch, 0)
                      for name in SWAPS]
    specs = [s for s in specs if s not in done and s[0] in args.rows]
    if specs:
        return specs
    return [(name, best[batch, name][0], batch, seed)
            for batch in batches for name in args.rows
            if (batch, name) in best for seed in range(SEEDS)
            if (name, best[batch, name][0], batch, seed) not in done]


def _floats(text):
    return [float(v) for v in text.split(',')]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--batches', default='64,128,256,512,1024,2048')
    parser.add_argument('--lrs-sgd', type=_floats, default='0.4,0.8,1.6')
    parser.add_argument('--multipliers', type=_floats, default='0.5,1,2',
                        help='kfac_paper\'s learning rates over the '
                        'configuration\'s')
    parser.add_argument('--rows', type=lambda t: t.split(','),
                        default=','.join(ROWS),
                        help='the rows to run (the others\' runs are read)')
    parser.add_argument('--jobs', type=int, default=1)
    parser.add_argument('--report', action='store_true')
    args = parser.parse_args(argv)
    runs = (harness.read_json('table1.json') or {}).get('runs', [])
    done = {_key(r) for r in runs}
    runs += [r for r in reused_runs() if _key(r) not in done]
    batches = [int(b) for b in args.batches.split(',')]
    environment = harness.environment()
    if args.report:
        print(write(runs, environment))
        return
    compare_shapes._DATA['data'] = shapes.load()
    with multiprocessing.get_context('fork').Pool(args.jobs) as pool:
        while True:
            specs = pending(runs, args, batches)
            if not specs:
                break
            print('{} runs to go'.format(len(specs)), flush=True)
            for run in pool.imap_unordered(train, specs):
                runs.append(run)
                print(run['optimizer'], run['setting'], run['batch'],
                      run['seed'], run['curve'][-1], flush=True)
                write(runs, environment)
    print(write(runs, environment))


if __name__ == '__main__':
    main()
