"""The training schemes of Osawa et al. §4, one module each.

Dataset transforms: :class:`TrainTransform`, :class:`ValTransform` (crop,
flip, mean subtraction, scaling) and :class:`RandomErasing`. Batch
converter: :class:`RunningMixup`, with :class:`SoftTargetClassifier` for its
soft-target loss. Trainer extensions: :class:`PolynomialDecay`,
:class:`MomentumAdjustment`, :class:`DampingWarmup`. Optimizer hook:
:class:`WeightRescaling`.
"""
from .damping_warmup import DampingWarmup
from .image_transform import TrainTransform, ValTransform
from .momentum_adjustment import MomentumAdjustment
from .polynomial_decay import PolynomialDecay
from .random_erasing import RandomErasing
from .running_mixup import RunningMixup
from .soft_target import SoftTargetClassifier, soft_target_cross_entropy
from .weight_rescaling import WeightRescaling

__all__ = [
    'DampingWarmup', 'MomentumAdjustment', 'PolynomialDecay',
    'RandomErasing', 'RunningMixup', 'SoftTargetClassifier', 'TrainTransform',
    'ValTransform', 'WeightRescaling', 'soft_target_cross_entropy',
]
