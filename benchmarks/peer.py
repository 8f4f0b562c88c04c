"""The same step-time comparison for a peer: kfac-jax (JAX on the CPU).

    PYTHONPATH=. .venv/bin/python benchmarks/peer.py --quick

The first run creates ``benchmarks/.venv-peer`` (git-ignored) with
``python3 -m venv`` and installs ``kfac-jax``, ``optax`` and ``dm-haiku``
from PyPI there: the peer never enters the library's environment or its
dependencies. The script then re-runs itself in that environment
(``--worker``) and times, interleaved round-robin as ``step_time.py`` does,
optax's SGD with momentum 0.9 against ``kfac_jax.Optimizer`` (fixed
learning rate, momentum and damping; empirical Fisher, as chainerkfac's
statistics; curvature EMA 0.95) with curvature/inverse update periods
(1, 1), (10, 100) and (50, 50), on the same models and batches as
``step_time.py``: the small CNN (3 conv + BatchNorm + FC, 32x32, batch 128)
and the MLP (784-1024-1024-10, batch 128). Both optimizers' steps are
jitted; every step is waited for (``block_until_ready``).

Steps are classified by the periods (kfac-jax refreshes when its step
counter is a multiple of the period) and amortised over the schedule exactly
as in ``step_time.py``.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

VENV = os.path.join(HERE, '.venv-peer')
#: kfac-jax 0.0.8 (the newest) calls ``Primitive.get_bind_params`` the way
#: JAX <= 0.8 defines it; JAX 0.9 changed its return value
#: ("ValueError: too many values to unpack"), hence the pin.
PACKAGES = ['kfac-jax==0.0.8', 'jax==0.8.3', 'jaxlib==0.8.3', 'optax',
            'dm-haiku']
KINDS = ('refresh', 'factors', 'stale')
CONFIGS = {'kfac_1': (1, 1), 'kfac_10_100': (10, 100),
           'kfac_50_50': (50, 50)}


def ensure_venv():
    """Creates the peer's environment once; returns its python."""
    python = os.path.join(VENV, 'bin', 'python')
    marker = os.path.join(VENV, '.installed')
    if os.path.exists(marker):
        return python
    base = os.environ.get('PEER_PYTHON', 'python3')
    print('creating', VENV, 'and installing', ' '.join(PACKAGES), flush=True)
    subprocess.run([base, '-m', 'venv', VENV], check=True)
    subprocess.run([python, '-m', 'pip', 'install', '--quiet',
                    '--disable-pip-version-check'] + PACKAGES, check=True)
    with open(marker, 'w') as f:
        f.write(' '.join(PACKAGES) + '\n')
    return python


# -- worker (runs inside .venv-peer: JAX, no Chainer) -------------------------

def _models():
    import haiku as hk
    import jax
    import jax.numpy as jnp

    def small_cnn(x, is_training):
        for width, stride in ((64, 1), (128, 2), (256, 2)):
            x = hk.Conv2D(width, 3, stride=stride, padding='SAME',
                          with_bias=False)(x)
            x = hk.BatchNorm(True, True, decay_rate=0.9)(x, is_training)
            x = jax.nn.relu(x)
        return hk.Linear(10)(jnp.mean(x, axis=(1, 2)))

    def mlp(x, is_training):
        del is_training
        x = jax.nn.relu(hk.Linear(1024)(x))
        x = jax.nn.relu(hk.Linear(1024)(x))
        return hk.Linear(10)(x)

    return {'small_cnn': (small_cnn, (32, 32, 3), 128),
            'mlp': (mlp, (784,), 128)}


def worker(args):
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import kfac_jax
    import numpy
    import optax

    import harness

    fn, in_shape, batch = _models()[args.model]
    batch = args.batch or batch
    net = hk.transform_with_state(fn)
    rng = numpy.random.RandomState(args.seed)
    x = jnp.asarray(rng.standard_normal((batch,) + in_shape), jnp.float32)
    y = jnp.asarray(rng.randint(0, 10, batch))
    key = jax.random.PRNGKey(args.seed)
    params0, state0 = net.init(key, x, True)

    def loss_fn(params, state, batch_):
        xb, yb = batch_
        logits, new_state = net.apply(params, state, None, xb, True)
        kfac_jax.register_softmax_cross_entropy_loss(logits, yb)
        loss = optax.softmax_cross_entropy_with_integer_labels(
            logits, yb).mean()
        return loss, new_state

    # SGD with momentum (optax), jitted.
    sgd = optax.sgd(1e-3, momentum=0.9)

    @jax.jit
    def sgd_step(params, state, opt_state, batch_):
        (loss, new_state), grads = jax.value_and_grad(
            loss_fn, has_aux=True)(params, state, batch_)
        updates, opt_state = sgd.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_state, opt_state, \
            loss

    def fresh(tree):
        # kfac-jax donates its arguments' buffers: every runner gets copies.
        return jax.tree_util.tree_map(jnp.copy, tree)

    runners = {}
    sgd_state = sgd.init(params0)
    runners['sgd'] = {'params': fresh(params0), 'state': fresh(state0),
                      'opt': sgd_state, 'records': []}

    def make_kfac(periods):
        curv, inv = periods
        return kfac_jax.Optimizer(
            value_and_grad_func=jax.value_and_grad(loss_fn, has_aux=True),
            l2_reg=0.0,
            value_func_has_aux=False,
            value_func_has_state=True,
            use_adaptive_learning_rate=False,
            learning_rate_schedule=lambda step: 1e-3,
            use_adaptive_momentum=False,
            momentum_schedule=lambda step: 0.9,
            use_adaptive_damping=False,
            damping_schedule=lambda step: 1e-3,
            estimation_mode='fisher_empirical',
            curvature_ema=0.95,
            curvature_update_period=curv,
            inverse_update_period=inv,
            num_burnin_steps=0,
            multi_device=False,
        )

    for name in args.configs.split(','):
        opt = make_kfac(CONFIGS[name])
        key, sub = jax.random.split(key)
        params = fresh(params0)
        opt_state = opt.init(params, sub, (x, y), func_state=fresh(state0))
        runners[name] = {'kfac': opt, 'params': params,
                         'state': fresh(state0),
                         'opt': opt_state, 'records': [],
                         'periods': CONFIGS[name], 'step': 0}

    def run_step(name):
        r = runners[name]
        t0 = time.perf_counter()
        if name == 'sgd':
            r['params'], r['state'], r['opt'], loss = sgd_step(
                r['params'], r['state'], r['opt'], (x, y))
            jax.block_until_ready((r['params'], loss))
            kind = 'sgd'
        else:
            nonlocal key
            key, sub = jax.random.split(key)
            step = r['step']
            out = r['kfac'].step(r['params'], r['opt'], sub, batch=(x, y),
                                 func_state=r['state'], global_step_int=step)
            r['params'], r['opt'], r['state'], stats = out
            jax.block_until_ready((r['params'], r['opt']))
            curv, inv = r['periods']
            kind = ('refresh' if step % inv == 0 else
                    'factors' if step % curv == 0 else 'stale')
            r['step'] = step + 1
        return time.perf_counter() - t0, kind

    names = list(runners)
    # Warm-up: compile every branch (a refresh, a factor and a stale step).
    compile_time = {}
    for name in names:
        t0 = time.perf_counter()
        run_step(name)
        compile_time[name] = time.perf_counter() - t0
        print('compiled {} in {:.1f} s'.format(name, compile_time[name]),
              file=sys.stderr, flush=True)
    for i in range(args.warmup):
        for name in names:
            run_step(name)
    for i in range(args.steps):
        for name in names:
            if name == 'kfac_1' and i >= args.refresh_steps:
                continue  # on convolutions a kfac-jax refresh takes minutes
            dt, kind = run_step(name)
            runners[name]['records'].append({'total': dt, 'kind': kind})
        print('round {}/{}: {}'.format(i + 1, args.steps, ', '.join(
            '{} {:.3f}'.format(n, runners[n]['records'][-1]['total'])
            for n in names if runners[n]['records'])),
            file=sys.stderr, flush=True)
    sgd_times = [rec['total'] for rec in runners['sgd']['records']]
    results = {}
    sgd_median = harness.summary(sgd_times)['median']
    for name in names:
        recs = runners[name]['records']
        res = {'all': harness.summary([r['total'] for r in recs]),
               'kinds': {}, 'compile_and_first_step': compile_time[name]}
        for kind in KINDS + ('sgd',):
            sel = [r['total'] for r in recs if r['kind'] == kind]
            if sel:
                res['kinds'][kind] = harness.summary(sel)
        if name != 'sgd':
            ratios = [recs[i]['total'] / sgd_times[i]
                      for i in range(len(recs))]
            res['ratio_all'] = harness.summary(ratios)
            stale = [recs[i]['total'] / sgd_times[i]
                     for i in range(len(recs)) if recs[i]['kind'] == 'stale']
            if stale:
                res['ratio_stale'] = harness.summary(stale)
            curv, inv = runners[name]['periods']
            fractions = {'refresh': 1 / inv,
                         'factors': 1 / curv - 1 / inv,
                         'stale': 1 - 1 / curv}
            medians, substituted = {}, []
            for kind in KINDS:
                if kind in res['kinds']:
                    medians[kind] = res['kinds'][kind]['median']
                elif kind == 'refresh' and fractions[kind] > 0 \
                        and 'kfac_1' in results:
                    # (1, 1) does the same work every step.
                    medians[kind] = \
                        results['kfac_1']['kinds']['refresh']['median']
                    substituted.append(kind)
            if all(k in medians for k, f in fractions.items() if f > 0):
                res['amortised'] = sum(f * medians[k]
                                       for k, f in fractions.items()
                                       if f > 0)
                res['amortised_ratio'] = res['amortised'] / sgd_median
                res['substituted'] = substituted
            res['fractions'] = fractions
        results[name] = res
    with open(args.worker_out, 'w') as f:
        json.dump({'model': args.model, 'batch': batch,
                   'jax': jax.__version__, 'kfac_jax': getattr(
                       kfac_jax, '__version__', 'unknown'),
                   'devices': [str(d) for d in jax.devices()],
                   'results': results}, f, indent=1)


# -- launcher (runs in the project's .venv) -----------------------------------

def report(raw):
    import harness
    rows = []
    for name, res in raw['results'].items():
        stale = res['kinds'].get('stale')
        mark = '*' if res.get('substituted') else ''
        rows.append([
            name,
            harness.fmt_spread(res['all']),
            harness.fmt_s(stale['median']) if stale else '-',
            (harness.fmt_s(res['amortised']) + mark)
            if 'amortised' in res else '-',
            '-' if name == 'sgd' else '{:.2f} ({:.2f}-{:.2f})'.format(
                *(lambda s: (s['median'], s['p25'], s['p75']))(
                    res.get('ratio_stale') or res['ratio_all'])),
            '{:.2f}{}'.format(res['amortised_ratio'], mark)
            if 'amortised_ratio' in res else '-',
            harness.fmt_s(res['compile_and_first_step']),
        ])
    return '### kfac-jax {} (JAX {}), {} batch {}\n\n'.format(
        raw['kfac_jax'], raw['jax'], raw['model'], raw['batch']) + \
        harness.table(rows, ['config', 'median step (IQR)', 'stale step',
                             'amortised', 'KFAC/SGD per round, stale or '
                             'all (IQR)', 'amortised KFAC/SGD',
                             'compile + first step'])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--worker', action='store_true',
                        help=argparse.SUPPRESS)
    parser.add_argument('--worker-out', help=argparse.SUPPRESS)
    parser.add_argument('--models', default='small_cnn,mlp')
    parser.add_argument('--model', help=argparse.SUPPRESS)
    parser.add_argument('--configs', default=','.join(CONFIGS))
    parser.add_argument('--batch', type=int, default=None)
    parser.add_argument('--steps', type=int, default=None)
    parser.add_argument('--warmup', type=int, default=2)
    parser.add_argument('--refresh-steps', type=int, default=None,
                        help='timed steps of kfac_1 (default: --steps; '
                        'small_cnn --quick: 2)')
    parser.add_argument('--seed', type=int, default=0)
    parser.add_argument('--threads', type=int, default=None,
                        help='1: single-threaded XLA CPU (default: as is)')
    parser.add_argument('--quick', action='store_true')
    parser.add_argument('--timeout', type=int, default=None,
                        help='seconds per model (default 3600; 900 quick)')
    parser.add_argument('--out', default='peer.json')
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 12 if args.quick else 110
    if args.refresh_steps is None:
        args.refresh_steps = args.steps
    if args.timeout is None:
        args.timeout = 900 if args.quick else 3600
    if args.worker:
        return worker(args)

    import harness
    payload = {'script': 'peer', 'argv': sys.argv[1:], 'models': {}}
    try:
        python = ensure_venv()
    except (subprocess.CalledProcessError, OSError) as e:
        payload['error'] = 'could not create the peer environment: {}'\
            .format(e)
        print(payload['error'])
        harness.write_json(args.out, payload)
        return payload
    env = dict(os.environ)
    env.pop('PYTHONPATH', None)
    env['JAX_PLATFORMS'] = 'cpu'
    if args.threads == 1:
        env['XLA_FLAGS'] = ('--xla_cpu_multi_thread_eigen=false '
                            'intra_op_parallelism_threads=1')
    texts = []
    for model in args.models.split(','):
        out = os.path.join(harness.results_dir(), '.peer_{}.json'.format(
            model))
        cmd = [python, os.path.abspath(__file__), '--worker',
               '--worker-out', out, '--model', model, '--configs',
               args.configs, '--steps', str(args.steps), '--warmup',
               str(args.warmup), '--seed', str(args.seed),
               '--refresh-steps', str(args.refresh_steps)]
        if args.quick and model == 'small_cnn':
            # A kfac-jax refresh of the CNN takes over a minute here (the
            # first step of every configuration is one): time one, and the
            # factor-only step 10 of (10, 100); (50, 50) is left out.
            cmd[cmd.index('--refresh-steps') + 1] = '1'
            cmd[cmd.index('--warmup') + 1] = '0'
            cmd[cmd.index('--steps') + 1] = '11'
            cmd[cmd.index('--configs') + 1] = 'kfac_1,kfac_10_100'
        if args.batch:
            cmd += ['--batch', str(args.batch)]
        print('== kfac-jax on', model, flush=True)
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True,
                                  text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired as e:
            err = 'timed out after {} s; last output: {}'.format(
                args.timeout, (e.stderr or b'')[-2000:].decode(
                    'utf-8', 'replace') if isinstance(e.stderr, bytes)
                else (e.stderr or '')[-2000:])
            print(err)
            payload['models'][model] = {'error': err}
            continue
        if proc.returncode != 0:
            err = (proc.stderr or proc.stdout)[-4000:]
            print(err)
            payload['models'][model] = {'error': err}
            continue
        with open(out) as f:
            raw = json.load(f)
        os.remove(out)
        text = report(raw)
        print(text, flush=True)
        texts.append(text)
        raw['table'] = text
        payload['models'][model] = raw
    payload['tables'] = texts
    print('written', harness.write_json(args.out, payload))
    return payload


if __name__ == '__main__':
    main()
