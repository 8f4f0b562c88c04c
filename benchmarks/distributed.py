"""Distributed K-FAC: time per stage and bytes per collective, and the
layer-to-rank load imbalance of ResNet-50.

    PYTHONPATH=. .venv/bin/python benchmarks/distributed.py --quick

runs, one after another, ``.venv/bin/mpiexec -n P`` for P in ``--ranks``
(1, 2, 4) on this script's worker mode, then the load-imbalance table (no
MPI). Each rank trains its own batch of the model (``--model``; default
ResNet-50 width/4 at 32x32, 107 blocks, so the cost model has something to
balance) with K-FAC under :func:`chainerkfac.create_multi_node_optimizer`
and the ``'naive'`` (MPI) communicator, factors and inverses refreshed every
``--interval`` steps. Per step and rank it records the stages (as in
``step_time.py``, from the library's timing hook; communication is the
communicator's collectives and the object collective of the step's
agreement, also apart as ``control``: the messages that carry no data)
and the bytes each collective handed to MPI (the
optimizer reports ``comm.reset_bytes_moved()`` as ``kfac/bytes/*`` every
step). Refresh and stale steps are reported apart; the per-rank inversion
and preconditioning times should fall as 1/P (model parallelism).

The machine has 2 cores: with 4 ranks they are oversubscribed, so only the
bytes, and the per-rank *work* split, are meaningful there, not the wall
time.

Split blocks: ``--split-model`` (default ``wide_mlp``, whose first layer
holds almost all the curvature work) then runs under ``mpiexec -n 2``
twice, with every block on one rank (``max_load_imbalance=None``) and with
the default splitting, one after the other; the per-rank inversion and
preconditioning times show whether sharing one block's preconditioning
evens out the ranks. The load-imbalance table gives, per refresh fraction,
the cost model's imbalance with one owner per block and with split blocks.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
import chainer
import numpy

from chainerkfac import timing
import harness
import models as models_module


def worker(args):
    import chainermn  # NOQA
    comm = chainerkfac.create_communicator('naive')
    factory, in_shape, n_classes = models_module.MODELS[args.model]
    numpy.random.seed(0)
    model = factory()
    rng = numpy.random.RandomState(100 + comm.rank)
    batch = args.batch or models_module.DEFAULT_BATCH[args.model]
    x = rng.standard_normal((batch,) + in_shape).astype(numpy.float32)
    t = rng.randint(0, n_classes, batch).astype(numpy.int32)
    with chainer.no_backprop_mode(), chainer.using_config('train', False):
        model(x[:2])
    opt = chainerkfac.optimizers.KFAC(
        lr=1e-3, momentum=0.9, damping=1e-3,
        factor_interval=args.interval, inverse_interval=args.interval)
    opt = chainerkfac.create_multi_node_optimizer(
        opt, comm, max_load_imbalance=_imbalance_option(
            args.max_load_imbalance))
    opt.setup(model)
    records = []
    for i in range(args.warmup + args.steps):
        timer = timing.StageTimer()
        observation = {}
        reporter = chainer.Reporter()
        comm.mpi_comm.Barrier()
        with reporter.scope(observation):
            total = harness.timed_step(model, opt, x, t, timer)
        step = opt.t
        if i < args.warmup:
            continue
        kind = 'refresh' if (step - 1) % args.interval == 0 else 'stale'
        records.append({
            'step': step, 'kind': kind, 'total': total,
            'stages': timer.coarse(), 'fine': dict(timer.totals),
            'bytes': {k.split('/')[-1]: float(v) for k, v
                      in observation.items() if k.startswith('kfac/bytes/')},
            'state_bytes': sum(b.state_bytes() for b in opt.blocks),
            'owned_blocks': len(opt.stages.owned(opt.blocks))})
    control = _control_cost(comm, opt)
    everyone = comm.mpi_comm.gather(records, root=0)
    if comm.rank == 0:
        assignment = opt.stages.assignment
        with open(args.worker_out, 'w') as f:
            json.dump({'size': comm.size, 'ranks': everyone,
                       'load_imbalance': assignment.load_imbalance,
                       'split_blocks': {
                           opt.blocks[i].name: len(assignment.shards[i])
                           for i in assignment.split_blocks},
                       'n_blocks': len(opt.blocks),
                       'control_when_together': control,
                       'n_params': int(sum(p.size for p in model.params())),
                       'batch_per_rank': batch}, f)


def _control_cost(comm, opt, repeats=50):
    """Median seconds of an update's control messages (the start's
    check, the agreement) with the ranks arriving together: without the
    wait for a slower rank that a step's ``control`` stage holds."""
    from chainerkfac.distributed import consistency
    times = []
    for _ in range(repeats):
        comm.mpi_comm.Barrier()
        t0 = time.perf_counter()
        consistency.check_same_step(comm, opt, opt.stages.arrival_deadline)
        opt.stages.agree(True)
        times.append(time.perf_counter() - t0)
    return comm.mpi_comm.allreduce(float(numpy.median(times)),
                                   op=mpi4py_max())


def factorization_worker(args):
    """Times one Cholesky factorization by rank 0 alone and shared by all
    ranks (:mod:`chainerkfac.distributed.cholesky`), for each dimension;
    rank 0 writes the medians."""
    from chainerkfac import linalg
    from chainerkfac.distributed import cholesky
    comm = chainerkfac.create_communicator('naive')
    ranks = list(range(comm.size))
    results = []
    for dim in [int(v) for v in args.factorization.split(',')]:
        rng = numpy.random.default_rng(dim)
        X = rng.standard_normal((dim, dim + 64)).astype(numpy.float32)
        M = X @ X.T / dim
        alone, shared = [], []
        for _ in range(args.steps):
            comm.mpi_comm.Barrier()
            if comm.rank == 0:
                t0 = time.perf_counter()
                expected = linalg.damped_cholesky(M, 0.0)
                alone.append(time.perf_counter() - t0)
            comm.mpi_comm.Barrier()
            t0 = time.perf_counter()
            L = cholesky.shared_cholesky(
                comm, ranks, dim, cholesky.lower_panels(M, ranks, comm.rank),
                M, None)
            shared.append(comm.mpi_comm.allreduce(
                time.perf_counter() - t0, op=mpi4py_max()))
        if comm.rank == 0:
            error = float(numpy.abs(L - expected).max()
                          / numpy.abs(expected).max())
            results.append({
                'dim': dim, 'alone': float(numpy.median(alone)),
                'shared': float(numpy.median(shared)),
                'panels': len(cholesky.panel_bounds(dim, comm.size)),
                'max_relative_difference': error})
    if comm.rank == 0:
        with open(args.worker_out, 'w') as f:
            json.dump({'size': comm.size, 'results': results}, f)


def mpi4py_max():
    import mpi4py.MPI
    return mpi4py.MPI.MAX


def run_factorization(args):
    """``mpiexec -n 2`` on :func:`factorization_worker`."""
    out = os.path.join(harness.results_dir(), '.distributed_chol.json')
    cmd = [os.path.join(os.path.dirname(sys.executable), 'mpiexec'), '-n',
           '2', sys.executable, os.path.abspath(__file__), '--worker',
           '--worker-kind', 'factorization', '--worker-out', out,
           '--factorization', args.factorization,
           '--steps', str(args.steps)]
    print('$', ' '.join(cmd[:3]), '... --factorization', flush=True)
    proc = subprocess.run(cmd, env=_worker_env(args), capture_output=True,
                          text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        raise SystemExit('mpiexec -n 2 --factorization failed')
    with open(out) as f:
        result = json.load(f)
    os.remove(out)
    return result


def factorization_table(result):
    rows = [[str(r['dim']), str(r['panels']),
             harness.fmt_s(r['alone']),
             harness.fmt_s(r['shared']),
             '{:.2f}'.format(r['shared'] / r['alone']),
             '{:.1e}'.format(r['max_relative_difference'])]
            for r in result['results']]
    return harness.table(rows, [
        'dim', 'panels', 'rank 0 alone (potrf)',
        '{} ranks together (slowest rank)'.format(result['size']),
        'shared / alone', 'max difference / max |L|'])


def _imbalance_option(text):
    return None if text == 'none' else float(text)


def summarise_mpi(result):
    """Per kind: median over steps of (max over ranks, mean over ranks)."""
    out = {}
    size = result['size']
    for kind in ('refresh', 'stale'):
        steps = [[r for r in rank if r['kind'] == kind]
                 for rank in result['ranks']]
        if not steps[0]:
            continue
        n = min(len(s) for s in steps)
        per = {}
        for stage in harness.STAGES + ('total', 'control'):
            def value(rec):
                if stage == 'control':
                    return rec['fine'].get('communication_control', 0.0)
                return rec['total'] if stage == 'total' else \
                    rec['stages'][stage]
            max_over_ranks = [max(value(steps[r][i]) for r in range(size))
                              for i in range(n)]
            mean_over_ranks = [float(numpy.mean(
                [value(steps[r][i]) for r in range(size)])) for i in range(n)]
            per[stage] = {'max': float(numpy.median(max_over_ranks)),
                          'mean': float(numpy.median(mean_over_ranks))}
        nbytes = {}
        for rank in steps:
            for rec in rank[:n]:
                for k, v in rec['bytes'].items():
                    nbytes.setdefault(k, []).append(v)
        per['bytes_per_rank'] = {k: float(numpy.mean(v))
                                 for k, v in nbytes.items()}
        per['steps'] = n
        out[kind] = per
    out['state_bytes_per_rank'] = [rank[-1]['state_bytes']
                                   for rank in result['ranks']]
    out['owned_blocks'] = [rank[-1]['owned_blocks']
                           for rank in result['ranks']]
    return out


def run_mpi(args, runs):
    """Runs the worker for each ``(key, ranks, model, max_load_imbalance)``
    of ``runs``; returns ``{key: result}``."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    results = {}
    for key, size, model, max_imbalance in runs:
        out = os.path.join(harness.results_dir(),
                           '.distributed_{}.json'.format(size))
        cmd = [mpiexec, '-n', str(size), sys.executable,
               os.path.abspath(__file__), '--worker', '--worker-out', out,
               '--model', model, '--steps', str(args.steps),
               '--warmup', str(args.warmup), '--interval',
               str(args.interval), '--max-load-imbalance', max_imbalance]
        if args.batch and model == args.model:
            cmd += ['--batch', str(args.batch)]
        print('$', ' '.join(cmd[:3]), '...', flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd, env=_worker_env(args), capture_output=True,
                              text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit('mpiexec -n {} failed'.format(size))
        with open(out) as f:
            raw = json.load(f)
        os.remove(out)
        results[key] = {'summary': summarise_mpi(raw),
                        'control_when_together': raw[
                            'control_when_together'],
                        'load_imbalance': raw['load_imbalance'],
                        'split_blocks': raw['split_blocks'],
                        'n_blocks': raw['n_blocks'],
                        'n_params': raw['n_params'],
                        'batch_per_rank': raw['batch_per_rank'],
                        'raw': raw['ranks']}
        print('  {}: {:.0f} s'.format(key, time.time() - t0),
              flush=True)
    return results


def _worker_env(args):
    env = dict(os.environ)
    env['PYTHONPATH'] = os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in env.get(
            'PYTHONPATH', '').split(os.pathsep) if p])
    if args.threads:
        env['OPENBLAS_NUM_THREADS'] = str(args.threads)
        env['OMP_NUM_THREADS'] = str(args.threads)
    return env


def mpi_tables(results):
    lines = []
    rows = []
    for size, res in results.items():
        for kind in ('refresh', 'stale'):
            s = res['summary'].get(kind)
            if not s:
                continue
            rows.append([str(size), kind] + [
                '{:.4f} / {:.4f}'.format(s[st]['max'], s[st]['mean'])
                for st in harness.STAGES + ('total', 'control')] + [
                '{:.2%}'.format(s['control']['max'] / s['total']['max'])])
    lines.append(harness.table(rows, ['ranks', 'step'] + [
        s + ' (max / mean over ranks, s)' if s == 'forward' else s
        for s in harness.STAGES] + [
            'total', 'of communication: control (the ranks\' agreement)',
            'control / total']))
    lines += ['', 'The control messages of one update when the ranks '
              'arrive together (after a barrier; median of 50, slowest '
              'rank): ' + ', '.join(
                  '{} ranks {}'.format(size, harness.fmt_s(
                      res['control_when_together']))
                  for size, res in results.items()), '']
    lines += ['', 'Bytes per step handed to MPI by one rank (mean over '
              'ranks), K-FAC state per rank, owned blocks:', '']
    rows = []
    collectives = ('allreduce', 'reduce_scatter_v', 'all_gather_v',
                   'alltoall_v', 'bcast')
    for size, res in results.items():
        for kind in ('refresh', 'stale'):
            s = res['summary'].get(kind)
            if not s:
                continue
            b = s['bytes_per_rank']
            rows.append([str(size), kind] + [
                harness.fmt_bytes(b.get(c, 0)) for c in collectives] + [
                harness.fmt_bytes(sum(b.values())),
                harness.fmt_bytes(max(res['summary']['state_bytes_per_rank'])),
                '/'.join(map(str, res['summary']['owned_blocks'])),
                '{:.2f}'.format(res['load_imbalance'])])
    lines.append(harness.table(rows, ['ranks', 'step'] + list(collectives)
                               + ['total', 'K-FAC state (max rank)',
                                  'blocks per rank', 'cost imbalance']))
    return '\n'.join(lines)


def split_table(results):
    """One owner per block against split blocks, same model and ranks."""
    def stage(summary, name):
        if summary is None:  # no step of that kind was timed
            return '-'
        return '{:.4f} / {:.4f}'.format(summary[name]['max'],
                                        summary[name]['mean'])

    def nbytes(summary):
        return '-' if summary is None else harness.fmt_bytes(
            sum(summary['bytes_per_rank'].values()))

    rows = []
    for key, res in results.items():
        refresh = res['summary'].get('refresh')
        stale = res['summary'].get('stale')
        rows.append([key, ', '.join('{} in {}'.format(n, k) for n, k in
                                    res['split_blocks'].items()) or '-',
                     '{:.2f}'.format(res['load_imbalance']),
                     stage(refresh, 'inversion'),
                     stage(refresh, 'precondition'),
                     stage(stale, 'precondition'), stage(stale, 'total'),
                     nbytes(stale), nbytes(refresh)])
    return harness.table(rows, [
        'run', 'split blocks (parts)', 'cost imbalance',
        'refresh inversion (max / mean over ranks, s)',
        'refresh precondition', 'stale precondition', 'stale total',
        'stale bytes', 'refresh bytes'])


def imbalance(refresh_fractions=(1.0, 0.1, 0.01)):
    """Load imbalance (max/mean) of ResNet-50's blocks on 2 ... 1024 ranks."""
    from chainerkfac.distributed import assignment
    model = models_module.ResNet50(1000)
    opt = chainerkfac.optimizers.KFAC()
    opt.setup(model)
    costs = [b.cost() for b in opt.blocks]
    sizes = [2 ** k for k in range(1, 11)]
    table = {}
    for frac in refresh_fractions:
        total = sum(c.cost(frac) for c in costs)
        biggest = max(c.cost(frac) for c in costs)
        for size in sizes:
            # What no split goes below: a block's cost, or the owner's
            # part when it is split over as many ranks as it can be.
            refresh = max(
                min(c.cost(frac), c.shard_costs(frac, min(
                    size, c.split_length(frac)))[1][0])
                if c.kind == 'kronecker' and size > 1 else c.cost(frac)
                for c in costs)
            lpt = assignment.assign_blocks(costs, size, frac)
            count = assignment.assign_blocks_by_count(costs, size, frac)
            split = assignment.assign_blocks(costs, size, frac,
                                             shardable=True)
            table[(frac, size)] = {
                'cost_model': lpt.load_imbalance,
                'split': split.load_imbalance,
                'split_blocks': len(split.split_blocks),
                'most_parts': max(len(r) for r in split.shards),
                'by_count': count.load_imbalance,
                'floor': max(1.0, biggest * size / total),
                'split_floor': max(1.0, refresh * size / total),
                'idle_ranks': len(lpt.idle_ranks)}
    return {'n_blocks': len(costs), 'sizes': sizes,
            'refresh_fractions': list(refresh_fractions),
            'table': {'{}@{}'.format(f, s): v for (f, s), v in table.items()}}


def imbalance_table(imb):
    rows = []
    for size in imb['sizes']:
        row = [str(size)]
        for frac in imb['refresh_fractions']:
            v = imb['table']['{}@{}'.format(frac, size)]
            row.append('{:.2f} / {:.2f} / {:.2f} / {:.2f} ({}, {}) / '
                       '{:.2f}'.format(
                           v['cost_model'], v['by_count'], v['floor'],
                           v['split'], v['split_blocks'], v['most_parts'],
                           v['split_floor']))
        row.append(str(imb['table']['1.0@{}'.format(size)]['idle_ranks']))
        rows.append(row)
    return harness.table(rows, ['ranks'] + [
        'refresh {:g}: one owner / by count / one-owner floor / split '
        '(split blocks, most parts) / split floor'.format(f)
        for f in imb['refresh_fractions']] + ['idle ranks (one owner)'])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--worker', action='store_true',
                        help=argparse.SUPPRESS)
    parser.add_argument('--worker-out', help=argparse.SUPPRESS)
    parser.add_argument('--worker-kind', default='steps',
                        help=argparse.SUPPRESS)
    parser.add_argument('--model', default='resnet50_w4_32')
    parser.add_argument('--batch', type=int, default=None)
    parser.add_argument('--ranks', default='1,2,4')
    parser.add_argument('--steps', type=int, default=None)
    parser.add_argument('--warmup', type=int, default=1)
    parser.add_argument('--interval', type=int, default=5,
                        help='factor and inverse interval')
    parser.add_argument('--threads', type=int, default=1,
                        help='BLAS threads per rank (default 1: 2 ranks '
                        'fill the 2 cores)')
    parser.add_argument('--max-load-imbalance', default='1.1',
                        help="the optimizer's option, or 'none'")
    parser.add_argument('--split-model', default='wide_mlp',
                        help="model of the split comparison ('none' skips "
                        'it)')
    parser.add_argument('--factorization', default='1152,2304,4608',
                        help='dimensions of the shared Cholesky timing '
                        "under mpiexec -n 2 ('none' skips it)")
    parser.add_argument('--skip-mpi', action='store_true')
    parser.add_argument('--quick', action='store_true')
    parser.add_argument('--out', default='distributed.json')
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 10 if args.quick else 40
    if args.worker:
        return (factorization_worker(args)
                if args.worker_kind == 'factorization' else worker(args))
    payload = {'script': 'distributed', 'argv': sys.argv[1:],
               'environment': harness.environment(), 'model': args.model,
               'interval': args.interval}
    texts = []

    def emit(text):
        texts.append(text)
        print(text, flush=True)
    if not args.skip_mpi:
        results = run_mpi(args, [
            (str(size), size, args.model, args.max_load_imbalance)
            for size in [int(v) for v in args.ranks.split(',')]])
        payload['mpi'] = results
        text = mpi_tables(results)
        emit(text)
    if not args.skip_mpi and args.split_model != 'none':
        results = run_mpi(args, [
            ('-n 2, one owner', 2, args.split_model, 'none'),
            ('-n 2, split', 2, args.split_model, '1.1')])
        payload['split'] = {'model': args.split_model, 'runs': results}
        text = ('Model `{}`, `mpiexec -n 2`, every block on one rank '
                '(`max_load_imbalance=None`) and split '
                '(`max_load_imbalance=1.1`); stage times: median over steps '
                'of the slowest rank / of the mean rank.\n\n'.format(
                    args.split_model) + split_table(results))
        emit(text)
    if not args.skip_mpi and args.factorization != 'none':
        result = run_factorization(args)
        payload['factorization'] = result
        text = ('One Cholesky factorization of a float32 factor, by rank 0 '
                'alone (LAPACK potrf) and shared by the ranks of '
                '`mpiexec -n 2` (chainerkfac.distributed.cholesky), one '
                'BLAS thread a rank; medians of {} runs.\n\n'.format(
                    args.steps) + factorization_table(result))
        emit(text)
    imb = imbalance()
    payload['imbalance'] = imb
    text = ('Load imbalance (max/mean rank cost) of ResNet-50\'s {} blocks '
            'at three refresh fractions of the inverses; one-owner floor = '
            'max(1, largest block x ranks / total); split: large Kronecker '
            'blocks\' preconditioning shared by several ranks until 1.10 '
            'is reached, if it can be; split floor = max(1, the largest '
            'part no split can shrink, a block\'s refresh on its owner '
            'included, x ranks / total)\n\n'.format(
                imb['n_blocks']) + imbalance_table(imb))
    texts.append(text)
    print(text)
    payload['tables'] = texts
    print('written', harness.write_json(args.out, payload))
    return payload


if __name__ == '__main__':
    main()
