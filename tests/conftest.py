# chainerkfac applies the NumPy-2 shims before anything imports Chainer.
import chainerkfac  # NOQA

from tests import device


def pytest_addoption(parser):
    parser.addoption(
        '--device', default='@numpy',
        help="Chainer device the numerical tests run on, e.g. '@cupy:0'")


def pytest_configure(config):
    device.select(config.getoption('--device'))
