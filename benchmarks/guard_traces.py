"""What a safety net with no scale would have to tell apart: the guard's ``q``
step by step on the convergence suite without the guard.

    PYTHONPATH=. .venv/bin/python benchmarks/guard_traces.py
    PYTHONPATH=. .venv/bin/python benchmarks/guard_traces.py --report
                                  # the criteria again, from the traces

The bound on the step's KL change (:mod:`chainerkfac.step_rule`) cuts a
step whose ``q = η² Σ_b ρ_b² ⟨V_b, g_b⟩`` (twice its estimated KL change)
is over a fixed ``κ``. A bound with no scale to tune would compare ``q`` with
something the run measures instead. This trains K-FAC with the guard off
(``kl_clip=None``, the defaults otherwise) on the suite's models, learning
rates and seeds (``convergence_suite.run``: the same weights and batches),
records each step's ``q`` and training loss, and asks of each criterion
below whether it would have bound:

- ``past_min_c``: ``q_t > c · min_{s<t} q_s``, the run's own smallest step
  so far (the learning rate is constant here);
- ``window3_c``: the same over the last 3 steps only;
- ``loss``: ``q_t`` over the step's training loss (a KL change larger than
  the distance to the labels);
- ``fixed_κ``: ``q_t > κ``, a fixed bound, for scale (the default is
  ``5e-4`` at batch 64).

A run's damage step is the first step, from the sixth on, whose loss is
not finite or is over twice the lowest before it and over 1. A run
diverges as the suite judges it (a non-finite value, or its last 10 losses
above its first); it is clean if it has no damage step and does not
diverge (a run damaged that recovers is neither). On clean runs a safety
net should bind on at most 1 % of the steps; on each diverging run it
should bind before the damage. The traces are of unguarded runs, so
binding before the damage is needed to stop a run, not proof that it
would.
Writes ``results/guard_traces.json``, as its variant ``--name``.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import numpy

import convergence_suite
import harness

SCRIPT = 'guard_traces'
FACTORS = (10, 100, 1000)
WINDOW = 3
#: Fixed bounds, for scale.
FIXED = (1e-3, 1e-2, 1e-1, 1.0)
#: A clean run's share of bound steps that a safety net may reach.
CLEAN_SHARE = 0.01


def _past_min(q, window=None):
    """``min_{s<t} q_s`` (over the last ``window`` steps), NaN before any
    finite positive ``q``."""
    out = numpy.full(len(q), numpy.nan)
    for t in range(1, len(q)):
        past = q[max(0, t - window):t] if window else q[:t]
        past = past[numpy.isfinite(past) & (past > 0)]
        if len(past):
            out[t] = past.min()
    return out


def criteria(loss, q):
    """``{name: per-step bool}``: where each criterion would bind."""
    with numpy.errstate(invalid='ignore'):
        result = {'fixed_{:g}'.format(k): q > k for k in FIXED}
        result['loss'] = q > loss
        for c in FACTORS:
            result['past_min_{}'.format(c)] = q > c * _past_min(q)
            result['window{}_{}'.format(WINDOW, c)] = \
                q > c * _past_min(q, WINDOW)
    return result


def damage_step(loss):
    """The first step from the sixth whose loss is not finite, or over
    twice the lowest before it and over 1; None if none."""
    lowest = numpy.inf
    for t, value in enumerate(loss):
        if t >= 5 and (not numpy.isfinite(value)
                       or (value > 2 * lowest and value > 1.0)):
            return t
        if numpy.isfinite(value):
            lowest = min(lowest, value)
    return None


def trace_run(model_name, lr, seed, data, iterations, batchsize):
    """One unguarded run: its suite figures and each step's loss and
    ``q`` (4 significant digits; ``None`` where not finite)."""
    trace = []
    figures = convergence_suite.run(
        model_name, lambda: chainerkfac.optimizers.KFAC(
            lr=lr, momentum=0.9, kl_clip=None),
        seed, iterations, batchsize, data, trace=trace)
    loss, q = ([float('{:.4g}'.format(v)) if numpy.isfinite(v) else None
                for v in values] for values in zip(*trace))
    return {'model': model_name, 'lr': lr, 'seed': seed,
            'diverged': figures['diverged'],
            'val_accuracy': figures['val_accuracy'], 'loss': loss, 'q': q}


def analyse(run):
    """A traced run's damage step, and each criterion's first binding
    step and share of steps."""
    loss, q = (numpy.array(run[k], dtype=float) for k in ('loss', 'q'))
    bound = {}
    for name, binds in criteria(loss, q).items():
        steps = numpy.flatnonzero(binds)
        bound[name] = {'first': int(steps[0]) if len(steps) else None,
                       'share': float(binds.mean())}
    return {'damage_step': damage_step(loss), 'criteria': bound}


def summarise(runs):
    """Per criterion: over clean runs, the largest share of bound steps
    and how many runs exceed :data:`CLEAN_SHARE`; over diverging runs,
    how many it binds before their damage step."""
    runs = [dict(analyse(r), diverged=r['diverged']) for r in runs]
    clean = [r for r in runs
             if not r['diverged'] and r['damage_step'] is None]
    diverging = [r for r in runs if r['diverged']]
    out = {}
    for name in runs[0]['criteria']:
        shares = [r['criteria'][name]['share'] for r in clean]
        caught = [r for r in diverging
                  if r['criteria'][name]['first'] is not None
                  and (r['damage_step'] is None
                       or r['criteria'][name]['first'] < r['damage_step'])]
        out[name] = {'clean_runs': len(clean),
                     'clean_max_share': max(shares) if shares else None,
                     'clean_over_1pc': sum(s > CLEAN_SHARE for s in shares),
                     'diverging_runs': len(diverging),
                     'caught_before_damage': len(caught)}
    return out


def report(payload):
    """The criteria's table, recomputed from the runs' traces."""
    payload['summary'] = summarise(payload['runs'])
    rows = [[name, s['clean_runs'], '{:.0%}'.format(s['clean_max_share']),
             s['clean_over_1pc'],
             '{} of {}'.format(s['caught_before_damage'],
                               s['diverging_runs'])]
            for name, s in payload['summary'].items()]
    return harness.table(rows, ['criterion', 'clean runs',
                                'most steps bound (clean)',
                                'clean runs over 1 %',
                                'diverging runs bound before damage'])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    harness.add_name_option(parser, SCRIPT)
    parser.add_argument('--models',
                        default=','.join(convergence_suite.MODELS))
    parser.add_argument('--lrs', default='0.01,0.03,0.1,0.3,1.0')
    parser.add_argument('--seeds', type=int, default=2)
    parser.add_argument('--iterations', type=int, default=200)
    parser.add_argument('--batchsize', type=int, default=64)
    parser.add_argument('--report', action='store_true')
    args = parser.parse_args()
    if args.report:
        payload = harness.read_variant(SCRIPT, args.name)
        text = report(payload)
        harness.write_variant(SCRIPT, args.name, payload)
        print(text)
        return
    harness.limit_threads(1)
    data = convergence_suite.load_digits()
    runs = []
    for model_name in args.models.split(','):
        for lr in (float(v) for v in args.lrs.split(',')):
            for seed in range(args.seeds):
                runs.append(trace_run(model_name, lr, seed, data,
                                      args.iterations, args.batchsize))
                print(model_name, lr, seed, 'diverged' if runs[-1]['diverged']
                      else 'did not diverge', flush=True)
    payload = {'iterations': args.iterations, 'batchsize': args.batchsize,
               'seeds': args.seeds, 'environment': harness.environment(),
               'runs': runs}
    text = report(payload)
    harness.write_variant(SCRIPT, args.name, payload)
    print(text)


if __name__ == '__main__':
    main()
