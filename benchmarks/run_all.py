"""Regenerates every benchmark (``--quick`` by default) and docs/benchmarks.md.

    PYTHONPATH=. .venv/bin/python benchmarks/run_all.py            # quick
    PYTHONPATH=. .venv/bin/python benchmarks/run_all.py --full     # hours
    PYTHONPATH=. .venv/bin/python benchmarks/run_all.py --docs-only

Runs ``step_time``, ``time_to_accuracy`` and ``distributed`` one after
another (each writes its JSON under ``benchmarks/results/``: the
first two their default variant), then rewrites ``docs/benchmarks.md``
from those JSON files and the other variants of ``step_time.json`` and
``time_to_accuracy.json``: the tables, the plots (copied to
``docs/benchmarks_figures/``, which keeps no other) and the exact
commands; then appends ``benchmarks/tuning_measurements.md`` (measurements
run by hand, written with links relative to ``docs/``).
``--skip NAME,...`` keeps a script's previous JSON.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import harness  # NOQA: E402  (imports chainerkfac first)

SCRIPTS = ('step_time', 'time_to_accuracy', 'distributed')
PREFIX = 'PYTHONPATH=. .venv/bin/python benchmarks/'
DOC = os.path.join(ROOT, 'docs', 'benchmarks.md')
FIGURES = os.path.join(ROOT, 'docs', 'benchmarks_figures')
#: The time-to-accuracy tasks shown, ``(variant, task)``, and their rows:
#: MomentumSGD, the defaults (the row's name in those runs) and, on MNIST,
#: ``kfac`` at factors every 10 steps and inverses every 100.
TTA_SHOWN = (('kl_graft_batch', 'digits'), (harness.DEFAULT, 'mnist'))
TTA_ROWS = ('sgd', 'kfac_adaptive_kl_step', 'kfac_adaptive_kl_step_before',
            'kfac')
#: The rows of ``compare_shapes.py`` shown, in this order: MomentumSGD,
#: K-FAC tuned by hand and the one-line swap at the defaults (the other
#: rows stay in its JSON and in the measurements).
SHAPES_ROWS = ('sgd', 'kfac_reference', 'kfac_kl_step_adaptive',
               'kfac_swap_before')
#: The rows of ``doubly_factored.py``'s training shown: MomentumSGD and
#: the defaults with the doubly-factored fc1, at the bound of the batch
#: and at the one of the run's length.
DOUBLY_ROWS = ('sgd', 'kfac_doubly_kl_step_adaptive',
               'kfac_doubly_swap_before', 'kfac_doubly_kl_run')


def commands(full):
    flag = '' if full else ' --quick'
    return {name: PREFIX + name + '.py' + flag for name in SCRIPTS}


def run(name, command):
    print('\n#', command, flush=True)
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        [ROOT] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep)
                  if p])
    args = command.split()[1:]  # drop PYTHONPATH=.
    args[0] = sys.executable
    t0 = time.time()
    proc = subprocess.run(args, cwd=ROOT, env=env)
    print('# {} took {:.0f} s (exit {})'.format(name, time.time() - t0,
                                                proc.returncode), flush=True)
    return proc.returncode


def command_of(name, payload):
    """The command line that wrote ``payload`` (the JSON of ``name``)."""
    return ' '.join([PREFIX + name + '.py'] + payload.get('argv', []))


def load(name):
    """The JSON of script ``name`` (one run, no variants)."""
    return harness.read_json(name + '.json')


# -- figures ------------------------------------------------------------------

def stage_figure(step, path):
    """Stacked bars: median seconds per stage, per configuration and kind."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    model_names = list(step['models'])
    fig, axes = plt.subplots(1, len(model_names),
                             figsize=(5.5 * len(model_names), 4.2),
                             squeeze=False)
    colors = dict(zip(harness.STAGES, ('#4c72b0', '#55a868', '#c44e52',
                                       '#8172b2', '#ccb974', '#64b5cd',
                                       '#999999')))
    for ax, model in zip(axes[0], model_names):
        res = step['models'][model]['results']
        labels, bars = [], []
        for cfg, r in res.items():
            for kind, st in r.get('stages_median', r['stages']).items():
                if kind == 'factors':
                    continue
                labels.append('{}\n{}'.format(cfg.replace('kfac_', 'K '),
                                              kind))
                bars.append(st)
        bottom = [0.0] * len(bars)
        for stage in harness.STAGES:
            vals = [b[stage] for b in bars]
            if not any(vals):
                continue
            ax.bar(range(len(bars)), vals, bottom=bottom, label=stage,
                   color=colors[stage])
            bottom = [a + b for a, b in zip(bottom, vals)]
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(labels, rotation=60, fontsize=7, ha='right')
        ax.set_ylabel('seconds per step (median per stage)')
        ax.set_title(step['models'][model]['info'].get('description', model),
                     fontsize=9)
        ax.grid(axis='y', alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- the document -------------------------------------------------------------

def _env_line(payload):
    env = payload.get('environment', {})
    blas = env.get('blas') or []
    threads = ', '.join(sorted({'{} {} threads'.format(
        b.get('internal_api'), b.get('num_threads')) for b in blas}))
    load_avg = env.get('load_average')
    commit = env.get('commit')
    return ('Python {}, NumPy {}, Chainer {}, {} CPUs ({}); load average '
            'at the start {}; glibc malloc: {}{}.'.format(
                env.get('python'), env.get('numpy'), env.get('chainer'),
                env.get('cpus'), threads or 'BLAS unknown',
                ', '.join('{:.1f}'.format(v) for v in load_avg)
                if load_avg else 'unknown',
                env.get('allocator', {}).get('glibc', 'default'),
                '; code at commit {}'.format(commit) if commit else ''))


def write_doc(full):
    step = harness.read_variant('step_time')
    shapes = harness.read_variant('compare_shapes')
    dist = load('distributed')
    os.makedirs(FIGURES, exist_ok=True)
    cmds = commands(full)
    lines = [
        '# Benchmarks',
        '',
        'Generated by `benchmarks/run_all.py` from the JSON files in '
        '`benchmarks/results/`; do not edit by hand. Regenerate with',
        '',
        '```',
        PREFIX + 'run_all.py' + ('' if not full else ' --full'),
        '```',
        '',
        'which runs, from the repository root:',
        '',
        '```',
    ] + [cmds[n] for n in SCRIPTS] + [
        '```',
        '',
        'These numbers come from a shared 2-core CPU machine: the '
        'configurations of each table run interleaved (round-robin, one '
        'step each) so that changes of load hit all alike, and every time '
        'is a median with its quartiles. Quick mode times few steps: '
        'treat differences under about 20% as noise.',
        '',
    ]
    if step:
        lines += ['## Step time: K-FAC against MomentumSGD', '',
                  'Command: `{}`'.format(command_of('step_time', step)), '',
                  _env_line(step), '',
                  'Configurations: ' + '; '.join(
                      '`{}` {}'.format(k, v) for k, v in next(iter(
                          step['models'].values()))['info'][
                              'configs'].items()) + '.', '',
                  'Stale step: median of the steps that refreshed nothing. '
                  'Amortised: the median of each kind of step (refresh, '
                  'factors only, stale) weighted by how often the '
                  'schedule runs it over 1,000 steps; `*` marks a kind '
                  'not seen in the timed window and taken from `kfac_1` '
                  '(see `benchmarks/step_time.py`). KFAC/SGD per round: '
                  'each K-FAC step over the SGD step of the same round.', '']
        import step_time
        for model, entry in step['models'].items():
            lines += [step_time.report(model, entry['info']['batch'],
                                       entry['results'],
                                       list(entry['results'])), '']
        fig = os.path.join(FIGURES, 'step_time_stages.png')
        stage_figure(step, fig)
        lines += ['![Time per stage](benchmarks_figures/'
                  'step_time_stages.png)', '']
    tta = [(task, harness.read_variant('time_to_accuracy', variant))
           for variant, task in TTA_SHOWN]
    tta = [(task, v['tasks'][task]) for task, v in tta
           if v and task in v['tasks']]
    if tta:
        lines += ['## Time to accuracy', '',
                  'Medians over the seeds of the best learning rate of each '
                  'grid; wall-clock counts training steps only. '
                  '`kfac_adaptive_kl_step` is `KFAC(lr, momentum)` at '
                  'the defaults, `kfac_adaptive_kl_step_before` the '
                  'defaults before `kl_graft`\'s KL change grew like the '
                  'batch, `kfac` (MNIST) the defaults with factors every 10 '
                  'steps and inverses every 100.', '']
        for task, entry in tta:
            lines += _tta_task(task, entry, TTA_ROWS)
    lines += _shapes_section(shapes)
    lines += _polyak_section(load('polyak_shapes'))
    lines += _doubly_factored_section(load('doubly_factored'))
    lines += _table1_section(load('table1'))
    lines += _float16_section(load('float16'))
    if dist:
        lines += ['## Distributed', '',
                  'Command: `{}`'.format(command_of('distributed', dist)), '',
                  _env_line(dist), '',
                  'Model `{}`, factors and inverses every {} steps, '
                  '`.venv/bin/mpiexec -n P`. Stage times: median over steps '
                  'of the slowest rank / of the mean rank. With 4 ranks the '
                  '2 cores are oversubscribed: read the bytes and the '
                  'per-rank split, not the wall time.'.format(
                      dist['model'], dist['interval']), '']
        lines += [t for t in dist['tables'] for t in (t, '')]
    lines += ['## Measurements behind the guides', '',
              'The measurements run by hand, which the tuning guide and '
              'the options page cite, with the figures of the rules and '
              'defaults measured before the current ones: '
              '[the measurements](measurements.md) '
              '(`benchmarks/tuning_measurements.md`). What the removed '
              'step rules and options measured, in a sentence each (the '
              'code at commit 291bae8):', '',
              '- `graft` (each layer as long as SGD\'s step) and '
              '`graft_average` (the same over running averages, the '
              'default before): the best one-line swap at 78 steps an '
              'epoch and more, behind the paper\'s recipe from 39 down '
              'and 1 point below MomentumSGD at 9;',
              '- `noise_cap` (a cap at the natural step of the learning '
              'rate the gradient\'s noise sets): with damping 1e-3 sooner '
              'to the target on the shapes task but 1.8-2.5 points lower '
              'at the end, slower on the digits;',
              '- `kl_clip_relative` (the bound relative to the run\'s '
              'smallest step): let one run in five diverge at lr 1.0 on '
              'the CNN with BatchNorm;',
              '- `backtrack` (undo a step whose loss jumped): stopped the '
              'suite\'s diverging runs without the bound, never acted on '
              'the shapes task;',
              '- `kl_clip_batch` (growth like `B²` from 64, to at most '
              '0.64) and `kl_clip_follows_lr=False`: the bound of the '
              'grafted step, which the step of fixed KL change replaced.',
              '']
    text = '\n'.join(lines).rstrip() + '\n'
    with open(DOC, 'w') as f:
        f.write(text)
    # The folder holds the figures of this document only.
    for name in os.listdir(FIGURES):
        if 'benchmarks_figures/' + name not in text:
            os.remove(os.path.join(FIGURES, name))
    print('written', DOC)


def _tta_task(task, entry, rows):
    """The table, command, settings and plot of one time-to-accuracy
    task, its rows ``rows`` only."""
    import time_to_accuracy
    png = entry['plot']
    shutil.copy(os.path.join(harness.results_dir(), png),
                os.path.join(FIGURES, png))
    _, best = time_to_accuracy.best_of(entry)
    optimizers = [o for o in rows if any(o == name for _, name in best)]
    return [time_to_accuracy.report(task, entry['target'], entry['batches'],
                                    optimizers, best), '',
            'Command: `{}`'.format(command_of('time_to_accuracy', entry)),
            '',
            _env_line(entry), '',
            '{} seeds, at most {} iterations, {} training and {} validation '
            'samples, learning rates {}, K-FAC intervals (factors, inverses) '
            '{} (`kfac_adaptive`: the default adaptive intervals).'.format(
                entry['seeds'], entry['max_iter'], entry['n_train'],
                entry['n_val'], entry.get('lr_grid'),
                tuple(entry['kfac_intervals'])), '',
            '![{}](benchmarks_figures/{})'.format(task, png), '']


def _shapes_section(shapes):
    """The harder task of ``compare_shapes.py``: the rows of
    :data:`SHAPES_ROWS`, its recipe and curves."""
    if not shapes:
        return []
    import compare_shapes
    png = shapes['plot']
    shutil.copy(os.path.join(harness.results_dir(), png),
                os.path.join(FIGURES, png))
    recipe = shapes['recipe']
    summary, _ = compare_shapes.summarise(
        [r for r in shapes['runs'] if r['optimizer'] in SHAPES_ROWS])
    return [
        '## Harder task: K-FAC against a tuned large-batch MomentumSGD', '',
        'Command: `{0}compare_shapes.py --batches B --lrs-sgd ... '
        '--reference ... --seeds S --jobs 2` (runs accumulate across '
        'invocations; the script\'s docstring says what each row is). '
        'Generated colour images ({1}: 10 classes, '
        '24x24), model {2}; every row with the same recipe: learning rate '
        '{3}, momentum {4}, weight decay {5}, {6} epochs ({7} of warm-up). '
        '`kfac_kl_step_adaptive` is the one-line swap, '
        '`KFAC(lr, momentum)` at the defaults, and `kfac_swap_before` '
        'the defaults before `kl_graft`\'s KL change grew like the '
        'batch, at '
        'MomentumSGD\'s best base learning rate (its row the best of its '
        'grid); `kfac_reference` K-FAC tuned by hand (the natural step, '
        'damping 1e-3, factors every step, no bound). Seconds count '
        'training steps only, two runs at a time on the 2 cores (read '
        'differences under about 15% as noise).'.format(
            PREFIX, recipe['data'], recipe['model'], recipe['lr'],
            recipe['momentum'], recipe['weight_decay'], recipe['epochs'],
            recipe['warmup_epochs']),
        '', _env_line(shapes), '',
        compare_shapes.report(summary, SHAPES_ROWS), '',
        '![shapes](benchmarks_figures/{})'.format(png), '']


def _polyak_section(polyak):
    """The live model against its Polyak averages (``polyak_shapes.py``)."""
    if not polyak or not polyak.get('table'):
        return []
    run = polyak['runs'][0]
    return [
        '## Polyak averaging on the harder task', '',
        'Command: `{}polyak_shapes.py --decays {} --seeds {} --jobs 2`. '
        'The recipe of the section above ({}), at batch {}, base learning '
        'rate {:g} for both optimizers (MomentumSGD\'s best there when '
        'these runs were made, on one seed; on four it is 0.8, '
        '[the measurements](measurements.md#momentumsgds-learning-rate-at-'
        'batch-256-on-four-seeds)), {} '
        'epochs; each run evaluates its live model and '
        '`chainerkfac.PolyakAveraging` averages of its parameters and '
        'BatchNorm statistics at each decay (per step) after every '
        'epoch. The line below describes the last invocation.'.format(
            PREFIX, ','.join(str(d) for d in run['decays']),
            max(r['seed'] for r in polyak['runs']) + 1, polyak['recipe'],
            run['batch'], run['base_lr'], run['epochs']),
        '', _env_line(polyak), '', polyak['table'], '']


def _doubly_factored_section(payload):
    """The doubly-factored block against ``A ⊗ G`` (``doubly_factored.py``):
    its cost on one wide Linear, and training a VGG-style network."""
    if not payload:
        return []
    import doubly_factored
    lines = ['## Doubly-factored block of a large-input Linear', '']
    cost = payload.get('cost')
    if cost:
        lines += [
            'Command: `{}doubly_factored.py {}`. One Linear on ReLU\'d '
            'feature maps (512 outputs, then a 10-way Linear), batch 256, '
            'factors and inverses every step, one BLAS thread; median of '
            '{} steps. "holds": the factors, the sums kept for the next '
            'statistics and the inverses (`state_bytes`); the standard '
            'block above 9,216 inputs is counted from its shapes, not '
            'run.'.format(PREFIX, ' '.join(cost.get('argv', ['cost'])),
                          cost['steps']),
            '', _env_line(cost), '', doubly_factored.cost_table(cost), '']
    summary = payload.get('summary')
    if summary:
        lines += [
            'Commands: `{0}doubly_factored.py train --optimizers ROWS '
            '--lrs-kfac ... --seeds ... --jobs 2` (runs accumulate across '
            'invocations), MomentumSGD\'s grid by `{0}doubly_factored.py '
            'train --optimizers sgd --jobs 2` (seed 0) and `--optimizers '
            'sgd --seeds 1 --lrs-sgd 0.05` (a second seed). '
            '`doubly_factored.VGGStyle` (six 3x3 conv+BN layers, '
            'max-pooling, fc1 on the 256x6x6 map: 9,216 inputs) on 8,000 '
            'shapes images, 10 epochs, the recipe of compare_shapes.py; '
            '`kfac_doubly_kl_step_adaptive` the defaults with '
            '`doubly_factored_from=8192` (`kl_clip` 2e-3 at batch 256), '
            '`kfac_doubly_kl_run` the latter with the KL change per step '
            'that the run\'s length sets (`compare_shapes.KL_BUDGET` / 310 '
            'steps = 0.01; [the measurements](measurements.md#the-step-of-'
            'fixed-kl-change-on-every-benchmark)); the rows of options '
            'since removed stay in its JSON and the measurements. '
            'Target {1:.1%}: '
            'MomentumSGD\'s best final accuracy over its grid minus 0.5 '
            'point; "epochs to target" per seed, `-` where a run missed '
            'it. The line below describes the last invocation.'.format(
                PREFIX, summary['target']),
            '', _env_line({'environment': payload.get(
                'train_environment', {})}), '',
            doubly_factored.train_table(dict(summary, rows=[
                r for r in summary['rows'] if r['optimizer'] in DOUBLY_ROWS])),
            '']
    return lines


def _table1_section(payload):
    """The paper's Table 1 in miniature (``table1.py``)."""
    if not payload or not payload.get('summary'):
        return []
    shutil.copy(os.path.join(harness.results_dir(), payload['plot']),
                os.path.join(FIGURES, payload['plot']))
    return [
        '## The paper\'s Table 1 in miniature', '',
        'Command: `{}table1.py --batches B --jobs 2` (runs accumulate '
        'across invocations; the script\'s docstring says what each row '
        'is). compare_shapes.py\'s task and model; batch `B` stands '
        'for the paper\'s `64 B` and runs its configuration scaled to '
        'this task. The line below describes the last invocation.'.format(
            PREFIX), '', _env_line(payload), '', payload['table'], '',
        '![table1](benchmarks_figures/{})'.format(payload['plot']), '']


def _float16_section(f16):
    """K-FAC on half-precision models (``float16.py``)."""
    if not f16:
        return []
    rows = ['| precision | validation accuracy | points from float32 | '
            'validation loss | skipped steps | final loss scale |',
            '|---|---|---|---|---|---|']
    for name, run in f16['runs'].items():
        rows.append('| {} | {:.3f} | {:+.1f} | {:.3f} | {} | {:g} |'.format(
            name, run['val_accuracy'], run['points_from_float32'],
            run['val_loss'], run['skipped'], run['final_loss_scale'] or 1))
    return [
        '## Half precision', '',
        'Command: `{}float16.py`. The digits CNN with BatchNorm, batch {}, '
        '`KFAC(lr={}, momentum=0.9)` with its defaults but factors every '
        'step, {} steps, the same '
        'weights and batches at each precision. Goal: {}: {}.'.format(
            PREFIX, f16['batch'], f16['lr'], f16['iterations'], f16['goal'],
            'met' if f16['met'] else 'not met'),
        '', _env_line(f16), ''] + rows + ['']


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--full', action='store_true')
    parser.add_argument('--docs-only', action='store_true')
    parser.add_argument('--skip', default='')
    args = parser.parse_args(argv)
    failed = []
    if not args.docs_only:
        skip = set(filter(None, args.skip.split(',')))
        for name, command in commands(args.full).items():
            if name in skip:
                continue
            if run(name, command) != 0:
                failed.append(name)
    write_doc(args.full)
    if failed:
        print('failed:', ', '.join(failed))
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
