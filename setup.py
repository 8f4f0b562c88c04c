import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

PTH = 'chainerkfac-numpy-compat.pth'


class BuildPyWithPth(build_py):
    """Ships the start-up hook that lets ``import chainer`` work on NumPy 2.

    A ``.pth`` file must sit at the top of site-packages, which ``packages``
    cannot express; see ``chainerkfac_numpy_compat.py``.
    """

    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return (super().get_outputs(include_bytecode)
                + [os.path.join(self.build_lib, PTH)])


setup(
    name='chainerkfac',
    version='0.1.0',
    description='Distributed K-FAC (Kronecker-Factored Approximate Curvature) '
                'for Chainer, ChainerMN and CuPy',
    packages=find_packages(include=['chainerkfac', 'chainerkfac.*']),
    py_modules=['chainerkfac_numpy_compat'],
    cmdclass={'build_py': BuildPyWithPth},
    python_requires='>=3.9',
    install_requires=[
        'chainer==7.8.1',
        'numpy>=1.26',
        'scipy',
        'threadpoolctl>=3',
        'mpi4py>=4',
    ],
    extras_require={'mpich': ['mpich']},
)
