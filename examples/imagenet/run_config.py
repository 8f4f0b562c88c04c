"""Training configuration: one JSON object, validated against a schema.

Every key the training script reads is declared in :data:`SCHEMA` with its
default and its check; a file may leave keys out (they take the default) but
an unknown key, a value of the wrong type or out of range raises
:class:`ConfigError` naming the key. (The original implementation merged its
JSON into the command-line namespace and silently ignored keys such as
``stab_coeff`` that nothing read.) :func:`save` writes the resolved
configuration, which :func:`load` reads back unchanged.

The configurations of paper Table 1 live in ``configs/paper/`` (as the paper
ran them) and ``configs/original/`` (as the original implementation's code
applied its published values; README.md compares them); ``gpus`` states the
number of processes (GPUs) a row assumes, and the global mini-batch is
``batchsize x processes x acc_iters``.
"""
import json
import numbers

from chainerkfac import schedules

import models


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


def _fail(key, message):
    raise ConfigError('config key {!r}: {}'.format(key, message))


def integer(minimum=None):
    def check(key, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            _fail(key, 'expected an integer, got {!r}'.format(value))
        if minimum is not None and value < minimum:
            _fail(key, 'must be >= {}, got {}'.format(minimum, value))
        return int(value)
    return check


def number(low=None, high=None, low_open=False, high_open=False):
    """A real number in the interval given by its bounds."""
    def check(key, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            _fail(key, 'expected a number, got {!r}'.format(value))
        if ((low is not None and (value < low or low_open and value == low))
                or (high is not None
                    and (value > high or high_open and value == high))):
            _fail(key, 'must lie in {}{}, {}{}, got {}'.format(
                '(' if low_open else '[', '-inf' if low is None else low,
                'inf' if high is None else high, ')' if high_open else ']',
                value))
        return value
    return check


def boolean(key, value):
    if not isinstance(value, bool):
        _fail(key, 'expected true or false, got {!r}'.format(value))
    return value


def string(key, value):
    if not isinstance(value, str):
        _fail(key, 'expected a string, got {!r}'.format(value))
    return value


def choice(*options):
    def check(key, value):
        if value not in options:
            _fail(key, 'expected one of {}, got {!r}'.format(
                ', '.join(map(repr, options)), value))
        return value
    return check


def optional(inner):
    """``null`` (the scheme is off) or what ``inner`` accepts."""
    def check(key, value):
        return None if value is None else inner(key, value)
    return check


def section(fields):
    """A JSON object with exactly the keys of ``fields`` (all required)."""
    def check(key, value):
        if not isinstance(value, dict):
            _fail(key, 'expected an object, got {!r}'.format(value))
        for name in value:
            if name not in fields:
                _fail('{}.{}'.format(key, name), 'unknown key (known: {})'
                      .format(', '.join(sorted(fields))))
        for name in fields:
            if name not in value:
                _fail('{}.{}'.format(key, name), 'missing')
        return {name: fields[name]('{}.{}'.format(key, name), value[name])
                for name in fields}
    return check


def pair(inner):
    """A list ``[low, high]`` with ``low <= high``."""
    def check(key, value):
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            _fail(key, 'expected [low, high], got {!r}'.format(value))
        low, high = (inner(key, v) for v in value)
        if low > high:
            _fail(key, 'low {} exceeds high {}'.format(low, high))
        return [low, high]
    return check


#: JSON forms of the stale-Fisher schedules of :mod:`chainerkfac.schedules`.
INTERVAL_SCHEDULES = {
    'stale_fisher': schedules.StaleFisher,
    'adaptive': schedules.Adaptive,
}


def make_interval(value):
    """The optimizer's interval argument for a config value.

    ``k`` refreshes every ``k`` steps; ``{"stale_fisher": {...}}`` and
    ``{"adaptive": {...}}`` build the library's schedules with those keyword
    arguments.
    """
    if isinstance(value, dict):
        (name, kwargs), = value.items()
        return INTERVAL_SCHEDULES[name](**kwargs)
    return value


def interval(key, value):
    if isinstance(value, dict):
        if len(value) != 1 or next(iter(value)) not in INTERVAL_SCHEDULES:
            _fail(key, 'expected an integer or an object with one key of {}, '
                  'got {!r}'.format(', '.join(INTERVAL_SCHEDULES), value))
        try:
            make_interval(value)
        except (TypeError, ValueError) as e:
            _fail(key, str(e))
        return value
    return integer(1)(key, value)


positive = number(0, low_open=True)
fraction = number(0, 1)

#: key -> (default, check). The defaults describe plain K-FAC on ImageNet
#: with the crop, flip, mean and scaling of §4.1 and every other scheme off.
SCHEMA = {
    'description': ('', string),
    # Model and batch.
    'model': ('resnet50', choice(*sorted(models.MODELS))),
    'gpus': (1, integer(1)),
    'batchsize': (32, integer(1)),
    'acc_iters': (1, integer(1)),
    'val_batchsize': (32, integer(1)),
    'epochs': (35, integer(1)),
    'iterations': (None, optional(integer(1))),
    'seed': (0, integer(0)),
    # Data augmentation (§4.1).
    'image_size': (256, integer(1)),
    'crop_size': (224, integer(1)),
    'random_crop': (True, boolean),
    'flip': (True, boolean),
    'subtract_mean': (True, boolean),
    'scale': (1.0 / 255, positive),
    'random_erasing': (None, optional(section({
            'probability': fraction,
            'area_range': pair(number(0, 1, low_open=True)),
            'aspect_min': number(0, 1, low_open=True)}))),
    'mixup_alpha': (None, optional(positive)),
    # Learning rate and momentum (§4.4).
    'lr': (0.01, positive),
    'lr_decay': (None, optional(section({
        'start': number(0), 'end': positive, 'power': positive}))),
    'momentum': (0.9, number(0, 1, high_open=True)),
    'momentum_adjustment': (False, boolean),
    # K-FAC: damping (§4.2, §4.3), curvature and stale Fisher (§5.4).
    'damping': (1e-3, positive),
    'damping_warmup': (None, optional(section({
        'initial': positive, 'steps': integer(1)}))),
    'bn_damping_multiplier': (1.0, positive),
    # The bound on the step's KL change (Ba et al. 2017 §5): the paper ran
    # without it, so the configs do unless they set it.
    'kl_clip': (None, optional(positive)),
    # The paper's step is the natural-gradient step η F̂⁻¹∇, not the
    # optimizer's default (chainerkfac.step_rule).
    'step_rule': ('natural', choice('natural', 'kl_graft')),
    'bn_fisher': ('diagonal', choice('diagonal', 'full')),
    'inverse': ('cholesky', choice('cholesky', 'eigen')),
    'cov_ema_decay': (0.0, number(0, 1, high_open=True)),
    'factor_interval': (1, interval),
    'inverse_interval': (1, interval),
    'weight_decay': (0.0, number(0)),
    # Weight rescaling (§4.5).
    'weight_rescaling': (False, boolean),
}


def validate(raw):
    """Checks a configuration dict and fills in the defaults.

    Returns a new dict with every key of :data:`SCHEMA`.
    """
    if not isinstance(raw, dict):
        raise ConfigError('a configuration is a JSON object, got {!r}'
                          .format(raw))
    for key in raw:
        if key not in SCHEMA:
            raise ConfigError('unknown config key {!r} (known keys: {})'
                              .format(key, ', '.join(SCHEMA)))
    config = {key: check(key, raw.get(key, default))
              for key, (default, check) in SCHEMA.items()}
    if config['crop_size'] > config['image_size']:
        _fail('crop_size', 'exceeds image_size {}'
              .format(config['image_size']))
    decay = config['lr_decay']
    if decay is not None and not decay['end'] > decay['start']:
        _fail('lr_decay.end', 'must exceed lr_decay.start')
    warmup = config['damping_warmup']
    if warmup is not None and not warmup['initial'] > config['damping']:
        _fail('damping_warmup.initial', 'must exceed the target damping {}'
              .format(config['damping']))
    return config


def load(path, overrides=None):
    """Reads and validates a JSON configuration.

    Args:
        path (str): The JSON file.
        overrides (dict): Keys to replace, e.g. from the command line.
    """
    with open(path, encoding='utf-8') as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError('{}: not valid JSON: {}'.format(path, e)) \
                from None
    if isinstance(raw, dict):
        raw.update(overrides or {})
    try:
        return validate(raw)
    except ConfigError as e:
        raise ConfigError('{}: {}'.format(path, e)) from None


def save(config, path):
    """Writes a (validated) configuration as JSON."""
    with open(path, 'w', encoding='utf-8') as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write('\n')
