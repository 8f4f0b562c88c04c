"""Polyak averaging on the shapes task: the averaged model against the live.

    PYTHONPATH=. .venv/bin/python benchmarks/polyak_shapes.py --jobs 2
    PYTHONPATH=. .venv/bin/python benchmarks/polyak_shapes.py --report

Ba, Grosse & Martens (2017, §6) evaluate an exponential average of the
parameters and of BatchNorm's statistics. Each run here trains like
``compare_shapes.py`` (its recipe and code: ``compare_shapes.train``) and
keeps :class:`chainerkfac.PolyakAveraging` averages at every ``--decays``
value beside the live model; after every epoch it evaluates the live model
and each average on the 5,000 validation images. MomentumSGD (``sgd``) and
the one-line swap (``kfac_kl_step_adaptive``, compare_shapes.py's row of
the defaults) train at the same base learning rate, MomentumSGD's best on
compare_shapes.py (1.6 at batch 256).

The report gives, per optimizer and model (``live``, ``avg 0.99``, ...):
the final accuracy and loss, the accuracy at half the epochs, the median
epochs to MomentumSGD's live final accuracy less 0.5 point, and what
folding the averages cost. Runs are kept in ``results/polyak_shapes.json``
as they end, not repeated.
"""
import argparse
import multiprocessing
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import numpy

import compare_shapes
import harness
import shapes

OUT = 'polyak_shapes.json'
OPTIMIZERS = ('sgd', 'kfac_kl_step_adaptive')


def _key(run):
    return (run['optimizer'], run['base_lr'], run['batch'], run['seed'],
            run['epochs'], tuple(run['decays']))


def model_curve(run, model):
    """The run's curve of ``model``: ``'live'``, or a decay's average."""
    if model == 'live':
        return run['curve']
    return [dict(point, **point['averaged'][model]) for point in
            run['curve']]


def targets(runs):
    """``{label: accuracy}``: MomentumSGD's live final accuracy in these
    runs minus 0.5 point, and compare_shapes.py's target at the same batch
    (its best learning rate over its seeds), when its results are there."""
    sgd = [r for r in runs if r['optimizer'] == 'sgd']
    found = {'these runs': float(numpy.mean(
        [r['curve'][-1]['val_accuracy'] for r in sgd]) - 0.005)}
    shapes_summary = (harness.read_variant('compare_shapes') or {}).get(
        'summary', {}).get(str(runs[0]['batch']))
    if shapes_summary:
        found['compare_shapes'] = shapes_summary['target']
    return found


def _to_target(curves, target):
    reached = [compare_shapes._to_target({'curve': c}, target)
               for c in curves]
    return {'median': compare_shapes._median([e for e, _, _ in reached]),
            'bounded': 2 * sum(not ok for _, _, ok in reached)
            >= len(reached),
            'per_seed': [e if ok else None for e, _, ok in reached]}


def summarise(runs):
    """``{'targets': ..., 'rows': [...]}``: per optimizer and model, the
    final accuracy and loss, the accuracy after half the epochs (means
    over seeds), and the epochs to each target (median and per seed)."""
    if not any(r['optimizer'] == 'sgd' for r in runs):
        return None
    goals = targets(runs)
    rows = []
    for name in OPTIMIZERS:
        group = [r for r in runs if r['optimizer'] == name]
        if not group:
            continue
        for model in ['live'] + [str(d) for d in group[0]['decays']]:
            curves = [model_curve(r, model) for r in group]
            rows.append({
                'optimizer': name,
                'model': model if model == 'live' else 'avg ' + model,
                'seeds': len(group),
                'final_accuracy': float(numpy.mean(
                    [c[-1]['val_accuracy'] for c in curves])),
                'final_val_loss': float(numpy.mean(
                    [c[-1]['val_loss'] for c in curves])),
                'mid_accuracy': float(numpy.mean(
                    [c[len(c) // 2 - 1]['val_accuracy'] for c in curves])),
                'to_target': {label: _to_target(curves, goal)
                              for label, goal in goals.items()}})
    return {'targets': goals, 'rows': rows}


def _epochs_text(entry):
    return '{}{:g} ({})'.format(
        '> ' if entry['bounded'] else '', entry['median'], ', '.join(
            '-' if e is None else str(e) for e in entry['per_seed']))


def report(summary, runs):
    run = runs[0]
    goals = summary['targets']
    lines = ['### shapes, batch {batch}, base lr {base_lr:g}, {epochs} '
             'epochs\n'.format(**run)]
    lines.append(harness.table([
        [r['optimizer'], r['model'], str(r['seeds']),
         '{:.3f}'.format(r['final_accuracy']),
         '{:.3f}'.format(r['final_val_loss']),
         '{:.3f}'.format(r['mid_accuracy'])]
        + [_epochs_text(r['to_target'][label]) for label in goals]
        for r in summary['rows']],
        ['optimizer', 'model', 'seeds', 'final val accuracy',
         'final val loss', 'val accuracy at mid-run']
        + ['epochs to {:.1%} ({})'.format(goal, label)
           for label, goal in goals.items()]))
    lines.append('')
    lines.append(
        'Targets: MomentumSGD\'s final accuracy minus 0.5 point, of its '
        'live model in these runs (mean over seeds) and, where given, of '
        'compare_shapes.py at this batch (its best learning rate). Epochs '
        'to a target: the median over seeds, then each seed\'s (`-`: '
        'missed); `>`: half the seeds or more missed, and a miss counts as '
        'its whole run, so the median is a lower bound. Mid-run: after '
        'epoch {}, mean over seeds.'.format(run['epochs'] // 2))
    cost = numpy.mean([r['curve'][-1]['averaging_seconds']
                       / r['curve'][-1]['seconds'] for r in runs])
    lines.append('')
    lines.append('Folding the {} averages after every step took {:.2%} of '
                 'the training steps\' time (mean over runs).'.format(
                     len(run['decays']), cost))
    return '\n'.join(lines)


def write(runs, environment, out=OUT):
    summary = summarise(runs)
    text = report(summary, runs) if summary else ''
    payload = {'script': 'polyak_shapes', 'environment': environment,
               'recipe': 'compare_shapes.train: base_lr * batch / 256, '
                         'linear warm-up, cosine decay to 0, momentum 0.9, '
                         'weight decay {}; averages: chainerkfac.'
                         'PolyakAveraging at each decay, folded after '
                         'every step'.format(compare_shapes.WEIGHT_DECAY),
               'summary': summary, 'table': text, 'runs': runs}
    return harness.write_json(out, payload), text


def train(spec):
    """``compare_shapes.train`` with the decays, which the run records."""
    decays, spec = spec[0], spec[1:]
    run = compare_shapes.train(spec, decays)
    run['decays'] = list(decays)
    return run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--batch', type=int, default=256)
    parser.add_argument('--lr', type=float, default=1.6,
                        help='base lr of both optimizers')
    parser.add_argument('--decays', default='0.99,0.998')
    parser.add_argument('--seeds', type=int, default=2)
    parser.add_argument('--epochs', type=int, default=20)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--jobs', type=int, default=1)
    parser.add_argument('--out', default=OUT)
    parser.add_argument('--report', action='store_true')
    args = parser.parse_args(argv)
    decays = tuple(float(d) for d in args.decays.split(','))
    previous = harness.read_json(args.out) or {}
    runs = previous.get('runs', [])
    if args.report:
        # The environment is that of the invocation that ran the runs.
        print(write(runs, previous.get('environment'), args.out)[1])
        return
    environment = harness.environment()
    kl_clip = compare_shapes.KL_STEP_CLIP
    done = {_key(r) for r in runs}
    specs = [(decays, name, args.lr, None if name == 'sgd' else kl_clip,
              args.batch, seed, args.epochs, args.warmup)
             for seed in range(args.seeds) for name in OPTIMIZERS]
    specs = [s for s in specs if (s[1], s[2], s[4], s[5], s[6], decays)
             not in done]
    compare_shapes._DATA['data'] = shapes.load()
    print('{} runs to go, {} kept'.format(len(specs), len(runs)), flush=True)
    with multiprocessing.get_context('fork').Pool(args.jobs) as pool:
        for run in pool.imap_unordered(train, specs):
            runs.append(run)
            last = run['curve'][-1]
            print('{optimizer} seed {seed}: live {live:.3f}, '.format(
                live=last['val_accuracy'], **run) + ', '.join(
                    'avg {} {:.3f}'.format(d, v['val_accuracy'])
                    for d, v in last['averaged'].items()), flush=True)
            path, text = write(runs, environment, args.out)
    print(text)
    print('written', path)


if __name__ == '__main__':
    main()
