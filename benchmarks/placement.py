"""More ranks than layers: placements of ResNet-50's K-FAC work, by the cost
model, at 128 to 1,024 ranks (issue #26 item 3).

    PYTHONPATH=. .venv/bin/python benchmarks/placement.py

The paper ran 1,024 GPUs for ResNet-50's 107 blocks. For each world size
``N`` and each refresh interval ``t`` (inverses every step, every 10, every
100) this compares, per rank and per step (refresh work and bytes amortised
over ``t``):

* **ours**: the layer-to-rank assignment of
  :func:`chainerkfac.distributed.assign_blocks` with split blocks (the
  library's default, ``max_load_imbalance=1.1``); gradients and factors
  reduce-scattered to the blocks' owners, ``V`` all-gathered, and the parts
  of split blocks sent by their owners after each refresh;
* **KAISA MEM-OPT** (gradient-worker fraction ``1/N``; the paper's scheme
  as KAISA describes it): one rank per layer inverts and preconditions,
  gradients and factors allreduced, ``V`` broadcast every step;
* **KAISA COMM-OPT** (fraction 1): one rank per layer inverts and
  broadcasts the eigendecompositions every ``t`` steps; every rank
  preconditions every layer, so no ``V`` travels;
* **KAISA HYBRID-OPT** (fraction 1/2): half the ranks hold each layer's
  eigendecomposition and precondition it, the other half receive ``V``.

Work is the cost model's floating-point operations
(:class:`chainerkfac.distributed.BlockCost`; KAISA's placement of the
inversions is the same LPT as ours, its preconditioning is that of the
fraction); bytes are float32 elements a rank hands to ring collectives
(``(N - 1) / N`` of the payload for a reduce-scatter, all-gather or
broadcast, twice that for an allreduce). Writes
``results/placement.json``.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import chainerkfac  # NOQA  (before Chainer: NumPy-2 compatibility)
from chainerkfac.distributed import assignment
from chainerkfac.distributed import split

import harness
import models as models_module

#: (name, gradient-worker fraction as a function of N) of KAISA's schemes.
KAISA = (('KAISA MEM-OPT', lambda n: 1 / n),
         ('KAISA HYBRID-OPT', lambda n: 0.5),
         ('KAISA COMM-OPT', lambda n: 1.0))


def sizes(block_costs):
    """Elements of all gradients ``G``, packed factors ``F`` and
    eigendecompositions ``E`` (KAISA's inverses) of the blocks."""
    G = F = E = 0
    for c in block_costs:
        if c.kind == 'kronecker':
            d_a, d_g = c.dims
            G += d_a * d_g
            F += d_a * (d_a + 1) // 2 + d_g * (d_g + 1) // 2
            E += d_a * d_a + d_a + d_g * d_g + d_g
        else:
            c2 = 2 * c.dims[0]
            G += c2
            F += c2 if c.kind == 'diagonal' else c2 * (c2 + 1) // 2
            E += c2 if c.kind == 'diagonal' else c2 * c2 + c2
    return G, F, E


def split_bytes(block_costs, placed, fraction):
    """The most elements a rank receives per refresh for its parts of split
    blocks (``Split.part_shapes``; a Cholesky factor as its triangle)."""
    received = {}
    for i in placed.split_blocks:
        c = block_costs[i]
        explicit = c.explicit_form(fraction)
        layout = split.Split(c.dims, explicit, placed.part_bounds(
            i, split.Split.length(c.dims, explicit)), placed.shards[i])
        for s, rank in enumerate(layout.ranks):
            if s == 0 or layout.empty(s):
                continue
            n = 0
            for shape, triangular in zip(layout.part_shapes(s),
                                         layout.triangular()):
                n += (shape[0] * (shape[0] + 1) // 2 if triangular
                      else shape[0] * shape[1])
            received[rank] = received.get(rank, 0) + n
    return max(received.values(), default=0)


def compare(block_costs, world_size, interval):
    f = 1 / interval
    G, F, E = sizes(block_costs)
    ring = (world_size - 1) / world_size
    inverse = [c.inverse_cost for c in block_costs]
    precondition = sum(c.precondition_cost for c in block_costs)
    rows = {}

    placed = assignment.assign_blocks(block_costs, world_size, f,
                                      shardable=True, max_imbalance=1.1)
    most_received = split_bytes(block_costs, placed, f)
    rows['ours'] = {
        'max_work': max(placed.loads), 'mean_work': placed.work / world_size,
        'idle_ranks': len(placed.idle_ranks),
        'split_blocks': len(placed.split_blocks),
        'bytes': 4 * (ring * (2 * G + f * F) + f * most_received),
        'inverses_held': None}

    # KAISA: each layer's inversion on one rank (the same LPT placement as
    # ours without splits); its preconditioning on the layer's gradient
    # workers, a fraction of the ranks. MEM-OPT's gradient worker is the
    # inverting rank itself: the LPT loads. Otherwise each rank
    # preconditions about that fraction of all layers.
    owners = assignment.assign_blocks(block_costs, world_size, f)
    refresh = [0.0] * world_size
    for i, rank in enumerate(owners.owners):
        refresh[rank] += f * inverse[i]
    for name, fraction_of in KAISA:
        frac = fraction_of(world_size)
        mem_opt = frac * world_size <= 1
        work = list(owners.loads) if mem_opt else [
            r + frac * precondition for r in refresh]
        rows[name] = {
            'max_work': max(work), 'mean_work': sum(work) / world_size,
            'idle_ranks': len(owners.idle_ranks) if mem_opt else 0,
            'split_blocks': 0,
            # Gradients and factors allreduced; V broadcast to the
            # receivers; eigendecompositions to the gradient workers.
            'bytes': 4 * (ring * (2 * G + 2 * f * F) + (1 - frac) * G
                          + f * frac * E),
            'inverses_held': 4 * frac * E}
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--ranks', default='128,256,512,1024')
    parser.add_argument('--intervals', default='1,10,100')
    args = parser.parse_args()
    model = models_module.ResNet50(1000)
    optimizer = chainerkfac.optimizers.KFAC()
    optimizer.setup(model)
    block_costs = [b.cost() for b in optimizer.blocks]
    G, F, E = sizes(block_costs)
    results = {}
    lines = ['ResNet-50: {} blocks, gradients {:,} elements, packed factors '
             '{:,}, eigendecompositions {:,}'.format(
                 len(block_costs), G, F, E)]
    for interval in [int(t) for t in args.intervals.split(',')]:
        table = []
        for n in [int(r) for r in args.ranks.split(',')]:
            rows = compare(block_costs, n, interval)
            results['{}@{}'.format(interval, n)] = rows
            for name, row in rows.items():
                table.append([
                    str(n), name, '{:.2f}'.format(row['max_work'] / 1e9),
                    '{:.2f}'.format(row['max_work'] / row['mean_work']),
                    str(row['idle_ranks']), harness.fmt_bytes(row['bytes']),
                    '-' if row['inverses_held'] is None
                    else harness.fmt_bytes(row['inverses_held'])])
        lines += ['', 'inverses every {} step(s):'.format(interval), '',
                  harness.table(table, [
                      'ranks', 'placement', 'busiest rank (GFLOP/step)',
                      'load imbalance', 'idle ranks',
                      'bytes sent per rank and step',
                      'eigendecompositions held per rank'])]
    text = '\n'.join(lines)
    print(text)
    payload = {'script': 'placement', 'argv': sys.argv[1:],
               'environment': harness.environment(), 'sizes': {
                   'gradients': G, 'factors': F, 'eigendecompositions': E},
               'results': results, 'table': text}
    print('wrote', harness.write_json('placement.json', payload))


if __name__ == '__main__':
    main()
