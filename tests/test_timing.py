"""The timing hook: stages timed where they run, numbers unchanged."""
import chainer
import chainer.functions as F
import chainer.links as L
import numpy

import chainerkfac
from chainerkfac import timing


class Net(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(1, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(4 * 6 * 6, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


def train(timer, steps=4):
    numpy.random.seed(0)
    model = Net()
    optimizer = chainerkfac.optimizers.KFAC(lr=0.05, factor_interval=2,
                                            inverse_interval=2)
    optimizer.setup(model)
    optimizer.stage_timer = timer
    rng = numpy.random.RandomState(1)
    calls = []
    for _ in range(steps):
        x = rng.randn(8, 1, 6, 6).astype(numpy.float32)
        t = rng.randint(0, 3, 8)
        before = dict(timer.calls) if timer else {}
        optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t),
                         x, t)
        if timer:
            calls.append({k: v - before.get(k, 0)
                          for k, v in timer.calls.items()})
    return [p.array.copy() for p in model.params()], calls


def test_timer_times_each_stage_and_changes_no_number():
    timer = timing.StageTimer()
    timed, calls = train(timer)
    untimed, _ = train(None)
    for a, b in zip(timed, untimed):
        numpy.testing.assert_array_equal(a, b)
    # Steps 1 and 3 refresh factors and inverses, 2 and 4 are stale.
    for step, entered in enumerate(calls, 1):
        refresh = step % 2 == 1
        assert bool(entered.get('inversion')) == refresh, (step, entered)
        assert bool(entered.get('statistics_forward')) == refresh
        assert bool(entered.get('statistics_backward')) == refresh
        assert entered['forward'] == entered['backward'] == 1
        assert entered['update'] == entered['precondition'] == 1
    coarse = timer.coarse()
    assert set(coarse) == set(timing.STAGES)
    assert coarse['communication'] == 0  # one process
    for stage in ('forward', 'backward', 'statistics', 'inversion',
                  'precondition', 'update'):
        assert coarse[stage] > 0, stage
    # Exclusive: the stages add up to the wall time of the steps at most.
    assert abs(sum(coarse.values()) - sum(timer.totals.values())) < 1e-9


def test_timer_nests_exclusively():
    ticks = iter([0.0, 1.0, 3.0, 6.0])
    timer = timing.StageTimer(clock=lambda: next(ticks))
    timer.enter('update')       # 0
    timer.enter('inversion')    # 1: update 1 s
    timer.leave()               # 3: inversion 2 s
    timer.leave()               # 6: update 3 s more
    assert timer.totals == {'update': 4.0, 'inversion': 2.0}
    assert timer.coarse()['update'] == 4.0
