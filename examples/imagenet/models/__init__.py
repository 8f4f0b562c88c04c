"""Models of the ImageNet example, by the name a config or ``--model`` uses.

Every model maps images (N, 3, H, W) to class scores (N, n_classes) and is
constructed as ``MODELS[name](n_classes)``.
"""
from .resnet50 import ResNet50, ResNet50D
from .resnet_small import ResNetSmall

MODELS = {
    'resnet50': ResNet50,
    'resnet50d': ResNet50D,
    'resnet_small': ResNetSmall,
}
