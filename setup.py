import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.develop import develop

PTH = 'chainerkfac-numpy-compat.pth'
HOOK_MODULE = 'chainerkfac_numpy_compat.py'


class BuildPyWithPth(build_py):
    """Ships the start-up hook that lets ``import chainer`` work on NumPy 2.

    A ``.pth`` file must sit at the top of site-packages, which ``packages``
    cannot express; see ``chainerkfac_numpy_compat.py``. An editable install
    (``pip install -e .``) links the sources instead of copying build_lib
    into the wheel, so there the hook goes straight into the wheel's root,
    the folder the install command fills.
    """

    def run(self):
        super().run()
        self.copy_file(PTH, os.path.join(self.build_lib, PTH))
        if getattr(self, 'editable_mode', False):
            install = self.get_finalized_command('install')
            self.copy_file(PTH, os.path.join(install.install_lib, PTH))

    def get_outputs(self, include_bytecode=True):
        return (super().get_outputs(include_bytecode)
                + [os.path.join(self.build_lib, PTH)])


class DevelopWithPth(develop):
    """The same hook for a legacy editable install (``setup.py develop``,
    which pip runs for ``pip install -e .`` without PEP 660). The hook's
    module goes beside it: the sources reach ``sys.path`` through
    ``easy-install.pth``, which site reads after the hook's ``.pth``."""

    def run(self):
        super().run()
        if not self.uninstall:
            for name in (PTH, HOOK_MODULE):
                self.copy_file(name, os.path.join(self.install_dir, name))


setup(
    name='chainerkfac',
    version='0.1.0',
    description='Distributed K-FAC (Kronecker-Factored Approximate Curvature) '
                'for Chainer, ChainerMN and CuPy',
    packages=find_packages(include=['chainerkfac', 'chainerkfac.*']),
    py_modules=['chainerkfac_numpy_compat'],
    cmdclass={'build_py': BuildPyWithPth, 'develop': DevelopWithPth},
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
