"""Optimizers of chainerkfac."""
from chainerkfac.optimizers.kfac import KFAC  # NOQA
from chainerkfac.optimizers.kfac import KFACUpdateRule  # NOQA
