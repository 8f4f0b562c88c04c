"""The step-time comparison for the GPU peer: PyTorch + kfac-pytorch
(KAISA) on the same card and shapes as ``step_time.py --models resnet50
--device @cupy:0``.

    python benchmarks/gpu/peer_torch.py --out peer_torch.json [--tf32]

Needs ``torch``, ``torchvision`` and ``kfac-pytorch`` where it runs; none of
them is a dependency of the library (check.sh's ``peer`` stage installs
kfac-pytorch from ``.whl/``). torchvision's ResNet-50 at 224x224, batch
32, float32, random data, cross-entropy. Every configuration is timed
interleaved round-robin in a new order every round, each step up to the
end of its GPU work (``torch.cuda.synchronize``), as ``step_time.py`` does:

* ``sgd``: ``torch.optim.SGD(lr, momentum=0.9)``;
* ``kaisa_F_I``: ``kfac.preconditioner.KFACPreconditioner`` with factors
  every ``F`` and inverses (eigen decompositions, its default) every ``I``
  steps, damping 1e-3, then the same SGD.

A step is a refresh where kfac-pytorch's counter is a multiple of ``I``,
a factor step where it is one of ``F``, else stale; the amortised time
weights each kind's median by its share of the schedule (a kind no timed
step had takes ``kaisa_1_1``'s refresh median). ``--tf32`` lets cuDNN and
cuBLAS use TF32 (PyTorch's default for convolutions); by default both
compute in full float32, as CuPy does. The file ``--out`` keeps one
variant per precision, ``fp32`` and ``tf32``
(:func:`harness.write_variant <harness.write_variant>`).
"""
import argparse
import json
import os
import sys
import time

import numpy

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))
import harness  # NOQA: E402  (benchmarks/harness.py)

CONFIGS = {'kaisa_1_1': (1, 1), 'kaisa_10_100': (10, 100),
           'kaisa_50_50': (50, 50)}
KINDS = ('refresh', 'factors', 'stale')


def main(argv=None):
    import torch
    import torchvision
    import kfac

    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=40)
    parser.add_argument('--warmup', type=int, default=3)
    parser.add_argument('--batch', type=int, default=32)
    parser.add_argument('--tf32', action='store_true')
    parser.add_argument('--device', default='cuda')
    parser.add_argument('--out', default='peer_torch.json')
    args = parser.parse_args(argv)
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = True
    device = torch.device(args.device)

    def synchronize():
        if device.type == 'cuda':
            torch.cuda.synchronize()
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, 224, 224, device=device)
    t = torch.randint(0, 1000, (args.batch,), device=device)
    runners = {}
    for name in ('sgd',) + tuple(CONFIGS):
        model = torchvision.models.resnet50().to(device)
        sgd = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        precond = None if name == 'sgd' else \
            kfac.preconditioner.KFACPreconditioner(
                model, factor_update_steps=CONFIGS[name][0],
                inv_update_steps=CONFIGS[name][1], damping=1e-3, lr=1e-3)
        runners[name] = (model, sgd, precond, [])
    loss_fn = torch.nn.CrossEntropyLoss()
    order = numpy.random.RandomState(1)
    for i in range(args.warmup + args.steps):
        for name in order.permutation(list(runners)):
            model, sgd, precond, records = runners[name]
            kind = 'sgd'
            if precond is not None:
                f, inv = CONFIGS[name]
                kind = ('refresh' if precond.steps % inv == 0 else
                        'factors' if precond.steps % f == 0 else 'stale')
            synchronize()
            start = time.perf_counter()
            sgd.zero_grad()
            loss_fn(model(x), t).backward()
            if precond is not None:
                precond.step()
            sgd.step()
            synchronize()
            if i >= args.warmup:
                records.append((kind, time.perf_counter() - start))
    results = {}
    sgd_median = float(numpy.median([s for _, s in runners['sgd'][3]]))
    for name, (_, _, _, records) in runners.items():
        medians = {k: float(numpy.median([s for kk, s in records if kk == k]))
                   for k in {k for k, _ in records}}
        res = {'medians': medians, 'steps': len(records)}
        if name in CONFIGS:
            f, inv = CONFIGS[name]
            shares = {'refresh': 1 / inv, 'factors': 1 / f - 1 / inv,
                      'stale': 1 - 1 / f}
            refresh = medians.get('refresh') or \
                results['kaisa_1_1']['medians']['refresh']

            def median(kind):
                return medians.get(kind, refresh if kind != 'stale'
                                   else None)
            amortised = sum(share * median(k) for k, share in shares.items()
                            if share > 0)
            res.update(amortised=amortised,
                       amortised_ratio=amortised / sgd_median)
            if 'stale' in medians:
                res['stale_ratio'] = medians['stale'] / sgd_median
        results[name] = res
        print('{}: {}'.format(name, json.dumps(res)), flush=True)
    payload = {'script': 'peer_torch', 'torch': torch.__version__,
               'kfac_pytorch': getattr(kfac, '__version__', None),
               'device': torch.cuda.get_device_name(0)
               if device.type == 'cuda' else 'cpu',
               'cudnn': torch.backends.cudnn.version(), 'tf32': args.tf32,
               'batch': args.batch, 'steps': args.steps, 'results': results}
    print('written', harness.write_variant(
        'peer_torch', 'tf32' if args.tf32 else 'fp32', payload, args.out))


if __name__ == '__main__':
    main()
