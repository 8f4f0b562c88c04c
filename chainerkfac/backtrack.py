"""Backtracking: a safety net whose only inputs are the run's own losses.

With ``KFAC(backtrack=True)``, every step first compares its training loss
``ℓ_t``, measured at the current weights ``w_t`` (which
``update(lossfun, *batch)`` gives the optimizer), with the losses the run
had before. The loss has *jumped* when ::

    ℓ_t not finite,   or   ℓ_t > ℓ_1  and  ℓ_t > RISE · max(min_{s<t} ℓ_s, 0)

(``ℓ_1`` the first loss, ``RISE`` = 2): the loss is back above where the
run started, and over twice the lowest it reached (a batch whose loss
reached 0 leaves the first test alone). The steps since the
last loss that passed went too far. The optimizer then

* puts the weights back to ``w_a``, those at the lowest loss so far, and
  skips the step (the gradient at ``w_t`` is not used). The weights of
  the last step that passed can already be damaged: a loss that climbs
  for a few steps passes every test until it jumps;
* zeroes the momentum, which carried the run up the slope (O'Donoghue &
  Candès 2015, "Adaptive restart for accelerated gradient schemes", §3.2:
  a restart where the objective rises);
* has the step rule forget the run's steps
  (:meth:`~chainerkfac.step_rule.StepRule.forget`): the running averages
  of ``step_rule='graft_average'`` hold the norms of the steps that went
  too far and would keep the next steps as long;
* halves the learning rate for the rest of the run: every later step is
  ``s η`` times the rule's, ``s = 2^-k`` after ``k`` backtracks, whatever
  ``η``'s schedule does (the learning rate that led there was too large).

Both tests are ratios of the run's own losses: there is no scale to set.
The losses are every process's mean (the same on every process, as in
one process on the same global batch). Costs: a copy of the parameters
(their memory again, and a copy at each new lowest loss), and in a
distributed run one all-reduce of a number per step. Each backtrack is
logged and reported (``kfac/backtracks``: how many so far); the state
(``ℓ_1``, the lowest loss, ``k``, ``w_a``) is part of the optimizer's
snapshot.
"""
import logging
import math

import chainer

from chainerkfac import divergence

logger = logging.getLogger(__name__)

#: The loss has jumped above this multiple of its lowest (and above its
#: first value).
RISE = 2.0


class Backtrack:
    """The loss test and what a jump undoes, for one optimizer's
    parameters."""

    def __init__(self):
        #: ``ℓ_1`` and ``min ℓ_s`` of the steps that passed (``None``
        #: before the first).
        self.first_loss = None
        self.lowest_loss = None
        #: ``k``: the backtracks so far; the learning rate is ``2^-k`` times
        #: the schedule's.
        self.count = 0
        #: ``w_a`` by parameter name (a lazy link's from its first call).
        self._saved = {}

    @property
    def factor(self):
        """``s = 2^-k``, the factor of every step's length."""
        return 0.5 ** self.count

    def jumped(self, loss):
        """Whether ``loss`` (the step's, every process's mean) has jumped."""
        if not math.isfinite(loss):
            return True
        # A batch's loss can reach 0 (or a loss be negative): "twice the
        # lowest" then says nothing, and "above the first" alone decides.
        return self.first_loss is not None and loss > self.first_loss \
            and loss > RISE * max(self.lowest_loss, 0.0)

    def accept(self, loss, params):
        """Records the passing ``loss`` and, where it is the lowest so far,
        keeps the weights of ``params`` (``(name, param)`` pairs) it was
        measured at; a parameter with nothing kept yet (a lazy link's,
        from its first call) is kept whatever the loss."""
        lowest = self.first_loss is None or loss < self.lowest_loss
        if self.first_loss is None:
            self.first_loss = loss
        if lowest:
            self.lowest_loss = loss
        for name, param in params:
            kept = self._saved.get(name)
            if kept is None:
                if param.array is not None:
                    self._saved[name] = param.array.copy()
            elif lowest:
                kept[...] = param.array

    def undo(self, step, loss, params):
        """Puts the kept weights back into ``params`` and zeroes their
        momentum (``MomentumSGDRule``'s ``v``); halves every later step."""
        self.count += 1
        for name, param in params:
            if name in self._saved:
                param.array[...] = self._saved[name]
            # (No state before a parameter's first update.)
            state = param.update_rule and param.update_rule.state
            if state and 'v' in state:
                state['v'].fill(0)
        logger.warning(
            'K-FAC backtracks at iteration %d: the training loss %.4g %s; '
            'the weights are those at the lowest loss, the momentum is '
            'zeroed, and the learning rate is %.4g times '
            "the schedule's from now on", step, loss,
            'is not finite' if not math.isfinite(loss) else
            'is above the first loss {:.4g} and over {:g} times the lowest '
            '{:.4g}'.format(self.first_loss, RISE, self.lowest_loss),
            self.factor)

    def serialize(self, serializer, params):
        """Saves or loads the losses, the count and the kept weights of
        ``params`` (``(name, param)`` pairs). A snapshot without them
        (written without ``backtrack``) starts the test
        afresh at the next step, which is said."""
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        try:
            first = divergence.serialize_loss(serializer, 'first_loss',
                                              self.first_loss)
            lowest = divergence.serialize_loss(serializer, 'lowest_loss',
                                               self.lowest_loss)
            count = int(serializer('count', self.count))
            saved = self._saved
            if loading and first is not None:
                saved = {name: param.array.copy() for name, param in params
                         if param.array is not None}
            for name, array in saved.items():
                serializer['weights'](name.lstrip('/').replace('/', '.'),
                                      array)
        except KeyError:
            logger.warning('the snapshot holds no state of backtrack: its '
                           'loss test starts afresh at the next step')
            return
        if loading:
            self.first_loss, self.lowest_loss = first, lowest
            self.count, self._saved = count, saved
