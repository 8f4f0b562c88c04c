"""Cost-balanced placement of curvature blocks (no MPI involved)."""
import pytest

from chainerkfac import linalg
from chainerkfac.curvature import cost
from chainerkfac.distributed.assignment import Assignment
from chainerkfac.distributed.assignment import BlockCost
from chainerkfac.distributed.assignment import assign_blocks
from chainerkfac.distributed.assignment import assign_blocks_by_count


def resnet50_blocks(bn_kind='diagonal'):
    """The 107 K-FAC blocks of ResNet-50 (53 conv, 53 BN, 1 FC).

    Written out from Chainer's ``ResNet50Layers``: ``conv1`` (7x7, stride 2)
    and ``fc6`` have a bias (one more coordinate in A), the bottleneck convs
    do not. d_A = in_channels * kh * kw (+1), d_G = out_channels.
    """
    blocks = [BlockCost('conv1', 'kronecker', (3 * 7 * 7 + 1, 64)),
              BlockCost('bn1', bn_kind, (64,))]
    in_ch = 64
    for stage, (n_blocks, mid, out) in enumerate(
            [(3, 64, 256), (4, 128, 512), (6, 256, 1024), (3, 512, 2048)],
            start=2):
        for b in range(n_blocks):
            prefix = 'res{}/{}'.format(stage, 'a' if b == 0 else 'b%d' % b)
            convs = [(in_ch, mid, 1), (mid, mid, 3), (mid, out, 1)]
            if b == 0:
                convs.append((in_ch, out, 1))  # projection shortcut
            for k, (cin, cout, ksize) in enumerate(convs, start=1):
                blocks.append(BlockCost('%s/conv%d' % (prefix, k),
                                        'kronecker', (cin * ksize ** 2, cout)))
                blocks.append(BlockCost('%s/bn%d' % (prefix, k), bn_kind,
                                        (cout,)))
            in_ch = out
    blocks.append(BlockCost('fc6', 'kronecker', (2048 + 1, 1000)))
    return blocks


def test_resnet50_block_list():
    blocks = resnet50_blocks()
    kinds = [b.kind for b in blocks]
    assert (len(blocks), kinds.count('kronecker')) == (107, 54)
    # The largest factor: the 3x3 conv of res5, 512 * 9 = 4608.
    assert max(b.dims[0] for b in blocks if b.kind == 'kronecker') == 4608


def test_costs_hand_computed():
    k = BlockCost('fc', 'kronecker', (3, 2))
    assert k.inverse_cost == 27 + 8
    assert k.precondition_cost == 2 * 2 * 3 * 5
    # Explicit inverses pay from 8 * 35 / (3 * 3 * 2 * 5) = 3.1 steps on;
    # below, Cholesky factors: a third of the inverse, slower solves.
    assert k.cost() == pytest.approx(35 / 3 + 9 / 8 * 60)
    assert k.cost(refresh_fraction=0.5) == pytest.approx(35 / 6 + 9 / 8 * 60)
    assert k.cost(refresh_fraction=0.25) == pytest.approx(35 / 4 + 60)
    assert k.cost(refresh_fraction=0.0) == 60
    assert BlockCost('bn', 'diagonal', (4,)).cost() == 8 + 8
    assert BlockCost('bn', 'full', (4,)).cost() == 8 ** 3 + 2 * 8 ** 2


@pytest.mark.parametrize('dims', [(3, 2), (4608, 512), (1024, 256),
                                  (2049, 1000)])
def test_cost_takes_the_cheaper_form(dims):
    # The cost model charges the form the block computes, and that form is
    # the cheaper one under the model: the two agree on the break-even.
    block = BlockCost('k', 'kronecker', dims)
    I, P = block.inverse_cost, block.precondition_cost
    C = linalg.EXPLICIT_INVERSE_BREAK_EVEN
    for reuse in [1, 2, 3, 5, 10, 20, 50, 100, 1000]:
        f = 1 / reuse
        explicit, cholesky = f * I + P, f * I / 3 + (1 + 1 / C) * P
        expected = (explicit if linalg.explicit_inverse_pays(*dims, reuse)
                    else cholesky)
        assert block.cost(f) == pytest.approx(expected)
        assert block.cost(f) == pytest.approx(min(explicit, cholesky))


@pytest.mark.parametrize('kind, dims', [
    ('kronecker', (3,)), ('diagonal', (3, 4)), ('full', (0,)),
    ('conv', (3, 4))])
def test_invalid_block(kind, dims):
    with pytest.raises(ValueError, match='block'):
        BlockCost('x', kind, dims)


def test_hand_checked_lpt():
    # Costs k, k, 16, 8, 16 (k = 475/6, above; diagonal C=2 -> 4 + 4) on 2
    # ranks. LPT takes a, b, c, e, d: a->r0, b->r1, c->r0 (tie: lower rank),
    # e->r1, d->r0.
    k = 475 / 6
    blocks = [BlockCost('a', 'kronecker', (3, 2)),
              BlockCost('b', 'kronecker', (3, 2)),
              BlockCost('c', 'diagonal', (4,)),
              BlockCost('d', 'diagonal', (2,)),
              BlockCost('e', 'diagonal', (4,))]
    result = assign_blocks(blocks, 2)
    assert result.owners == (0, 1, 0, 0, 1)
    assert result.loads == pytest.approx((k + 16 + 8, k + 16))
    assert result.load_imbalance == pytest.approx((k + 24) / (k + 20))
    assert result.blocks_of(1) == (1, 4)
    assert result.idle_ranks == ()
    assert result.buffer_order() == ((0, 0), (2, 0), (3, 0), (1, 0), (4, 0))
    sizes = {(i, 0): size for i, size in enumerate([10, 20, 30, 40, 50])}
    assert result.segment_counts(sizes) == [80, 70]
    with pytest.raises(ValueError, match='a size for each'):
        result.segment_counts({(0, 0): 1, (1, 0): 2})
    # By count: [a, b, c] | [d, e].
    by_count = assign_blocks_by_count(blocks, 2)
    assert by_count.owners == (0, 0, 0, 1, 1)
    assert by_count.loads == pytest.approx((2 * k + 16, 8 + 16))
    assert by_count.load_imbalance == pytest.approx((2 * k + 16) / (k + 20))
    # One refresh fraction per block: b, never refreshed, costs its
    # products alone (60) and takes the two 16s.
    per_block = assign_blocks(blocks, 2, [1, 0, 1, 1, 1])
    assert per_block.owners == (0, 1, 1, 0, 1)
    assert per_block.loads == pytest.approx((k + 8, 60 + 32))
    with pytest.raises(ValueError, match='one per block'):
        assign_blocks(blocks, 2, [1, 1])


def test_count_split_is_array_split():
    blocks = [BlockCost(str(i), 'diagonal', (1,)) for i in range(7)]
    assert assign_blocks_by_count(blocks, 3).owners == (0, 0, 0, 1, 1, 2, 2)


@pytest.mark.parametrize('world_size', [1, 2, 3, 8, 64, 107, 128, 1024])
def test_every_block_has_one_owner(world_size):
    blocks = resnet50_blocks()
    for assign in (assign_blocks, assign_blocks_by_count):
        result = assign(blocks, world_size)
        assert len(result.owners) == len(blocks)
        assert all(0 <= r < world_size for r in result.owners)
        assert sorted(i for r in range(world_size)
                      for i in result.blocks_of(r)) == list(range(len(blocks)))
        order = [i for i, _ in result.buffer_order()]
        assert sorted(order) == list(range(len(blocks)))
        assert [result.owners[i] for i in order] == sorted(result.owners)
        total = sum(b.cost() for b in blocks)
        assert sum(result.loads) == pytest.approx(total)


def test_deterministic_and_independent_of_names():
    blocks = resnet50_blocks()
    first = assign_blocks(blocks, 8)
    assert assign_blocks(list(blocks), 8) == first
    renamed = [BlockCost('x%d' % i, b.kind, b.dims)
               for i, b in enumerate(blocks)]
    assert assign_blocks(renamed, 8).owners == first.owners


def test_ties_go_to_lower_rank_and_earlier_block():
    blocks = [BlockCost(str(i), 'diagonal', (1,)) for i in range(5)]
    assert assign_blocks(blocks, 3).owners == (0, 1, 2, 0, 1)


@pytest.mark.parametrize('bn_kind', ['diagonal', 'full'])
@pytest.mark.parametrize('world_size', [2, 4, 8, 16, 32, 64, 128, 1024])
def test_lpt_no_worse_than_count_split_on_resnet50(bn_kind, world_size):
    blocks = resnet50_blocks(bn_kind)
    lpt = assign_blocks(blocks, world_size)
    by_count = assign_blocks_by_count(blocks, world_size)
    assert lpt.load_imbalance <= by_count.load_imbalance * (1 + 1e-12)
    # LPT never loads a rank beyond the optimum's 4/3 (Graham); the optimum
    # is at least the larger of the mean load and the costliest block.
    bound = max(sum(lpt.loads) / world_size, max(b.cost() for b in blocks))
    assert max(lpt.loads) <= 4 / 3 * bound


def test_lpt_clearly_better_at_few_ranks():
    # The point of the cost model: the count split gives the ranks holding
    # res5 most of the work.
    blocks = resnet50_blocks()
    assert assign_blocks(blocks, 4).load_imbalance < 1.01
    assert assign_blocks_by_count(blocks, 4).load_imbalance > 3
    # From 8 ranks on, the res5 3x3 conv (A is 4608 x 4608, a fifth of the
    # total cost) alone sets the pace: LPT reaches that floor.
    largest = max(b.cost() for b in blocks)
    assert max(assign_blocks(blocks, 8).loads) == largest
    assert max(assign_blocks_by_count(blocks, 8).loads) > 2.5 * largest


def test_surplus_ranks_are_idle_and_counted():
    blocks = resnet50_blocks()[:5]
    result = assign_blocks(blocks, 8)
    assert sorted(result.owners) == list(range(5))
    assert result.idle_ranks == (5, 6, 7)
    assert result.segment_counts(
        {(i, 0): 1 for i in range(5)})[5:] == [0, 0, 0]
    assert result.load_imbalance >= 8 / 5


def test_stale_fisher_weights_preconditioning():
    # With rare refreshes the preconditioning cost decides the placement.
    blocks = [BlockCost('wide', 'kronecker', (1000, 10)),
              BlockCost('square', 'kronecker', (300, 300)),
              BlockCost('small', 'kronecker', (10, 10))]
    assert blocks[0].inverse_cost > blocks[1].inverse_cost
    assert blocks[0].precondition_cost < blocks[1].precondition_cost
    every_step = assign_blocks(blocks, 2)
    rare = assign_blocks(blocks, 2, refresh_fraction=0.0)
    assert every_step.blocks_of(0) == (0,)
    assert rare.blocks_of(0) == (1,)


def test_single_rank_and_empty():
    blocks = resnet50_blocks()
    result = assign_blocks(blocks, 1)
    assert set(result.owners) == {0} and result.load_imbalance == 1.0
    empty = assign_blocks([], 4)
    assert isinstance(empty, Assignment)
    assert empty.owners == () and empty.load_imbalance == 1.0
    assert empty.idle_ranks == (0, 1, 2, 3)


@pytest.mark.parametrize('world_size', [0, -1, 2.5])
def test_invalid_world_size(world_size):
    with pytest.raises(ValueError, match='world_size'):
        assign_blocks(resnet50_blocks(), world_size)


def test_duplicate_names_rejected():
    block = BlockCost('same', 'diagonal', (1,))
    with pytest.raises(ValueError, match='unique'):
        assign_blocks([block, block], 2)


def test_shard_costs_hand_computed():
    # a = 8, g = 4: I = 512 + 64 = 576, P = 2 * 4 * 8 * 12 = 768; the
    # owner's refresh counts LAPACK_SLOWDOWN (2) times.
    block = BlockCost('fc', 'kronecker', (8, 4))
    assert block.shard_costs(0.25, 1) == ((1.0,), (block.cost(0.25),))
    # An inverse serving 8 steps is explicit (8 * 3 * 384 >= 8 * 576):
    # 2 f I = 144 at f = 1/8; 144 + w P = (1 - w) P / 2 gives
    # w = (768 - 288) / 2304, of the longer side.
    assert block.explicit_form(0.125) and block.split_length(0.125) == 8
    weights, costs = block.shard_costs(0.125, 3)
    w = 480 / 2304
    assert weights == pytest.approx((w, (1 - w) / 2, (1 - w) / 2))
    assert costs == pytest.approx((144 + w * 768,) + ((1 - w) / 2 * 768,) * 2)
    assert costs[0] == pytest.approx(costs[1])
    # One serving 2 steps keeps the larger factor's Cholesky factor; parts
    # split the shorter side. Refreshing: 2 f (a³ / 3 + g³) = 704 / 3 at
    # f = 1/2. The parts' work: 2 g a (g + 1.125 a) = 832 (triangular
    # solves count 1 + 1/C = 1.125 times). 704 / 3 + 832 w = 832 (1 - w) / 2
    # gives w = (832 - 1408 / 3) / 2496.
    assert not block.explicit_form(0.5) and block.split_length(0.5) == 4
    weights, costs = block.shard_costs(0.5, 3)
    w = (832 - 1408 / 3) / 2496
    assert weights == pytest.approx((w, (1 - w) / 2, (1 - w) / 2))
    assert costs == pytest.approx((704 / 3 + w * 832,) * 3)
    # A refresh that outweighs a part leaves the owner no rows at all:
    # 1408 / 3 at f = 1.
    weights, costs = block.shard_costs(1.0, 3)
    assert weights == (0.0, 0.5, 0.5)
    assert costs == pytest.approx((1408 / 3, 416.0, 416.0))
    with pytest.raises(ValueError, match='only Kronecker'):
        BlockCost('bn', 'diagonal', (4,)).shard_costs(1.0, 2)


def test_shard_costs_of_a_shared_factorization(monkeypatch):
    # From SHARED_FACTORIZATION_MIN_DIM on (lowered here for small numbers)
    # the 3 ranks compute the larger factor's Cholesky factor together,
    # f a³ / 9 = 256 / 9 each at f = 1/2 (a = 8, g = 4); the owner also
    # inverts G: 2 f g³ = 64. The parts' work is 832 as above:
    # 64 + 832 w = 832 (1 - w) / 2 gives w = (832 - 128) / 2496.
    monkeypatch.setattr(cost, 'SHARED_FACTORIZATION_MIN_DIM', 8)
    block = BlockCost('fc', 'kronecker', (8, 4))
    weights, costs = block.shard_costs(0.5, 3)
    w = (832 - 128) / 2496
    assert weights == pytest.approx((w, (1 - w) / 2, (1 - w) / 2))
    assert costs == pytest.approx((256 / 9 + 64 + w * 832,) * 3)
    # A refresh that outweighs a part leaves the owner no rows at all:
    # a = g = 8 at f = 1 on 4 ranks, 2 g³ = 1024 against parts of
    # 2 g a (g + 1.125 a) / 3 = 2176 / 3, beside a³ / 12 = 128 / 3 each.
    square = BlockCost('sq', 'kronecker', (8, 8))
    weights, costs = square.shard_costs(1.0, 4)
    assert weights == (0.0, 1 / 3, 1 / 3, 1 / 3)
    assert costs == pytest.approx(
        (128 / 3 + 1024,) + ((128 + 2176) / 3,) * 3)


def test_part_bounds_cover_the_side():
    blocks = [BlockCost('big', 'kronecker', (300, 40)),
              BlockCost('small', 'kronecker', (10, 10))]
    result = assign_blocks(blocks, 4, 0.01, shardable=True)
    assert result.split_blocks == (0,)
    bounds = result.part_bounds(0, 300)
    assert bounds[0][0] == 0 and bounds[-1][1] == 300
    assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert sizes == pytest.approx([w * 300 for w in result.weights[0]],
                                  abs=1)
    assert result.part_bounds(1, 10) == [(0, 10)]


@pytest.mark.parametrize('world_size', [8, 16, 32, 64])
def test_split_blocks_balance_resnet50_at_long_inverse_intervals(
        world_size):
    # Inverses every 100 steps (f = 0.01): preconditioning dominates and
    # splits by rows or columns, so the one-owner floor (1.25 at 8 ranks,
    # 10 at 64) gives way to the 1.10 the assignment stops at.
    blocks = resnet50_blocks()
    one_owner = assign_blocks(blocks, world_size, 0.01)
    split = assign_blocks(blocks, world_size, 0.01, shardable=True)
    assert one_owner.load_imbalance > 1.2
    assert split.load_imbalance <= 1.10
    assert split.split_blocks
    for i, ranks in enumerate(split.shards):
        assert ranks[0] == split.owners[i] and len(set(ranks)) == len(ranks)
        assert sum(split.weights[i]) == pytest.approx(1.0)
        if len(ranks) > 1:
            assert blocks[i].kind == 'kronecker'
    # Every part's cost lands on its rank.
    assert sum(split.loads) == pytest.approx(sum(
        sum(b.shard_costs(0.01, len(r))[1])
        for b, r in zip(blocks, split.shards)))
    items = split.buffer_order()
    assert [split.shards[i][s] for i, s in items] == sorted(
        split.shards[i][s] for i, s in items)


@pytest.mark.parametrize('refresh_fraction', [1.0, 0.1])
@pytest.mark.parametrize('world_size', [8, 16, 32, 64])
def test_shared_factorizations_balance_frequent_inverses(
        world_size, refresh_fraction):
    # Inverses every step or every 10 steps are Cholesky factors. With one
    # owner, the res5 3x3 convolution's factorization alone was the floor
    # (11.7 at 64 ranks every step); its ranks now share it.
    blocks = resnet50_blocks()
    one_owner = assign_blocks(blocks, world_size, refresh_fraction)
    split = assign_blocks(blocks, world_size, refresh_fraction,
                          shardable=True)
    assert one_owner.load_imbalance > 1.25
    assert split.load_imbalance <= 1.10
    biggest = max(range(len(blocks)), key=lambda i: blocks[i].cost(
        refresh_fraction))
    assert not blocks[biggest].explicit_form(refresh_fraction)
    assert len(split.shards[biggest]) > 1


def test_only_shardable_blocks_split_and_only_when_it_pays():
    blocks = resnet50_blocks()
    # One of the three largest blocks may not split: it alone sets the
    # busiest rank's load, so splitting others would only move more bytes.
    shardable = [b.name != 'res5/a/conv2' for b in blocks]
    for world_size in (8, 16):
        split = assign_blocks(blocks, world_size, 0.01, shardable=shardable)
        assert split == assign_blocks(blocks, world_size, 0.01)
    # With that block made small (A 512 x 512), the others split around it.
    small = [b if b.name != 'res5/a/conv2'
             else BlockCost(b.name, b.kind, (512, 512)) for b in blocks]
    split = assign_blocks(small, 16, 0.01, shardable=shardable)
    assert len(split.shards[shardable.index(False)]) == 1
    assert split.split_blocks and split.load_imbalance <= 1.1
