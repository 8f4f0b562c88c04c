"""Backtracking (chainerkfac.backtrack): the loss test, what a jump undoes,
and the runs it saves."""
import logging

import chainer
import chainer.links as L
import numpy
import pytest

import chainerkfac
from chainerkfac import backtrack

from tests.test_convergence import digits, losses  # NOQA  (the fixture)


def test_loss_test_puts_back_the_weights_of_the_lowest_loss():
    model = L.Classifier(L.Linear(3, 2))
    optimizer = chainerkfac.optimizers.KFAC(lr=0.1)
    optimizer.setup(model)
    optimizer.update(model, numpy.ones((4, 3), numpy.float32),
                     numpy.zeros(4, numpy.int32))  # the momentum exists
    params = list(model.namedparams())
    rule = backtrack.Backtrack()
    # A loss that falls to 1 and rises: not a jump until it is above the
    # first (4) and over twice the lowest (2 x 1). The weights move at
    # every step; those the loss 1 was measured at are kept.
    kept = None
    for loss, jumped in ((4.0, False), (3.0, False), (1.0, False),
                         (1.9, False), (3.9, False), (4.0, False),
                         (4.1, True), (float('nan'), True),
                         (float('inf'), True)):
        assert rule.jumped(loss) is jumped, loss
        if not jumped:
            rule.accept(loss, params)
        if loss == 1.0:
            kept = {name: param.array.copy() for name, param in params}
        for _, param in params:
            param.array += 1
    assert (rule.first_loss, rule.lowest_loss) == (4.0, 1.0)
    for _, param in params:
        param.update_rule.state['v'][...] = 5
    rule.undo(7, 4.1, params)
    for name, param in params:
        numpy.testing.assert_array_equal(param.array, kept[name])
        assert not param.update_rule.state['v'].any()
    assert rule.count == 1 and rule.factor == 0.5
    rule.undo(8, float('nan'), params)
    assert rule.factor == 0.25
    # Once a batch's loss is 0 (or below), above the first loss is a jump.
    zero = backtrack.Backtrack()
    for loss in (2.0, 0.0):
        zero.accept(loss, params)
    assert not zero.jumped(1.9) and zero.jumped(2.1)


def test_a_jump_at_the_first_step_and_a_lazy_link_are_handled():
    # A non-finite first loss: nothing kept yet and no momentum yet, so
    # only the learning rate is halved. A link whose input size is not
    # known until it is called is kept from the first step it has weights.
    model = chainer.Chain()
    with model.init_scope():
        model.fc = L.Linear(3, 2)
        model.lazy = L.Linear(None, 2)
    rule = backtrack.Backtrack()
    assert rule.jumped(float('nan'))
    rule.undo(1, float('nan'), list(model.namedparams()))
    assert rule.factor == 0.5
    rule.accept(1.0, list(model.namedparams()))
    model.lazy(numpy.ones((1, 4), numpy.float32))
    rule.accept(1.0, list(model.namedparams()))
    kept = model.lazy.W.array.copy()
    model.lazy.W.array[...] = 7
    rule.undo(3, 3.0, list(model.namedparams()))
    numpy.testing.assert_array_equal(model.lazy.W.array, kept)


def test_backtracking_trains_the_cnn_that_diverges_without_the_guard(
        digits, caplog):  # NOQA  (the fixture)
    # The suite's CNN without BatchNorm at lr 1.0, ten times MomentumSGD's
    # best, the guard off: without backtracking its weights overflow within
    # ten steps; with it, the loss jumps on a few early steps, each undone
    # with the learning rate halved, and the run trains.
    with pytest.raises(chainerkfac.NonFiniteError):
        losses('cnn', chainerkfac.optimizers.KFAC(1.0, 0.9, kl_clip=None),
               digits)
    with caplog.at_level(logging.WARNING, logger='chainerkfac.backtrack'):
        trace, warned = losses('cnn', chainerkfac.optimizers.KFAC(
            1.0, 0.9, kl_clip=None, backtrack=True), digits)
    assert numpy.isfinite(trace).all() and not warned
    assert trace[-5:].mean() < 0.5 * trace[0], trace
    said = [r.getMessage() for r in caplog.records]
    assert 2 <= len(said) <= 5, said
    assert 'backtracks at iteration' in said[0]
    assert 'over 2 times the lowest' in said[0]


def test_backtrack_needs_the_training_loss():
    model = L.Classifier(L.Linear(3, 2))
    optimizer = chainerkfac.optimizers.KFAC(backtrack=True)
    optimizer.setup(model)
    loss = model(numpy.ones((4, 3), numpy.float32),
                 numpy.zeros(4, numpy.int32))
    loss.backward()
    with pytest.raises(ValueError, match=r'backtrack=True .*update\(lossfun'):
        optimizer.update()
    assert optimizer.t == 0
    optimizer.update(model, numpy.ones((4, 3), numpy.float32),
                     numpy.zeros(4, numpy.int32))
    assert optimizer.t == 1


@pytest.mark.parametrize('rule', ['graft_average', 'noise_cap'])
def test_a_backtrack_has_the_step_rule_forget_the_undone_steps(rule):
    # A loss made to jump at the fourth step: the rule's averages (and the
    # noise cap's signal and directions) start afresh, so that the next
    # step's length is its own norms', not those of the steps undone.
    model = L.Classifier(L.Linear(3, 2))
    optimizer = chainerkfac.optimizers.KFAC(lr=0.1, backtrack=True,
                                            step_rule=rule)
    optimizer.setup(model)
    rng = numpy.random.RandomState(0)
    scale = [1.0]
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)

    def lossfun(x, t):
        return model(x, t) * scale[0]

    for step in range(1, 6):
        scale[0] = 100.0 if step == 4 else 1.0
        observation = {}
        with reporter.scope(observation):
            optimizer.update(lossfun,
                             rng.randn(4, 3).astype(numpy.float32),
                             rng.randint(0, 2, 4).astype(numpy.int32))
        assert observation['kfac/backtracks'] == (step >= 4)
        forgotten = step == 4
        assert (optimizer.step_rule.averages is None) is forgotten
        if rule == 'noise_cap' and forgotten:
            assert optimizer.step_rule.signal is None
            assert optimizer.step_rule.last is None
