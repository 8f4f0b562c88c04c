"""Step time of K-FAC against MomentumSGD, with a per-stage breakdown.

    PYTHONPATH=. .venv/bin/python benchmarks/step_time.py --quick
    PYTHONPATH=. .venv/bin/python benchmarks/step_time.py \
        --models resnet50 --steps 120 --warmup 2        # the full run

Every configuration trains its own copy of the same model on the same
(random) batch; configurations are interleaved round-robin, one step each
per round in a new random order every round, so that a change in the
machine's load hits all of them alike and none always follows another.
The ratio KFAC/SGD is taken per round (each K-FAC step over the SGD step of
the same round), then its median and quartiles are reported.

Steps are classified by what K-FAC did in them:

    refresh   some inverse was recomputed (statistics too, when due)
    factors   statistics were folded into the factors, no inverse
    stale     neither: hooks idle, only preconditioning

The *amortised* step time weighs the median of each kind by how often that
kind occurs in the configuration's schedule over a long run (simulated with
the library's own ``RefreshSchedule``; for Adaptive, as observed). When the
timed window holds no step of a kind that the schedule needs (a run shorter
than the interval), the median of that kind is taken from a configuration
doing the same work, and the table marks it ``*``: a refresh step from
``kfac_1`` (statistics, inverses and preconditioning every step; its
``_subN`` or ``_bsubN`` variant for such a configuration); a factor step as
this configuration's stale step plus that ``kfac_1``'s statistics stage.
(``kfac_1`` keeps Cholesky factors, cheaper to form than the explicit
inverses of long intervals.) Long runs (``--steps`` at least the largest
interval) need no substitution.

Stage times come from the library's timing hook (``optimizer.stage_timer``,
:mod:`chainerkfac.timing`). Results: ``results/step_time.json`` (``--out
FILE``: that file), variant ``--name``.
"""
import argparse
import copy
import gc
import os
import sys
import re

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import numpy

import harness
import models as models_module
from chainerkfac import schedules
from chainerkfac import timing

#: The StaleFisher configuration starts at this iteration (its warm-up of
#: 500 iterations over, interval 1 + (t - 500) // 500 = 4 here).
STALE_FISHER_START = 2000


def _kfac(**kw):
    def make():
        kw2 = dict(lr=1e-3, momentum=0.9, damping=1e-3, factor_interval=1)
        kw2.update(kw)
        return chainerkfac.optimizers.KFAC(**kw2)
    return make


#: name -> (description, optimizer factory, first iteration or None)
CONFIGS = {
    'sgd': ('MomentumSGD',
            lambda: chainer.optimizers.MomentumSGD(lr=1e-3, momentum=0.9),
            None),
    'kfac_off': ('KFAC(precondition=False): the optimizer\'s own overhead',
                 _kfac(precondition=False), None),
    'kfac_1': ('K-FAC, refresh every step', _kfac(), None),
    'kfac_10_100': ('K-FAC, factors every 10, inverses every 100',
                    _kfac(factor_interval=10, inverse_interval=100), None),
    'kfac_adaptive_delay3': (
        'K-FAC, Adaptive() factors, inverses when changed, built in the '
        'background and used 3 steps later (inverse_delay=3)',
        _kfac(factor_interval=schedules.Adaptive(), inverse_interval=1,
              inverse_delay=3), None),
    'kfac_10_20': ('K-FAC, factors every 10, inverses every 20',
                   _kfac(factor_interval=10, inverse_interval=20), None),
    'kfac_10_20_delay3': (
        'K-FAC, factors every 10, inverses every 20, built in the '
        'background and used 3 steps later (inverse_delay=3)',
        _kfac(factor_interval=10, inverse_interval=20, inverse_delay=3),
        None),
    'kfac_50_50': ('K-FAC, factors and inverses every 50',
                   _kfac(factor_interval=50, inverse_interval=50), None),
    'kfac_stale_fisher': (
        'K-FAC, StaleFisher() for both, from iteration {}'.format(
            STALE_FISHER_START),
        _kfac(factor_interval=schedules.StaleFisher(),
              inverse_interval=schedules.StaleFisher()),
        STALE_FISHER_START),
    'kfac_adaptive': ('K-FAC, Adaptive() factors, inverses when changed',
                      _kfac(factor_interval=schedules.Adaptive(),
                            inverse_interval=1), None),
    'kfac_1_sub2': ('K-FAC, refresh every step, spatial_subsample=2',
                    _kfac(spatial_subsample=2), None),
    'kfac_10_100_sub2': ('K-FAC, factors every 10, inverses every 100, '
                         'spatial_subsample=2',
                         _kfac(factor_interval=10, inverse_interval=100,
                               spatial_subsample=2), None),
    'kfac_1_bsub4': ('K-FAC, refresh every step, batch_subsample=4',
                     _kfac(batch_subsample=4), None),
    'kfac_10_100_bsub4': ('K-FAC, factors every 10, inverses every 100, '
                          'batch_subsample=4',
                          _kfac(factor_interval=10, inverse_interval=100,
                                batch_subsample=4), None),
    'kfac_1_reduced': ("K-FAC, refresh every step, conv_factors='reduced'",
                       _kfac(conv_factors='reduced'), None),
    'kfac_10_100_reduced': ('K-FAC, factors every 10, inverses every 100, '
                            "conv_factors='reduced'",
                            _kfac(factor_interval=10, inverse_interval=100,
                                  conv_factors='reduced'), None),
    'kfac_adaptive_reduced': ('K-FAC, Adaptive() factors, inverses when '
                              "changed, conv_factors='reduced'",
                              _kfac(factor_interval=schedules.Adaptive(),
                                    inverse_interval=1,
                                    conv_factors='reduced'), None),
}

DEFAULT_CONFIGS = ['sgd', 'kfac_1', 'kfac_10_100', 'kfac_50_50',
                   'kfac_stale_fisher', 'kfac_adaptive', 'kfac_1_sub2',
                   'kfac_10_100_sub2']
KINDS = ('refresh', 'factors', 'stale')


def schedule_fractions(optimizer, start, horizon=1000):
    """Fraction of refresh / factor / stale steps over ``horizon`` steps
    from ``start``, simulated with the library's schedules."""
    fi = optimizer.factor_interval
    ii = optimizer.inverse_interval
    if any(isinstance(v, schedules.Adaptive) for v in fi.values()):
        return None
    sched = {k: schedules.RefreshSchedule(v) for k, v in fi.items()}
    inv = schedules.RefreshSchedule(ii)
    counts = dict.fromkeys(KINDS, 0)
    changed = False
    for step in range(start, start + horizon + 1):
        refreshed = False
        for s in sched.values():
            if s.due(step):
                s.mark(step)
                refreshed = True
        changed = changed or refreshed
        inverted = False
        if changed and inv.due(step):
            inv.mark(step)
            changed = False
            inverted = True
        if step == start:
            continue  # the first step, like the warm-up, refreshes all
        kind = 'refresh' if inverted else ('factors' if refreshed
                                           else 'stale')
        counts[kind] += 1
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}


class Runner:
    """One configuration: its model copy, optimizer and step records."""

    def __init__(self, name, model, make_optimizer, start, device=None,
                 sync_stages=False):
        self.name = name
        self.model = model
        self.device = device or chainer.get_device('@numpy')
        model.to_device(self.device)
        self.synchronize = harness.synchronizer(self.device)
        self.sync_stages = sync_stages
        self.optimizer = make_optimizer()
        self.optimizer.setup(model)
        self.start = start or 0
        self.optimizer.t = self.start
        self.records = []
        self.is_kfac = isinstance(self.optimizer,
                                  chainerkfac.optimizers.KFAC)

    def step(self, x, t, record):
        timer = timing.StageTimer(
            self.synchronize if self.sync_stages else None)
        opt = self.optimizer
        total = harness.timed_step(self.model, opt, x, t, timer,
                                   self.synchronize)
        if self.is_kfac and opt.use_kfac:
            kind = ('refresh' if timer.calls['inversion'] else
                    'factors' if timer.calls['statistics_fold'] else
                    'stale')
            state = sum(b.state_bytes() for b in opt.blocks)
        else:
            kind, state = 'sgd', 0
        if record:
            self.records.append({
                't': opt.t, 'kind': kind, 'total': total,
                'stages': timer.coarse(), 'fine': dict(timer.totals),
                'state_bytes': state})
        return total, kind


def _mean_stages(records):
    if not records:
        return None
    out = {}
    for key in harness.STAGES:
        out[key] = float(numpy.mean([r['stages'][key] for r in records]))
    out['total'] = float(numpy.mean([r['total'] for r in records]))
    return out


def _median_stages(records):
    out = {key: float(numpy.median([r['stages'][key] for r in records]))
           for key in harness.STAGES}
    out['total'] = float(numpy.median([r['total'] for r in records]))
    return out


def _mean_fine(records):
    keys = sorted({k for r in records for k in r['fine']})
    return {k: float(numpy.mean([r['fine'].get(k, 0.0) for r in records]))
            for k in keys}


def analyse(runners, sgd_name='sgd'):
    """Per-configuration summaries, amortised times and paired ratios."""
    by_name = {r.name: r for r in runners}
    sgd = by_name.get(sgd_name)
    sgd_times = [r['total'] for r in sgd.records] if sgd else None
    out = {}
    for runner in runners:
        recs = runner.records
        res = {'all': harness.summary([r['total'] for r in recs]),
               'kinds': {}, 'stages': {}, 'fine': {},
               'state_bytes': max([r['state_bytes'] for r in recs] or [0]),
               'first_iteration': runner.start,
               # Each step's (iteration, kind, seconds): where a refresh's
               # cost lands within the interval (inverse_delay).
               'per_step': [[r['t'], r['kind'], r['total']] for r in recs]}
        for kind in KINDS + ('sgd',):
            sel = [r for r in recs if r['kind'] == kind]
            if sel:
                res['kinds'][kind] = harness.summary(
                    [r['total'] for r in sel])
                res['stages'][kind] = _mean_stages(sel)
                res.setdefault('stages_median', {})[kind] = \
                    _median_stages(sel)
                res['fine'][kind] = _mean_fine(sel)
        if sgd_times and runner is not sgd:
            n = min(len(sgd_times), len(recs))
            ratios = [recs[i]['total'] / sgd_times[i] for i in range(n)]
            res['ratio_all'] = harness.summary(ratios)
            for kind in KINDS:
                sel = [recs[i]['total'] / sgd_times[i] for i in range(n)
                       if recs[i]['kind'] == kind]
                if sel:
                    res.setdefault('ratio_kinds', {})[kind] = \
                        harness.summary(sel)
        out[runner.name] = res

    for runner in runners:
        res = out[runner.name]
        if not runner.is_kfac or not runner.optimizer.use_kfac:
            continue
        fractions = schedule_fractions(runner.optimizer, runner.start + 1)
        observed = {k: sum(r['kind'] == k for r in runner.records)
                    for k in KINDS}
        n = sum(observed.values())
        if fractions is None:  # Adaptive: what happened is the schedule
            fractions = {k: v / n for k, v in observed.items()} if n else {}
            res['intervals_reached'] = {
                f: sorted({b.schedules[f].interval
                           for b in runner.optimizer.blocks
                           if f in b.schedules})
                for f in ('A', 'G', 'F')}
        res['fractions'] = fractions
        medians, substituted = {}, []
        for kind in KINDS:
            if kind in res['kinds']:
                medians[kind] = res['kinds'][kind]['median']
            elif fractions.get(kind, 0) > 0:
                base_res = out.get(_refresh_every_step(runner.name))
                stale = res['kinds'].get('stale')
                if kind == 'refresh' and base_res \
                        and 'refresh' in base_res['kinds']:
                    medians[kind] = base_res['kinds']['refresh']['median']
                    substituted.append(kind)
                elif kind == 'factors' and base_res and stale \
                        and 'refresh' in base_res['stages']:
                    medians[kind] = stale['median'] + \
                        base_res['stages']['refresh']['statistics']
                    substituted.append(kind)
        if all(k in medians for k, f in fractions.items() if f > 0):
            res['amortised'] = sum(f * medians[k]
                                   for k, f in fractions.items() if f > 0)
            res['substituted'] = substituted
            if sgd:
                res['amortised_ratio'] = res['amortised'] / \
                    out[sgd_name]['all']['median']
    return out


def _refresh_every_step(name):
    """The configuration doing the same work every step as ``name`` on its
    refresh steps: ``kfac_1``, with the same ``_subN`` / ``_bsubN`` /
    ``_reduced`` variant."""
    return 'kfac_1' + re.search(r'(_b?sub\d+|_reduced)*$', name).group()


def _ratio_cell(summ):
    if not summ:
        return '-'
    return '{:.2f} ({:.2f}-{:.2f})'.format(summ['median'], summ['p25'],
                                           summ['p75'])


def report(model_name, batch, results, configs):
    lines = ['### {} (batch {})'.format(
        models_module.DESCRIPTIONS.get(model_name, model_name), batch), '']
    rows = []
    for name in configs:
        res = results[name]
        stale = res['kinds'].get('stale')
        ratio = res.get('ratio_kinds', {}).get('stale') or \
            res.get('ratio_all')
        amort = res.get('amortised')
        mark = '*' if res.get('substituted') else ''
        rows.append([
            name,
            harness.fmt_spread(res['all']),
            harness.fmt_s(stale['median']) if stale else '-',
            harness.fmt_s(amort) + mark if amort else '-',
            '-' if name == 'sgd' else _ratio_cell(
                res.get('ratio_kinds', {}).get('stale')
                if stale else res.get('ratio_all')),
            '{:.2f}{}'.format(res['amortised_ratio'], mark)
            if 'amortised_ratio' in res else '-',
            '{:.2f}'.format(1 + res['work_estimate']['stale'])
            if 'work_estimate' in res else '-',
            harness.fmt_bytes(res['state_bytes']) if res['state_bytes']
            else '-',
        ] + ([harness.fmt_bytes(res['peak_device_bytes'])]
             if 'peak_device_bytes' in res else []) + [
            ' '.join('{}:{}'.format(k[0], v['n'])
                     for k, v in res['kinds'].items()),
        ])
        del ratio
    lines.append(harness.table(rows, [
        'config', 'median step (IQR)', 'stale step', 'amortised',
        'KFAC/SGD per round, stale or all (IQR)', 'amortised KFAC/SGD',
        'stale KFAC/SGD estimated by describe()', 'K-FAC state']
        + (['peak GPU memory'] if any(
            'peak_device_bytes' in results[n] for n in configs) else [])
        + ['steps timed']))
    lines += ['', 'Median time per stage (s), by kind of step (medians of '
              'each stage and of the total over the steps of that kind, so '
              'the stages need not add up to the total; JSON has means):',
              '']
    rows = []
    for name in configs:
        res = results[name]
        for kind, st in res.get('stages_median', res['stages']).items():
            rows.append([name, kind] + ['{:.4f}'.format(st[s])
                                        for s in harness.STAGES]
                        + ['{:.4f}'.format(st['total'])])
    lines.append(harness.table(rows, ['config', 'kind'] + list(
        harness.STAGES) + ['total']))
    return '\n'.join(lines)


def run_model(model_name, configs, steps, warmup, batch, seed,
              device=None, sync_stages=False):
    device = device or chainer.get_device('@numpy')
    factory, in_shape, n_classes = models_module.MODELS[model_name]
    rng = numpy.random.RandomState(seed)
    numpy.random.seed(seed)
    x = rng.standard_normal((batch,) + in_shape).astype(numpy.float32)
    t = rng.randint(0, n_classes, size=batch).astype(numpy.int32)
    prototype = factory()
    with chainer.using_config('train', False), \
            chainer.no_backprop_mode():
        prototype(x[:2])  # initialise lazily shaped parameters
    runners = []
    for name in configs:
        desc, make, start = CONFIGS[name]
        runners.append(Runner(name, copy.deepcopy(prototype), make, start,
                              device, sync_stages))
    x, t = device.send(x), device.send(t)
    order_rng = numpy.random.RandomState(seed + 1)
    for i in range(warmup + steps):
        # A new order every round: no configuration always runs right
        # after another's (allocator and cache effects of the predecessor).
        for k in order_rng.permutation(len(runners)):
            runner = runners[k]
            gc.collect()
            runner.step(x, t, record=i >= warmup)
        if i >= warmup:
            done = i - warmup + 1
            if done == 1 or done % max(1, steps // 5) == 0 or done == steps:
                times = ', '.join('{} {}'.format(
                    r.name, harness.fmt_s(r.records[-1]['total']))
                    for r in runners)
                print('  {} round {}/{}: {}'.format(
                    model_name, done, steps, times), flush=True)
    results = analyse(runners)
    for runner in runners:
        work = runner.optimizer.work_estimate() \
            if runner.is_kfac and runner.optimizer.use_kfac else None
        if work is not None and work.ratios() is not None:
            # describe()'s estimate: a stale step about 1 + stale times
            # the passes', a MomentumSGD step about one.
            results[runner.name]['work_estimate'] = dict(zip(
                ('stale', 'refresh'), work.ratios()))
    if device.xp is not numpy:
        peaks = peak_device_memory(prototype, configs, device, x, t)
        for name in configs:
            results[name]['peak_device_bytes'] = peaks[name]
    del prototype
    blocks = runners[-1].optimizer.blocks if runners[-1].is_kfac else []
    info = {'description': models_module.DESCRIPTIONS.get(
                model_name, model_name),
            'batch': batch, 'input_shape': list(in_shape),
            'n_params': int(sum(p.size for p in runners[0].model.params())),
            'n_blocks': len(blocks), 'steps': steps, 'warmup': warmup,
            'configs': {n: CONFIGS[n][0] for n in configs}}
    return info, results, runners


def peak_device_memory(prototype, configs, device, x, t, steps=2):
    """Most GPU memory each configuration holds in use during its first
    ``steps`` steps (the first refreshes every factor and inverse), one
    configuration at a time: its parameters, gradients, optimizer and K-FAC
    state and the step's temporaries, beyond the batch itself."""
    import cupy
    pool = cupy.get_default_memory_pool()
    peaks = {}
    for name in configs:
        _, make, start = CONFIGS[name]
        gc.collect()
        pool.free_all_blocks()
        with harness.DevicePeakMemory() as peak:
            runner = Runner(name, copy.deepcopy(prototype), make, start,
                            device=device)
            for _ in range(steps):
                runner.step(x, t, record=False)
            del runner
            gc.collect()
        peaks[name] = peak.bytes
    return peaks


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--models', default=None,
                        help='comma-separated, from: ' +
                        ', '.join(models_module.MODELS))
    parser.add_argument('--configs', default=','.join(DEFAULT_CONFIGS),
                        help='comma-separated, from: ' + ', '.join(CONFIGS))
    parser.add_argument('--steps', type=int, default=None,
                        help='timed rounds (one step of every config each)')
    parser.add_argument('--warmup', type=int, default=1,
                        help='untimed rounds first (the first refreshes all)')
    parser.add_argument('--batch', type=int, default=None,
                        help='batch size (default: per model, see models.py)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--quick', action='store_true',
                        help='small models, few steps: a few minutes')
    parser.add_argument('--threads', type=int, default=None,
                        help='BLAS threads (threadpoolctl); default: as is')
    parser.add_argument('--keep-freed-memory', action='store_true',
                        help='glibc keeps freed memory for reuse instead of '
                        'returning it (fresh pages are slow to fault in)')
    parser.add_argument('--device', default='@numpy',
                        help="Chainer device, e.g. '@cupy:0' for the first "
                        'GPU: steps are timed up to the end of their GPU '
                        'work, and the peak GPU memory of each config is '
                        'measured after the timed rounds')
    parser.add_argument('--sync-stages', action='store_true',
                        help='on a GPU, wait for its work at every stage '
                        'boundary: a true per-stage breakdown, but the '
                        'lost overlap of kernel launches inflates totals')
    harness.add_name_option(parser, 'step_time')
    parser.add_argument('--out', default=None,
                        help='keep the variant in this file instead (runs '
                        'kept elsewhere, e.g. by gpu/check.sh)')
    args = parser.parse_args(argv)
    device = chainer.get_device(args.device)
    device.use()
    harness.limit_threads(args.threads)
    if args.keep_freed_memory:
        harness.keep_freed_memory()

    if args.quick:
        model_names = args.models or 'small_cnn,resnet50_w4,mlp'
        steps = args.steps or 12
    else:
        model_names = args.models or 'small_cnn,resnet50_w4,mlp,resnet50'
        steps = args.steps or 110
    configs = args.configs.split(',')
    if configs[0] != 'sgd':
        configs = ['sgd'] + [c for c in configs if c != 'sgd']
    for c in configs:
        if c not in CONFIGS:
            parser.error('unknown config {!r}'.format(c))
    payload = {'script': 'step_time', 'argv': sys.argv[1:] if argv is None
               else argv, 'environment': harness.environment(device),
               'models': {}}
    texts = []
    for model_name in model_names.split(','):
        batch = args.batch or models_module.DEFAULT_BATCH[model_name]
        print('== {} (batch {}, {} timed rounds of {} configs) =='.format(
            model_name, batch, steps, len(configs)), flush=True)
        info, results, _ = run_model(model_name, configs, steps,
                                     args.warmup, batch, args.seed,
                                     device, args.sync_stages)
        text = report(model_name, batch, results, configs)
        print(text, flush=True)
        texts.append(text)
        payload['models'][model_name] = {'info': info, 'results': results,
                                         'table': text}
        path = harness.write_variant('step_time', args.name, payload,
                                     args.out)
    print('\nwritten', path)
    return payload


if __name__ == '__main__':
    main()
