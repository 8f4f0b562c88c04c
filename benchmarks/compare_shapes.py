"""K-FAC against a tuned large-batch MomentumSGD on a harder image task.

    PYTHONPATH=. .venv/bin/python benchmarks/compare_shapes.py \\
        --batches 1024 --kl-step-adaptive 0.4 --jobs 2  # grid and swap
    PYTHONPATH=. .venv/bin/python benchmarks/compare_shapes.py --report

The task is :mod:`shapes` (20,000 training and 5,000 validation colour
images, 24x24, ten classes); the model is ``models.TinyResNet`` (a stem and
two residual blocks, all with BatchNorm). Every optimizer trains with the
large-batch recipe of Goyal et al. (2017): the learning rate scaled
linearly with the batch (``lr = base_lr · B / 256``), a linear warm-up over
the first ``--warmup`` epochs, cosine decay to zero at the end, weight
decay 5e-4 (Chainer's ``WeightDecay`` hook, for both), momentum 0.9.
MomentumSGD runs a grid of base learning rates (``--lrs-sgd``) times
``--seeds`` seeds at each batch; each K-FAC row below runs the base
learning rates its option gives, typically MomentumSGD's best, with the
same seeds.

Rows at ``LRS``: ``--reference`` K-FAC tuned by hand (``kfac_reference``:
the natural step, damping 1e-3, factors every step, no bound);
``--kl-step-adaptive`` the defaults (``kfac_kl_step_adaptive``, the
one-line swap ``KFAC(lr, momentum)``: the bound ``5e-4 · B / 64``, following
the schedule's square, sets the step at MomentumSGD's learning rates);
``--swap-before`` the defaults before ``kl_graft``'s KL change grew like
the batch (``kfac_swap_before``); ``--kl-run`` the defaults at the KL change
per step ``KL_BUDGET / T`` of a run of ``T`` steps (``kfac_kl_run``).
``--quadratic-model`` adds ``step_rule='adaptive'`` (``kfac_quadratic_model``:
step length, momentum and damping from the loss's quadratic model, Martens &
Grosse 2015 §6-7; no learning rate, no bound; damping from 1e-2), and
``kfac_quadratic_model_floor``, its damping kept at 1e-3 or more. A run that
blows up (``NonFiniteError``) ends at that epoch.

Each run is kept in ``results/compare_shapes.json`` as it ends, in its
variant ``--name`` (``--out FILE``: in that file), and not repeated (runs of
rows no longer here stay, out of the report). ``--report`` (also at the end
of every invocation) gives, per batch, MomentumSGD's best final accuracy
(mean over seeds) and the target it sets (that less 0.5 point), and for
each optimizer at its best learning rate the median epochs and seconds to
the target, its final accuracy and validation loss; the curves go to
``results/compare_shapes[_<name>].png``.
"""
import argparse
import functools
import math
import multiprocessing
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import chainer.functions as F
import numpy

import harness
import models
import shapes

WEIGHT_DECAY = 5e-4
#: The step of fixed KL change's options with the default adaptive
#: intervals (the defaults, named so that a script with intervals of its
#: own gets them too); its rows differ in the bound alone
#: (``guard_options``).
_KL_STEP_ADAPTIVE = {
    'damping': 1e-3, 'factor_interval': chainerkfac.schedules.Adaptive(),
    'inverse_interval': 1, 'step_rule': 'kl_graft'}


class KLGraftBefore(chainerkfac.step_rule.KLGraft):
    """``kl_graft`` as the defaults had it before its KL change grew like
    the batch: at every batch the grafted step's KL change as at ``B₀``."""

    def scales(self, sums, batch=None):
        return super().scales(sums)


#: name -> K-FAC options; ``sgd`` is MomentumSGD.
OPTIMIZERS = {
    'sgd': None,
    # K-FAC tuned by hand: the natural step, damping 1e-3,
    # factors every step, no bound.
    'kfac_reference': {'factor_interval': 1, 'step_rule': 'natural',
                       'damping': 1e-3},
    # The defaults.
    'kfac_kl_step_adaptive': _KL_STEP_ADAPTIVE,
    # The defaults with the natural rule: the natural direction at the
    # bound's KL change wherever the natural step at lr is longer.
    'kfac_kl_step_natural': dict(_KL_STEP_ADAPTIVE, step_rule='natural'),
    # The defaults before kl_graft's KL change grew like the batch.
    'kfac_swap_before': dict(_KL_STEP_ADAPTIVE,
                             step_rule=KLGraftBefore),
    # The same with the KL change per step that the run's length sets:
    # KL_BUDGET over its steps (guard_options).
    'kfac_kl_run': _KL_STEP_ADAPTIVE,
    # The step length, momentum and damping from the loss's quadratic model
    # (kfac-jax's adaptive mode): no learning rate, no bound; the damping
    # starts at 1e-2 (the default when these rows were measured).
    'kfac_quadratic_model': {'step_rule': 'adaptive', 'damping': 1e-2},
    # The same with the damping kept at 1e-3 or more (a class: each run
    # gets a rule of its own).
    'kfac_quadratic_model_floor': {
        'step_rule': functools.partial(
            chainerkfac.optimizers.quadratic_model.QuadraticModel,
            min_damping=1e-3),
        'damping': 1e-2},
}
#: The rows of the report and the plot.
ROWS = tuple(OPTIMIZERS)
#: A row's colour in the plot (every row has one: a run must not end in a
#: KeyError after its training).
COLOURS = dict(zip(ROWS, ('tab:blue', 'navy', 'olive', 'purple', 'grey',
                          'teal', 'darkred', 'salmon')))
assert len(COLOURS) == len(ROWS)
#: The defaults' bound at batch 64: the reference's KL estimate at the
#: schedule's peak was about 0.002 at batch 256.
KL_STEP_CLIP = 5e-4


def guard_options(name, kl_clip, batch, steps=None):
    """The bound's option of row ``name``'s K-FAC at global batch
    ``batch``: ``kl_clip``, the bound at batch 64, which the library grows
    like ``B`` and moves with the schedule's square; ``kfac_kl_run``'s is
    ``kl_clip`` (the budget) over the run's ``steps`` at every batch."""
    if name == 'kfac_kl_run':
        return {'kl_clip': kl_clip / steps
                * chainerkfac.step_rule.REFERENCE_BATCH / batch}
    return {'kl_clip': kl_clip}


#: The same step of fixed KL change in terms of the run's length: the KL
#: change per step times the run's steps, ``5e-4 · B / 64 · 20 ⌊20,000 /
#: B⌋``, is 3.04-3.12 at batches 256-1024 here; a run of ``T`` steps
#: takes ``KL_BUDGET / T`` a step (``kfac_kl_run``).
KL_BUDGET = 3.1


def kl_step_options(batch, name='kfac_kl_step_adaptive', steps=None):
    """The K-FAC options of row ``name`` (``kfac_kl_step_adaptive``;
    ``kfac_kl_run``, whose bound needs the run's ``steps``;
    ``kfac_swap_before``, whose rule is a class: each call gets an instance
    of its own) at global batch ``batch``, for the other benchmarks that
    measure the same rows."""
    if name == 'kfac_kl_run' and steps is None:
        raise ValueError('kfac_kl_run\'s bound needs the run\'s steps')
    budget = KL_BUDGET if name == 'kfac_kl_run' else KL_STEP_CLIP
    options = dict(OPTIMIZERS[name],
                   **guard_options(name, budget, batch, steps))
    if callable(options['step_rule']):
        options['step_rule'] = options['step_rule']()
    return options


_DATA = {}


def schedule_factor(iteration, total, warmup):
    """Linear warm-up over ``warmup`` iterations, then cosine decay to 0;
    the factor applied to the learning rate at ``iteration`` (from 0)."""
    if iteration < warmup:
        return (iteration + 1) / warmup
    progress = (iteration - warmup) / max(1, total - warmup)
    return 0.5 * (1 + math.cos(math.pi * progress))


def evaluate(model, x, y):
    """Validation ``(accuracy, loss)``."""
    correct, loss = 0, 0.0
    with chainer.using_config('train', False), chainer.no_backprop_mode():
        for i in range(0, len(x), 1000):
            scores = model(x[i:i + 1000])
            correct += int((scores.array.argmax(axis=1)
                            == y[i:i + 1000]).sum())
            loss += float(F.softmax_cross_entropy(
                scores, y[i:i + 1000], reduce='no').array.sum())
    return correct / len(x), loss / len(x)


def train(spec, decays=(), schedule=None, options=None):
    """One run: ``spec`` = (optimizer, base lr, K-FAC's ``kl_clip`` (None
    for MomentumSGD), batch, seed, epochs, warm-up epochs). Returns its
    per-epoch curve. ``options`` replaces the row's K-FAC options
    (``OPTIMIZERS``; ``guard_options`` still sets the bound);
    ``schedule(iteration)``, when given, returns the
    optimizer's hyperparameters for that step (``lr`` and any others:
    ``momentum``, ``damping``) in place of the large-batch recipe's.
    With Polyak averaging ``decays``
    (:class:`chainerkfac.PolyakAveraging`, one average per decay), each
    epoch also evaluates the model under each average: the curve's
    ``averaged`` maps ``str(decay)`` to its accuracy and loss. A K-FAC
    run's curve also says, per epoch, how often the bound on the step's KL
    change cut the step (``guard``: the fraction of steps whose
    ``kfac/update_scale`` ν was below 1, and the median ν); under the
    quadratic model, its median α, μ and damping (``quadratic_model``)."""
    name, base_lr, kl_clip, batch, seed, epochs, warmup_epochs = spec
    harness.limit_threads(1)
    harness.keep_freed_memory()
    (x_tr, y_tr), (x_val, y_val) = _DATA['data']
    numpy.random.seed(seed)
    model = models.TinyResNet(10)
    lr = base_lr * batch / 256
    steps = len(x_tr) // batch
    total, warmup = steps * epochs, steps * warmup_epochs
    if options is None:
        options = OPTIMIZERS[name]
    if options is not None and callable(options.get('step_rule')):
        options = dict(options, step_rule=options['step_rule']())
    if options is None:
        optimizer = chainer.optimizers.MomentumSGD(lr=lr, momentum=0.9)
    else:
        # The run records the spec's kl_clip, not guard_options' of it.
        optimizer = chainerkfac.optimizers.KFAC(
            lr=lr, momentum=0.9,
            **dict(options, **guard_options(name, kl_clip, batch, total)))
    # The quadratic model's step needs the loss: update(classifier, x, t).
    net = chainer.links.Classifier(model) if options is not None and \
        optimizer.step_rule.chooses_update else model
    optimizer.setup(net)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(WEIGHT_DECAY))
    reporter = chainer.Reporter()
    reporter.add_observer('main', net)
    averages = {str(d): chainerkfac.PolyakAveraging(model, d)
                for d in decays}
    rng = numpy.random.RandomState(seed)
    curve, wall, it, averaging_wall = [], 0.0, 0, 0.0
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(x_tr))
        scales, chosen = [], []
        for k in range(steps):
            idx = order[k * batch:(k + 1) * batch]
            if schedule is None:
                optimizer.lr = lr * schedule_factor(it, total, warmup)
            else:
                for key, value in schedule(it).items():
                    assert hasattr(optimizer, key), key
                    setattr(optimizer, key, value)
            observation = {}
            try:
                with reporter.scope(observation):
                    loss_value, seconds = harness.train_step(
                        net, optimizer, x_tr[idx], y_tr[idx])
            except chainerkfac.NonFiniteError:
                # A run that blows up ends here, its last epoch evaluated.
                loss_value = float('nan')
                break
            if 'kfac/update_scale' in observation:
                scales.append(float(observation['kfac/update_scale']))
            if 'kfac/alpha' in observation:
                chosen.append([float(observation[k]) for k in (
                    'kfac/alpha', 'kfac/mu', 'kfac/damping')])
            wall += seconds
            it += 1
            t0 = time.perf_counter()
            for averaging in averages.values():
                averaging.update()
            averaging_wall += time.perf_counter() - t0
        accuracy, val_loss = evaluate(model, x_val, y_val)
        curve.append({'epoch': epoch, 'seconds': wall,
                      'val_accuracy': accuracy, 'val_loss': val_loss,
                      'train_loss': loss_value})
        if scales:
            curve[-1]['guard'] = {
                'bound_steps': sum(v < 1 for v in scales) / len(scales),
                'median_update_scale': float(numpy.median(scales))}
        if chosen:
            curve[-1]['quadratic_model'] = dict(zip(
                ('median_alpha', 'median_mu', 'median_damping'),
                numpy.median(chosen, axis=0).tolist()))
        for decay, averaging in averages.items():
            with averaging.averaged():
                accuracy, val_loss = evaluate(model, x_val, y_val)
            curve[-1].setdefault('averaged', {})[decay] = {
                'val_accuracy': accuracy, 'val_loss': val_loss}
        if averages:
            curve[-1]['averaging_seconds'] = averaging_wall
        if not numpy.isfinite(loss_value):
            break
    return {'optimizer': name, 'base_lr': base_lr, 'kl_clip': kl_clip,
            'batch': batch, 'seed': seed, 'epochs': epochs,
            'warmup_epochs': warmup_epochs, 'curve': curve}


def _setting(run):
    """What the grid varies: the base lr, and K-FAC's bound."""
    return run['base_lr'], run['kl_clip']


def _setting_text(setting):
    lr, kl_clip = setting
    return 'lr {:g}'.format(lr) + (
        '' if kl_clip is None else ', kl_clip {:g}'.format(kl_clip))


def _key(run):
    return (run['optimizer'],) + _setting(run) + (
        run['batch'], run['seed'], run['epochs'])


def _median(values):
    values = sorted(float('inf') if v is None else v for v in values)
    return values[len(values) // 2] if len(values) % 2 else \
        0.5 * (values[len(values) // 2 - 1] + values[len(values) // 2])


def _to_target(run, target):
    """``(epochs, seconds, reached)`` at the first evaluation at or above
    target; a run that misses it gives its whole length, a lower bound."""
    for point in run['curve']:
        if point['val_accuracy'] >= target:
            return point['epoch'], point['seconds'], True
    last = run['curve'][-1]
    return last['epoch'], last['seconds'], False


def _keep_best(best, key, setting, group, final):
    old = best.get(key)
    if old is None or final > old['final_accuracy']:
        best[key] = {
            'setting': setting, 'runs': group, 'seeds': len(group),
            'final_accuracy': float(final),
            'final_val_loss': float(numpy.mean(
                [g['curve'][-1]['val_loss'] for g in group]))}


def summarise(runs):
    """Per batch: the target and, per optimizer, its best learning rate's
    figures (best: the highest mean final validation accuracy)."""
    groups = {}
    for run in runs:
        groups.setdefault((run['batch'], run['optimizer'], _setting(run)),
                          []).append(run)
    best = {}
    for (batch, name, setting), group in groups.items():
        final = numpy.mean([g['curve'][-1]['val_accuracy'] for g in group])
        _keep_best(best, (batch, name), setting, group, final)
    summary = {}
    for batch in sorted({b for b, _ in best}):
        sgd = best.get((batch, 'sgd'))
        if sgd is None:
            continue
        target = sgd['final_accuracy'] - 0.005
        rows = {}
        for (b, name), entry in best.items():
            if b != batch:
                continue
            reached = [_to_target(r, target) for r in entry['runs']]
            rows[name] = {
                'setting': _setting_text(entry['setting']),
                'seeds': entry['seeds'],
                'grid': {_setting_text(st): len(groups[batch, name, st])
                         for (bb, n, st) in sorted(
                             groups, key=lambda k: (k[0], k[1], k[2][0],
                                                    k[2][1] or 0))
                         if bb == batch and n == name},
                'final_accuracy': entry['final_accuracy'],
                'final_val_loss': entry['final_val_loss'],
                # Misses count as their whole run: when half the seeds or
                # more miss, the median is a lower bound ('bounded').
                'epochs_to_target': _median([e for e, _, _ in reached]),
                'seconds_to_target': _median([s for _, s, _ in reached]),
                'bounded': 2 * sum(not ok for _, _, ok in reached)
                >= len(reached),
                'reached': '{}/{}'.format(
                    sum(ok for _, _, ok in reached), len(reached))}
        summary[batch] = {'target': target, 'optimizers': rows}
    return summary, best


def ratio_to_sgd(row, sgd, key):
    """``(ratio, bound)`` of ``row[key]`` over MomentumSGD's: ``bound`` is
    ``'<'`` when only MomentumSGD's median is a lower bound (the ratio is
    then an upper bound); ``ratio`` is None when K-FAC's is a bound."""
    if row['bounded']:
        return None, ''
    return row[key] / sgd[key], '<' if sgd['bounded'] else ''


def _ratio_text(ratio, bound):
    return '-' if ratio is None else '{}{:.2f}'.format(
        bound + ' ' if bound else '', ratio)


def report(summary, rows=ROWS):
    """The tables of ``summary``, per batch, of the optimizers ``rows``
    (those without runs left out)."""
    lines = []
    for batch, entry in summary.items():
        cells = []
        sgd = entry['optimizers']['sgd']
        for name in rows:
            row = entry['optimizers'].get(name)
            if row is None:
                continue
            ratio = ['', ''] if name == 'sgd' else [
                _ratio_text(*ratio_to_sgd(row, sgd, k))
                for k in ('epochs_to_target', 'seconds_to_target')]
            more = '> ' if row['bounded'] else ''
            cells.append([name, row['setting'], '; '.join(
                '{} ({})'.format(st, n) for st, n in row['grid'].items()),
                str(row['seeds']),
                '{:.3f}'.format(row['final_accuracy']),
                '{:.3f}'.format(row['final_val_loss']),
                more + '{:g}'.format(row['epochs_to_target']),
                more + harness.fmt_s(row['seconds_to_target']),
                row['reached']] + ratio)
        lines.append('### batch {} (target {:.1%}: MomentumSGD\'s best final '
                     'accuracy - 0.5 point)\n'.format(batch, entry['target']))
        lines.append(harness.table(cells, [
            'optimizer', 'best setting', 'grid (seeds)', 'seeds',
            'final val accuracy', 'final val loss', 'median epochs to target',
            'median seconds to target', 'seeds reaching',
            'epochs vs SGD', 'seconds vs SGD']))
        lines.append('')
        lines.append('`>`: half the seeds or more missed the target, and a '
                     'miss counts as its whole run, so the median is a '
                     'lower bound; `<`: a ratio over such a bound, an '
                     'upper bound.')
        lines.append('')
    return '\n'.join(lines)


def plot(best, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    batches = sorted({b for b, _ in best})
    fig, axes = plt.subplots(len(batches), 4, squeeze=False,
                             figsize=(18, 4 * len(batches)))
    for row, batch in enumerate(batches):
        for name in ROWS:
            entry = best.get((batch, name))
            if entry is None:
                continue
            for k, run in enumerate(entry['runs']):
                c = run['curve']
                label = '{} ({})'.format(
                    name, _setting_text(entry['setting'])) if k == 0 else None
                for col, (x, y) in enumerate((
                        ('epoch', 'val_accuracy'), ('seconds', 'val_accuracy'),
                        ('epoch', 'val_loss'), ('seconds', 'val_loss'))):
                    axes[row, col].plot([p[x] for p in c], [p[y] for p in c],
                                        color=COLOURS[name], alpha=0.7,
                                        label=label)
        for col, (x, y) in enumerate((
                ('epoch', 'validation accuracy'),
                ('training seconds', 'validation accuracy'),
                ('epoch', 'validation loss'),
                ('training seconds', 'validation loss'))):
            ax = axes[row, col]
            ax.set(xlabel=x, ylabel=y, title='shapes, batch {}'.format(batch))
            ax.grid(alpha=0.3)
            if col in (2, 3):
                ax.set_yscale('log')
        axes[row, 0].legend(loc='lower right', fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def write(runs, environment, name=harness.DEFAULT, out=None):
    summary, best = summarise(runs)
    text = report(summary)
    payload = {'script': 'compare_shapes', 'environment': environment,
               'recipe': {'lr': 'base_lr * batch / 256, linear warm-up, '
                          'cosine decay to 0', 'momentum': 0.9,
                          'weight_decay': WEIGHT_DECAY,
                          'model': 'models.TinyResNet() (stem 8, '
                                   'blocks 16, 32)',
                          'data': 'shapes.load(20000, 5000)',
                          'epochs': ', '.join(sorted(
                              {str(r['epochs']) for r in runs})),
                          'warmup_epochs': ', '.join(sorted(
                              {str(r['warmup_epochs']) for r in runs}))},
               'summary': {str(b): v for b, v in summary.items()},
               'table': text, 'runs': runs}
    if best:
        # compare_shapes[_NAME].png in results/ (benchmarks/run_all.py
        # copies the default's into the docs), or beside --out's file.
        png = os.path.splitext(os.path.abspath(out))[0] + '.png' if out \
            else os.path.join(harness.results_dir(),
                              harness.stem('compare_shapes', name) + '.png')
        payload['plot'] = os.path.basename(png)
        plot(best, png)
    return harness.write_variant('compare_shapes', name, payload, out), text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--batches', default='1024')
    parser.add_argument('--lrs-sgd', default='0.1,0.2,0.4,0.8')
    parser.add_argument('--seeds', type=int, default=3)
    parser.add_argument('--epochs', type=int, default=20)
    parser.add_argument('--warmup', type=int, default=2,
                        help='warm-up epochs')
    parser.add_argument('--reference', default=None,
                        help='base lrs of the natural step, damping 1e-3, '
                        'factors every step, no bound (kfac_reference)')
    parser.add_argument('--kl-step-adaptive', default=None,
                        help='base lrs of the defaults '
                        '(kfac_kl_step_adaptive)')
    parser.add_argument('--swap-before', default=None,
                        help='base lrs of the defaults before kl_graft\'s '
                        'KL change grew like the batch (kfac_swap_before)')
    parser.add_argument('--kl-run', default=None,
                        help='base lrs of the same with the KL change per '
                        'step that the run\'s length sets (kfac_kl_run: '
                        'KL_BUDGET over its steps)')
    parser.add_argument('--quadratic-model', action='store_true',
                        help='also K-FAC with the step length, momentum and '
                        'damping from the quadratic model '
                        "(kfac_quadratic_model: step_rule='adaptive', no "
                        'learning rate, no bound; kfac_quadratic_model_floor:'
                        ' its damping 1e-3 or more)')
    parser.add_argument('--jobs', type=int, default=1)
    harness.add_name_option(parser, 'compare_shapes')
    parser.add_argument('--out', default=None,
                        help='keep the variant in this file instead (a '
                        'path)')
    parser.add_argument('--report', action='store_true',
                        help='only summarise the stored runs')
    args = parser.parse_args(argv)
    previous = harness.read_variant('compare_shapes', args.name,
                                    args.out) or {}
    runs = previous.get('runs', [])
    environment = harness.environment()
    if args.report:
        print(write(runs, environment, args.name, args.out)[1])
        return
    done = {_key(r) for r in runs}
    batches = [int(b) for b in args.batches.split(',')]
    specs = [('sgd', float(lr), None, batch, seed, args.epochs, args.warmup)
             for seed in range(args.seeds) for batch in batches
             for lr in args.lrs_sgd.split(',') if lr]
    if args.quadratic_model:
        specs += [(name, 0.1, None, batch, seed, args.epochs, args.warmup)
                  for seed in range(args.seeds) for batch in batches
                  for name in ('kfac_quadratic_model',
                               'kfac_quadratic_model_floor')]
    for name, lrs, bound in (
            ('kfac_reference', args.reference, None),
            ('kfac_kl_step_adaptive', args.kl_step_adaptive, KL_STEP_CLIP),
            ('kfac_swap_before', args.swap_before, KL_STEP_CLIP),
            ('kfac_kl_run', args.kl_run, KL_BUDGET)):
        specs += [(name, float(lr), bound, batch, seed, args.epochs,
                   args.warmup)
                  for seed in range(args.seeds) for batch in batches
                  for lr in (lrs.split(',') if lrs else ())]
    specs = [s for s in specs if s[:6] not in done]
    _DATA['data'] = shapes.load()
    print('{} runs to go, {} kept'.format(len(specs), len(runs)), flush=True)
    with multiprocessing.get_context('fork').Pool(args.jobs) as pool:
        for run in pool.imap_unordered(train, specs):
            runs.append(run)
            last = run['curve'][-1]
            print('{} {} batch {batch} seed {seed}: '.format(
                run['optimizer'], _setting_text(_setting(run)), **run)
                + 'final accuracy {:.3f}, loss {:.3f}, {:.0f} s'.format(
                    last['val_accuracy'], last['val_loss'], last['seconds']),
                flush=True)
            path, text = write(runs, environment, args.name, args.out)
    print(text)
    print('written', path)


if __name__ == '__main__':
    main()
