"""The curvature stage of a step: fold the batch's statistics into the
factors, ``C <- d C + (1 - d) C_new`` (Osawa et al. 2019 §5.1), and
refresh the damped inverses that are due, at once or in the background
under ``inverse_delay`` (Ba, Grosse & Martens 2017 §3.1:
:mod:`chainerkfac.background`)."""
import logging

from chainerkfac import cpu_parallel
from chainerkfac.curvature import base

logger = logging.getLogger(__name__)


def fold(optimizer, blocks, stats):
    """``block.update_factors`` for every block of ``blocks`` in
    ``stats`` (``{block: {factor: batch mean}}``); returns ``{block:
    {factor: change rate}}``. Under ``nonfinite='skip'`` a block's
    non-finite statistics are dropped (and counted as a refresh, as the
    other processes count it: they follow the owner's schedule)."""
    rates = {}
    for block in blocks:
        if block not in stats:
            continue
        try:
            rates[block] = block.update_factors(
                optimizer.t, stats[block],
                optimizer.hyperparam.cov_ema_decay)
        except base.NonFiniteError:
            if optimizer.nonfinite == 'raise':
                raise
            logger.warning('iteration %d: dropped non-finite statistics of '
                           '%s', optimizer.t, block.name)
            for f in stats[block]:
                block.schedules[f].mark(optimizer.t)
            rates[block] = {}
    return rates


def inverses(optimizer, blocks):
    """Refreshes the inverses of ``blocks`` that are due; returns the blocks
    whose inverse changed at this step. An inverse on its way since step
    ``t - d`` goes in place first, so that step ``t`` can start the next
    one; under ``inverse_delay`` the inverses that replace one go to the
    background worker (one thread), the first ones are built now."""
    step, hp, delay = optimizer.t, optimizer.hyperparam, \
        optimizer.inverse_delay
    refreshed = []
    ready = [block for block in blocks if block.pending is not None
             and block.pending[0] <= step]
    if ready:
        # Waits for the worker only if it is late.
        with optimizer.timing('inversion'):
            refreshed = [block for block in ready
                         if block.take_pending(step)]
    due = [block for block in blocks
           if block.inverse_due(step, block.effective_damping(hp))]
    if due:
        with optimizer.timing('inversion'):
            now = [block for block in due
                   if not delay or block.form is None]
            for block in [b for b in due if b not in now]:
                block.update_inverse(step, block.effective_damping(hp),
                                     delay)
            refreshed += [block for block, done in zip(
                now, cpu_parallel.map_blocks(
                    lambda block: block.update_inverse(
                        step, block.effective_damping(hp)),
                    now, cpu_parallel.block_work('inverse_cost')))
                if done]
    return refreshed


def report(rates, refreshed):
    """The refresh's reported values: ``kfac/factor_refreshes`` (factors
    refreshed this step), ``kfac/inverse_refreshes`` and, on steps that
    refreshed a factor, ``kfac/change_rate`` (their mean change rate)."""
    measured = [r for block_rates in rates.values()
                for r in block_rates.values() if r is not None]
    values = {'kfac/factor_refreshes': sum(map(len, rates.values())),
              'kfac/inverse_refreshes': len(refreshed)}
    if measured:
        values['kfac/change_rate'] = sum(measured) / len(measured)
    return values
