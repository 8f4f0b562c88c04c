"""Configuration loading and validation."""
import glob
import json
import os

import chainer
import numpy
import pytest

import chainerkfac
import models
import run_config
import schemes
import train
from chainerkfac import schedules
from run_config import ConfigError

CONFIGS = os.path.join(os.path.dirname(run_config.__file__), 'configs')

#: Paper Table 1 rows: global mini-batch and the published η_0, momentum,
#: damping and mixup α (NOTES §6).
TABLE = {
    'bs4k': (4096, 8.18e-3, 0.997, 2.5e-4, 0.4),
    'bs8k': (8192, 1.25e-2, 0.993, 2.5e-4, 0.4),
    'bs16k': (16384, 2.5e-2, 0.985, 2.5e-4, 0.4),
    'bs32k': (32768, 3.0e-2, 0.97, 2.0e-4, 0.6),
    'bs64k': (65536, 4.0e-2, 0.95, 1.5e-4, 0.6),
    'bs128k': (131072, 7.0e-2, 0.93, 1.0e-4, 1.0),
}


def write(tmp_path, data):
    path = tmp_path / 'config.json'
    path.write_text(json.dumps(data))
    return str(path)


#: Paper Table 1 epochs (ResNet-50) and the original implementation's.
EPOCHS = {'paper': {'bs4k': 35, 'bs8k': 35, 'bs16k': 35, 'bs32k': 45,
                    'bs64k': 60, 'bs128k': 100},
          'original': {'bs4k': 36, 'bs8k': 36, 'bs16k': 36, 'bs32k': 46,
                       'bs64k': 61, 'bs128k': 81}}


@pytest.mark.parametrize('family', sorted(EPOCHS))
@pytest.mark.parametrize('name', sorted(TABLE))
def test_table_rows(family, name):
    config = run_config.load(os.path.join(CONFIGS, family, name + '.json'))
    batch, lr, momentum, damping, alpha = TABLE[name]
    assert config['batchsize'] == 32
    assert config['batchsize'] * config['gpus'] * config['acc_iters'] == batch
    assert (config['lr'], config['momentum'], config['damping'],
            config['mixup_alpha']) == (lr, momentum, damping, alpha)
    assert config['random_erasing'] == {
        'probability': 0.5, 'area_range': [0.02, 0.25], 'aspect_min': 0.3}
    assert config['momentum_adjustment'] and config['weight_rescaling']
    assert config['epochs'] == EPOCHS[family][name]
    # The BatchNorm damping the original code applied (16 x damping: its
    # configs' stab_coeff 64 never reached the optimizer); no guard.
    assert config['bn_damping_multiplier'] == 16.0
    assert config['kl_clip'] is None
    if family == 'paper':
        assert (config['model'], config['bn_fisher']) == ('resnet50',
                                                          'diagonal')
        assert config['damping_warmup'] == {'initial': 100 * damping,
                                            'steps': 500}
    else:
        assert (config['model'], config['bn_fisher']) == ('resnet50d',
                                                          'full')
        assert config['damping_warmup'] is None


def test_stale_fisher_row():
    config = run_config.load(os.path.join(CONFIGS, 'paper',
                                          'bs32k_stale.json'))
    paper = run_config.load(os.path.join(CONFIGS, 'paper', 'bs32k.json'))
    stale = {'stale_fisher': {'warmup': 500, 'growth_period': 39,
                              'max_interval': 20}}
    assert config['factor_interval'] == config['inverse_interval'] == stale
    assert {k: v for k, v in config.items() if k not in (
        'factor_interval', 'inverse_interval', 'description')} == \
        {k: v for k, v in paper.items() if k not in (
            'factor_interval', 'inverse_interval', 'description')}


def shipped():
    return sorted(glob.glob(os.path.join(CONFIGS, '**', '*.json'),
                            recursive=True))


def test_every_shipped_config_loads():
    paths = shipped()
    assert len(paths) == 14  # small, 6 original/, 7 paper/
    for path in paths:
        run_config.load(path)


def test_unknown_key_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'stab_coeff'"):
        run_config.load(write(tmp_path, {'stab_coeff': 64.0}))


def test_unknown_nested_key_is_named(tmp_path):
    path = write(tmp_path, {'lr_decay': {'start': 1, 'end': 5, 'power': 2,
                                         'pwoer': 3}})
    with pytest.raises(ConfigError, match='lr_decay.pwoer'):
        run_config.load(path)


@pytest.mark.parametrize('key,value,message', [
    ('lr', 'fast', 'expected a number'),
    ('lr', 0, 'must lie in'),
    ('momentum', 1.0, 'must lie in'),
    ('acc_iters', 2.5, 'expected an integer'),
    ('acc_iters', 0, 'must be >= 1'),
    ('batchsize', True, 'expected an integer'),
    ('flip', 1, 'expected true or false'),
    ('bn_fisher', 'diag', 'expected one of'),
    ('model', 'vgg16', 'expected one of'),
    ('random_erasing', {'probability': 2, 'area_range': [0.02, 0.25],
                        'aspect_min': 0.3}, 'random_erasing.probability'),
    ('random_erasing', {'probability': 0.5, 'area_range': [0.3, 0.2],
                        'aspect_min': 0.3}, 'exceeds high'),
    ('random_erasing', {'probability': 0.5}, 'random_erasing.area_range'),
    ('lr_decay', {'start': 5, 'end': 5, 'power': 2}, 'lr_decay.end'),
    ('crop_size', 300, 'exceeds image_size'),
    ('damping_warmup', {'initial': 1e-4, 'steps': 10}, 'must exceed'),
    ('factor_interval', 0, 'must be >= 1'),
    ('factor_interval', {'weekly': {}}, 'factor_interval'),
    ('factor_interval', {'stale_fisher': {'warmup': -1}}, 'non-negative'),
])
def test_bad_values(tmp_path, key, value, message):
    with pytest.raises(ConfigError) as info:
        run_config.load(write(tmp_path, {key: value}))
    assert message in str(info.value)
    assert key in str(info.value)


def test_not_an_object(tmp_path):
    with pytest.raises(ConfigError, match='JSON object'):
        run_config.load(write(tmp_path, [1, 2]))


def test_overrides_are_validated_too(tmp_path):
    path = write(tmp_path, {})
    assert run_config.load(path, {'acc_iters': 4})['acc_iters'] == 4
    with pytest.raises(ConfigError, match='acc_iters'):
        run_config.load(path, {'acc_iters': 0})


def test_defaults_fill_missing_keys(tmp_path):
    config = run_config.load(write(tmp_path, {'lr': 0.5}))
    assert set(config) == set(run_config.SCHEMA)
    assert config['lr'] == 0.5 and config['mixup_alpha'] is None


def test_resolved_config_round_trips(tmp_path):
    config = run_config.load(os.path.join(CONFIGS, 'paper', 'bs32k.json'),
                             {'acc_iters': 8, 'gpus': 128})
    path = str(tmp_path / 'resolved.json')
    run_config.save(config, path)
    assert run_config.load(path) == config


def test_intervals():
    assert run_config.make_interval(3) == 3
    schedule = run_config.make_interval(
        {'stale_fisher': {'warmup': 10, 'growth_period': 5,
                          'max_interval': 4}})
    assert isinstance(schedule, schedules.StaleFisher)
    assert schedule(9) == 1 and schedule(100) == 4


@pytest.mark.parametrize('path', shipped(),
                         ids=lambda p: os.path.relpath(p, CONFIGS))
def test_every_shipped_config_trains_a_step(path):
    # Each config's optimizer, hooks, schedules and mixup, as train.py
    # builds them, on the tiny model of the tests (32x32 images).
    config = run_config.load(path, {'model': 'resnet_small', 'gpus': 1,
                                    'acc_iters': 1, 'image_size': 32,
                                    'crop_size': 28})
    numpy.random.seed(0)
    model = schemes.SoftTargetClassifier(models.MODELS['resnet_small'](10))
    optimizer = train.build_optimizer(
        config, chainerkfac.create_communicator('naive'), model)
    rng = numpy.random.RandomState(0)
    data = [(rng.rand(3, 28, 28).astype(numpy.float32), numpy.int32(i % 10))
            for i in range(8)]
    converter = chainer.dataset.concat_examples
    if config['mixup_alpha'] is not None:
        converter = schemes.RunningMixup(config['mixup_alpha'], 10, seed=0)
    updater = chainer.training.StandardUpdater(
        chainer.iterators.SerialIterator(data, 8), optimizer,
        converter=converter)
    trainer = chainer.training.Trainer(updater, (1, 'iteration'))
    train.extend_schedules(trainer, config)
    before = [p.array.copy() for p in model.params()]
    trainer.run()
    assert optimizer.t == 1
    assert all(numpy.isfinite(p.array).all() for p in model.params())
    assert any(not numpy.array_equal(p.array, b)
               for p, b in zip(model.params(), before))
