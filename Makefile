# Two commands do all set-up: `make demo` and `make test`. Each bootstraps the
# virtual environment it needs on first use.
PYTHON ?= python3
VENV := .venv
VENV_NP1 := .venv-np1

# Chainer 7.8.1 is an sdist whose setup.py imports pkg_resources: keep the
# isolated build on setuptools<81. pip 23 reads PIP_CONSTRAINT for the build
# environment too; pip >= 26.2 reads PIP_BUILD_CONSTRAINT instead.
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_BUILD_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

PYTEST_FLAGS ?= -q

.PHONY: demo compare test test-numpy2 test-numpy1 lint clean

PKG_SOURCES := setup.py chainerkfac_numpy_compat.py chainerkfac-numpy-compat.pth \
	$(shell find chainerkfac -name '*.py')

# One environment per NumPy major version: $(1) is the folder, $(2) the NumPy
# requirement. The dependencies are installed once; the package itself is
# re-installed whenever its sources change (a copy, not an editable install:
# the tests run the sources through PYTHONPATH and the installed copy is
# what a user of the package gets).
define venv_rules
$(1)/.deps: requirements.txt requirements-dev.txt constraints.txt
	rm -rf $(1)
	$(PYTHON) -m venv $(1)
	$(1)/bin/pip install --quiet "setuptools<81" wheel
	$(1)/bin/pip install --quiet -r requirements-dev.txt "$(2)"
	touch $$@

$(1)/.installed: $(1)/.deps $(PKG_SOURCES)
	$(1)/bin/pip install --quiet --no-build-isolation --no-deps --force-reinstall .
	rm -rf build
	touch $$@
endef

# NumPy 2.x: the stack CuPy 14 needs.
$(eval $(call venv_rules,$(VENV),numpy>=2))
# NumPy 1.26: the last 1.x release, still common beside older CUDA stacks.
NUMPY1 := numpy>=1.26,<2
$(eval $(call venv_rules,$(VENV_NP1),$(NUMPY1)))

# The main job: a short distributed K-FAC training (2 MPI processes) of the
# ImageNet example on real images that ship with scikit-learn (the digits,
# written as JPEG files), no downloads. Prints accuracy per epoch and leaves
# plots in result/demo. One BLAS thread per process: two processes share two
# cores. Images load in the training processes (--loaderjob 0), so that the
# seed fixes the run: two runs print the same numbers.
DEMO_DATA := result/demo/data
demo: $(VENV)/.installed
	@echo "make demo: the ImageNet example's small ResNet with the paper's recipe"
	@echo "(configs/small.json: the natural step, damping warm-up, factors every"
	@echo "step) on 2 CPU processes; 'make compare' runs the one-line swap"
	@echo "KFAC(lr, momentum) against MomentumSGD on the digits."
	$(VENV)/bin/python examples/imagenet/prepare.py digits $(DEMO_DATA)
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 $(VENV)/bin/mpiexec -n 2 \
		$(VENV)/bin/python examples/imagenet/train.py \
		$(DEMO_DATA)/train.txt $(DEMO_DATA)/val.txt \
		--config examples/imagenet/configs/small.json --out result/demo \
		--loaderjob 0

# K-FAC against MomentumSGD in one process on the same digits (8x8 arrays).
compare: $(VENV)/.installed
	$(VENV)/bin/python examples/digits/train_digits.py --out result/compare

test-numpy2: $(VENV)/.installed
	$(VENV)/bin/python -m pytest $(PYTEST_FLAGS) tests

test-numpy1: $(VENV_NP1)/.installed
	$(VENV_NP1)/bin/python -m pytest $(PYTEST_FLAGS) tests

# pytest exits 5 when it collects nothing; make treats that as a failure.
test: test-numpy2 test-numpy1

# Style (flake8, settings in .flake8); CI runs it beside the tests.
lint: $(VENV)/.deps
	$(VENV)/bin/python -m flake8

# The documentation site (issue #7): `make docs` builds docs/_build/html.
# Sphinx goes into .venv beside the test requirements rather than into a venv
# of its own: autodoc imports chainerkfac, so it needs the very Chainer, NumPy
# and MPI stack the tests use, and a second venv would build Chainer's sdist
# again. The stamp lives inside .venv, so a rebuilt .venv reinstalls it.
# -W --keep-going: every warning is an error, and all of them are listed; -E:
# a fresh environment each time, so that the warnings of pages that did not
# change are not hidden by an incremental build.
.PHONY: docs
$(VENV)/.docs-deps: $(VENV)/.deps requirements-docs.txt
	$(VENV)/bin/pip install --quiet -r requirements-docs.txt
	touch $@

docs: $(VENV)/.docs-deps
	$(VENV)/bin/python -m sphinx -W --keep-going -E -b html docs docs/_build/html

# Benchmarks (issue #5): quick-mode runs of every script under benchmarks/,
# then docs/benchmarks.md rewritten from their JSON. Never part of `make test`.
.PHONY: bench
bench: $(VENV)/.installed
	PYTHONPATH=. $(VENV)/bin/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) $(VENV_NP1) result docs/_build
