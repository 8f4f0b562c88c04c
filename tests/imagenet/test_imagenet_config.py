"""Configuration loading and validation."""
import glob
import json
import os

import pytest

import run_config
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


@pytest.mark.parametrize('name', sorted(TABLE))
def test_table_rows(name):
    config = run_config.load(os.path.join(CONFIGS, name + '.json'))
    batch, lr, momentum, damping, alpha = TABLE[name]
    assert config['batchsize'] == 32
    assert config['batchsize'] * config['gpus'] * config['acc_iters'] == batch
    assert (config['lr'], config['momentum'], config['damping'],
            config['mixup_alpha']) == (lr, momentum, damping, alpha)
    assert config['random_erasing'] == {
        'probability': 0.5, 'area_range': [0.02, 0.25], 'aspect_min': 0.3}
    assert config['momentum_adjustment'] and config['weight_rescaling']


def test_every_shipped_config_loads():
    paths = glob.glob(os.path.join(CONFIGS, '*.json'))
    assert len(paths) == 7
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
    config = run_config.load(os.path.join(CONFIGS, 'bs32k.json'),
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
