"""Checks of :class:`~chainerkfac.optimizers.KFAC`'s options and
hyperparameters, each raising ``ValueError`` (``TypeError`` for a wrong
kind of schedule) that names the option and what it must be."""
import difflib
import inspect
import numbers

from chainerkfac import schedules
from chainerkfac.curvature import base
from chainerkfac import step_rule as step_rule_module

INVERSES = ('cholesky', 'eigen')
BN_FISHERS = ('diagonal', 'full')
NONFINITE = ('raise', 'skip')
DIVERGENCE = ('warn', 'raise')
CONV_FACTORS = ('expanded', 'reduced')

#: Hyperparameter -> (whether a number is in range, the rule in words).
HYPERPARAMETER_RULES = {
    'lr': (lambda v: v >= 0, 'a real number >= 0'),
    'momentum': (lambda v: 0 <= v < 1, 'a real number in [0, 1)'),
    'damping': (lambda v: v > 0, 'a real number > 0'),
    'cov_ema_decay': (lambda v: 0 <= v < 1, 'a real number in [0, 1)'),
    'weight_decay': (lambda v: v >= 0, 'a real number >= 0'),
    'bn_damping_multiplier': (lambda v: v > 0, 'a real number > 0'),
    'kl_clip': (lambda v: v > 0, 'a real number > 0, or None'),
}


#: The names other K-FAC and SGD implementations (kfac-pytorch, kfac-jax,
#: Chainer's and PyTorch's optimizers) give KFAC's options.
SYNONYMS = {
    'learning_rate': 'lr', 'alpha': 'lr', 'mu': 'momentum',
    'dampening': 'damping', 'l2_reg': 'weight_decay',
    'factor_decay': 'cov_ema_decay', 'stat_decay': 'cov_ema_decay',
    'ema_decay': 'cov_ema_decay', 'factor_update_steps': 'factor_interval',
    'factor_update_freq': 'factor_interval',
    'inv_update_steps': 'inverse_interval',
    'inv_update_freq': 'inverse_interval',
    'accumulation_steps': 'acc_iters', 'clip': 'kl_clip',
}


def set_hyperparameters(hp, **values):
    """Sets and checks the hyperparameters ``values`` (``lr``,
    ``momentum``, ...) on the ``chainer.optimizer.Hyperparameter`` ``hp``."""
    for name, value in values.items():
        setattr(hp, name, value)
    check_hyperparameters(hp)


def configure(optimizer, inverse, bn_fisher, nonfinite, divergence,
              step_rule, factor_interval, inverse_interval, inverse_delay,
              acc_iters, spatial_subsample, batch_subsample, conv_factors,
              doubly_factored_from, max_skipped_steps, precondition,
              independent_processes):
    """Checks :class:`~chainerkfac.optimizers.KFAC`'s constructor options
    and sets them, as attributes of the same names, on ``optimizer``
    (``precondition`` as ``use_kfac``; ``factor_interval=None`` is
    :class:`~chainerkfac.schedules.Adaptive`)."""
    optimizer.inverse = choice(inverse, INVERSES, 'inverse')
    optimizer.bn_fisher = choice(bn_fisher, BN_FISHERS, 'bn_fisher')
    optimizer.nonfinite = choice(nonfinite, NONFINITE, 'nonfinite')
    optimizer.divergence = choice(divergence, DIVERGENCE, 'divergence')
    optimizer.step_rule = step_rule_module.get(step_rule)
    optimizer.factor_interval = factor_intervals(
        schedules.Adaptive() if factor_interval is None else factor_interval)
    optimizer.inverse_interval = inverse_schedule(inverse_interval)
    optimizer.inverse_delay = count(inverse_delay, 'inverse_delay')
    optimizer.acc_iters = positive_int(acc_iters, 'acc_iters')
    optimizer.spatial_subsample = positive_int(spatial_subsample,
                                               'spatial_subsample')
    optimizer.batch_subsample = positive_int(batch_subsample,
                                             'batch_subsample')
    optimizer.conv_factors = conv_factor_form(conv_factors,
                                              optimizer.spatial_subsample)
    optimizer.doubly_factored_from = None if doubly_factored_from is None \
        else positive_int(doubly_factored_from, 'doubly_factored_from')
    optimizer.max_skipped_steps = positive_int(max_skipped_steps,
                                               'max_skipped_steps')
    optimizer.use_kfac = bool(precondition)
    optimizer.independent_processes = bool(independent_processes)


def block_options(optimizer):
    """The :class:`~chainerkfac.curvature.base.BlockOptions` every Fisher
    block of ``optimizer`` is built with."""
    return base.BlockOptions(
        factor_intervals=optimizer.factor_interval,
        inverse_interval=optimizer.inverse_interval,
        inverse=optimizer.inverse, bn_fisher=optimizer.bn_fisher,
        spatial_subsample=optimizer.spatial_subsample,
        batch_subsample=optimizer.batch_subsample,
        conv_factors=optimizer.conv_factors,
        doubly_factored_from=optimizer.doubly_factored_from)


def reject_unknown(unknown, signature_of):
    """Raises ``TypeError`` for the first of the keyword arguments
    ``unknown`` that the function ``signature_of`` does not take, naming
    the option meant: a synonym's, else the nearest name."""
    if not unknown:
        return
    known = [name for name, p in inspect.signature(
        signature_of).parameters.items()
        if p.kind is p.POSITIONAL_OR_KEYWORD and name != 'self']
    name = sorted(unknown)[0]
    meant = SYNONYMS.get(name) or next(iter(
        difflib.get_close_matches(name, known, n=1, cutoff=0.6)), None)
    hint = '' if meant is None else ": did you mean {}=?".format(meant)
    raise TypeError('KFAC got an unexpected option {}={!r}{} (its options: '
                    '{})'.format(name, unknown[name], hint, ', '.join(known)))


def check_hyperparameters(hp, when='construction'):
    """Raises ``ValueError`` naming the first hyperparameter that is not a
    real number in its range (``kl_clip`` may be None: the bound is off).

    Run at construction and at the start of every update, since extensions
    (``ExponentialShift``, ``LinearShift``) and users set them at run time.
    """
    for name, (in_range, rule) in HYPERPARAMETER_RULES.items():
        value = getattr(hp, name)
        if name == 'kl_clip' and value is None:
            continue
        if not (_real(value) and in_range(value)):
            raise ValueError('KFAC {} must be {}, got {!r} (at {})'.format(
                name, rule, value, when))


def _real(value):
    """Whether ``value`` is a real number (not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def choice(value, choices, what):
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        raise ValueError('KFAC {} must be one of {}, got {!r}'
                         .format(what, ', '.join(map(repr, choices)), value))
    return value


def conv_factor_form(value, spatial_subsample):
    """The ``conv_factors`` option; ``'reduced'`` sums every position, so
    it refuses a ``spatial_subsample`` that would leave some out."""
    value = choice(value, CONV_FACTORS, 'conv_factors')
    if value == 'reduced' and spatial_subsample != 1:
        raise ValueError(
            "KFAC spatial_subsample must be 1 with conv_factors='reduced', "
            'got {!r}: the reduced factors sum each sample over every '
            'position, at a cost that subsampling would barely '
            'lower'.format(spatial_subsample))
    return value


def positive_int(value, what, least=1):
    """``value`` if it is an int >= ``least``."""
    if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
            or value < least):
        raise ValueError('KFAC {} must be an int >= {}, got {!r}'
                         .format(what, least, value))
    return value


def count(value, what):
    """``value`` if it is an int >= 0."""
    return positive_int(value, what, least=0)


def factor_intervals(value):
    """``{'A': interval, 'G': interval}`` from the ``factor_interval``
    option: one interval for both, or a dict with exactly those keys."""
    if isinstance(value, dict):
        unknown = set(value) - {'A', 'G'}
        if unknown or len(value) != 2:
            raise ValueError("KFAC factor_interval as a dict needs "
                             "exactly the keys 'A' and 'G', got {}"
                             .format(sorted(value)))
        return {k: schedules.check_interval(v, 'factor_interval[{!r}]'
                                            .format(k))
                for k, v in value.items()}
    interval = schedules.check_interval(value, 'factor_interval')
    return {'A': interval, 'G': interval}


def inverse_schedule(value):
    """The ``inverse_interval`` option, which cannot be adaptive."""
    interval = schedules.check_interval(value, 'inverse_interval')
    if isinstance(interval, schedules.Adaptive):
        raise TypeError('KFAC inverse_interval cannot be Adaptive: '
                        'change rates are measured on factors')
    return interval


def option_values(optimizer):
    """:meth:`KFAC.option_values
    <chainerkfac.optimizers.KFAC.option_values>` of ``optimizer``."""
    values = {name: getattr(optimizer.hyperparam, name)
              for name in HYPERPARAMETER_RULES}
    values.update(
        inverse=optimizer.inverse, bn_fisher=optimizer.bn_fisher,
        factor_interval_A=optimizer.factor_interval['A'],
        factor_interval_G=optimizer.factor_interval['G'],
        inverse_interval=optimizer.inverse_interval,
        inverse_delay=optimizer.inverse_delay,
        acc_iters=optimizer.acc_iters,
        spatial_subsample=optimizer.spatial_subsample,
        batch_subsample=optimizer.batch_subsample,
        conv_factors=optimizer.conv_factors,
        doubly_factored_from=optimizer.doubly_factored_from,
        nonfinite=optimizer.nonfinite, divergence=optimizer.divergence,
        max_skipped_steps=optimizer.max_skipped_steps,
        precondition=optimizer.use_kfac, step_rule=optimizer.step_rule,
        independent_processes=optimizer.independent_processes)
    return {name: option_text(value) for name, value in values.items()}


def whole_model_hooks(hookable):
    """:meth:`KFAC.whole_model_hooks
    <chainerkfac.optimizers.KFAC.whole_model_hooks>` of the hooks in
    Chainer's registry ``hookable``."""
    return [name for name, hook in hookable._pre_update_hooks.items()
            if not getattr(hook, 'call_for_each_param', False)]


def hook_descriptions(hookable):
    """:meth:`KFAC.hook_descriptions
    <chainerkfac.optimizers.KFAC.hook_descriptions>` of the hooks in
    Chainer's registry ``hookable`` (``None`` before setup: none)."""
    if hookable is None:
        return []
    return ['{} ({}): {}'.format(name, timing, ', '.join(
        '{}={}'.format(key, option_text(value))
        for key, value in sorted(vars(hook).items())
        if not key.startswith('_')))
        for timing, registry in (
            ('pre', hookable._pre_update_hooks),
            ('post', hookable._post_update_hooks))
        for name, hook in registry.items()]


def option_text(value):
    """``value`` as text that two processes which set the same value print
    alike (a plain function by its name, not its address)."""
    text = repr(value)
    if ' at 0x' in text:
        # A function's repr holds its address, which differs by process.
        return 'callable {}.{}'.format(
            getattr(value, '__module__', '?'),
            getattr(value, '__qualname__', type(value).__name__))
    return text
