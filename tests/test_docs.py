"""The documentation cannot rot: docstrings, API reference and examples.

* Every public name has a docstring, and the API reference (docs/reference)
  has an autodoc entry for it.
* Every ```python block of the Markdown pages under docs/ (and every
  ``.. code-block:: python`` of the reStructuredText pages) runs, page by
  page, in order, in one namespace per page. A block preceded by the line
  ``<!-- not-run: REASON -->`` is not run (a GPU, mpiexec); the reason is
  required. The namespace starts with what the pages say their snippets
  use: ``chainer``, ``chainerkfac``, ``numpy``, ``F``, ``L``; ``CNN`` and
  ``digits`` from docs/examples/train_digits.py; ``model`` (a
  ``L.Classifier(CNN())``), ``train`` and ``test`` (the digits data sets),
  and ``x, t`` (a batch of 64 training examples).
* The two complete examples run: docs/examples/train_digits.py in this
  process, docs/examples/train_digits_mpi.py under ``mpiexec -n 2``, resumed
  from its per-rank snapshots.

``make docs`` builds the site itself (Sphinx, warnings as errors); these
tests need no Sphinx.
"""
import importlib
import inspect
import json
import os
import re
import runpy
import shutil
import sys

import chainerkfac
import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest
import threadpoolctl

from tests import mpi_helpers

DOCS = os.path.join(mpi_helpers.REPO_ROOT, 'docs')
EXAMPLES = os.path.join(DOCS, 'examples')
SINGLE_EXAMPLE = os.path.join(EXAMPLES, 'train_digits.py')
MPI_EXAMPLE = os.path.join(EXAMPLES, 'train_digits_mpi.py')

#: The modules whose exported names are public API.
PUBLIC_MODULES = [
    'chainerkfac',
    'chainerkfac.optimizers',
    'chainerkfac.schedules',
    'chainerkfac.step_rule',
    'chainerkfac.curvature',
    'chainerkfac.linalg',
    'chainerkfac.cpu_parallel',
    'chainerkfac.distributed',
    'chainerkfac.hooks',
    'chainerkfac.averaging',
]


@pytest.fixture(autouse=True)
def one_blas_thread():
    """The snippets' matrices are small: one BLAS thread is as fast, and
    unlike two it stays fast when other processes share the two cores (the
    MPI runs set one thread per rank as well)."""
    with threadpoolctl.threadpool_limits(1):
        yield


# -- public names -------------------------------------------------------------

def _ours(obj):
    return (getattr(obj, '__module__', None) or '').startswith('chainerkfac')


def public_names():
    """``{qualified name: object}`` of the public classes and functions.

    A module's public names are its ``__all__`` when it has one, else every
    name without a leading underscore bound to a class or function defined
    in chainerkfac (imported modules such as ``numpy`` are not API).
    """
    names = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        exported = getattr(module, '__all__', None)
        for name, value in vars(module).items():
            if name.startswith('_'):
                continue
            if exported is not None and name not in exported:
                continue
            if (inspect.isclass(value) or inspect.isfunction(value)) \
                    and _ours(value):
                names['{}.{}'.format(module_name, name)] = value
    return names


def public_members(cls):
    """``{(defining class, name): member}`` of a public class: its methods
    and properties without a leading underscore, including those inherited
    from chainerkfac classes but not those inherited unchanged from
    Chainer (or anything else outside chainerkfac)."""
    members = {}
    for klass in cls.__mro__:
        if not _ours(klass):
            continue
        for name, value in vars(klass).items():
            if name.startswith('_') or (klass, name) in members:
                continue
            if isinstance(value, (staticmethod, classmethod, property)) \
                    or inspect.isfunction(value):
                members[(klass, name)] = getattr(klass, name)
    return members


def missing_docstrings():
    missing = set()
    for module_name in PUBLIC_MODULES:
        if not inspect.getdoc(importlib.import_module(module_name)):
            missing.add(module_name + ' (module)')
    for qualified, obj in public_names().items():
        if not inspect.getdoc(obj):
            missing.add(qualified)
        if inspect.isclass(obj):
            for (klass, name), member in public_members(obj).items():
                # inspect.getdoc inherits a docstring from the method a
                # member overrides, as Sphinx's autodoc does.
                if not inspect.getdoc(member):
                    missing.add('{}.{}.{}'.format(
                        klass.__module__, klass.__qualname__, name))
    return sorted(missing)


def test_public_api_is_found():
    names = public_names()
    for expected in ('chainerkfac.optimizers.KFAC',
                     'chainerkfac.create_multi_node_optimizer',
                     'chainerkfac.curvature.register',
                     'chainerkfac.distributed.assign_blocks',
                     'chainerkfac.linalg.damped_inverse',
                     'chainerkfac.schedules.StaleFisher'):
        assert expected in names
    assert 'chainerkfac.linalg.numpy' not in names
    members = public_members(chainerkfac.optimizers.KFAC)
    kfac = chainerkfac.optimizers.KFAC
    assert (kfac, 'update') in members
    # Inherited unchanged from Chainer's GradientMethod: not ours to check.
    assert all(name != 'add_hook' for _, name in members)


def test_every_public_name_has_a_docstring():
    missing = missing_docstrings()
    assert not missing, (
        'public names without a docstring:\n  ' + '\n  '.join(missing))


# -- the API reference --------------------------------------------------------

_DIRECTIVE = re.compile(r'^\.\. (auto\w+|currentmodule|module)::\s*(\S+)')
_OPTION = re.compile(r'^\s+:([\w-]+):')


def _resolve(target):
    """The object a dotted autodoc target names."""
    parts = target.split('.')
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:split]))
        except ImportError:
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(target)


def reference_entries():
    """``[(page, directive, target object, options)]`` of docs/reference."""
    entries = []
    folder = os.path.join(DOCS, 'reference')
    for page in sorted(os.listdir(folder)):
        if not page.endswith('.rst'):
            continue
        current = None
        with open(os.path.join(folder, page), encoding='utf-8') as f:
            lines = f.read().splitlines()
        for i, line in enumerate(lines):
            match = _DIRECTIVE.match(line)
            if not match:
                continue
            directive, target = match.groups()
            if directive in ('currentmodule', 'module'):
                current = target
                continue
            options = set()
            for following in lines[i + 1:]:
                option = _OPTION.match(following)
                if not option:
                    break
                options.add(option.group(1))
            if directive == 'automodule':
                target_name = target
            elif '.' in target and target.split('.')[0] == 'chainerkfac':
                target_name = target
            else:
                target_name = '{}.{}'.format(current, target)
            entries.append((page, directive, _resolve(target_name), options))
    return entries


def test_api_reference_documents_every_public_name():
    entries = reference_entries()
    documented = {id(obj) for _, directive, obj, _ in entries
                  if directive != 'automodule'}
    modules = {obj.__name__ for _, directive, obj, _ in entries
               if directive == 'automodule'}
    missing = [name for name, obj in public_names().items()
               if id(obj) not in documented]
    assert not missing, ('public names without an autodoc entry in '
                         'docs/reference: ' + ', '.join(missing))
    assert set(PUBLIC_MODULES) <= modules


def test_api_reference_lists_the_methods_of_classes():
    for page, directive, obj, options in reference_entries():
        if directive == 'autoclass' and public_members(obj):
            assert 'members' in options, (
                '{}: autoclass {} needs :members:'.format(page, obj.__name__))


# -- code in the pages --------------------------------------------------------

_FENCE = re.compile(r'^(\s*)(`{3,}|~{3,})(.*)$')
_NOT_RUN = re.compile(r'^\s*<!--\s*not-run:\s*(\S.*?)\s*-->\s*$')
_RST_CODE = re.compile(r'^(\s*)\.\. code-block::\s*python\s*$')


def _doc_pages():
    pages = []
    for folder, dirs, files in os.walk(DOCS):
        dirs[:] = [d for d in dirs if d not in ('_build', 'examples')]
        for name in files:
            if name.endswith(('.md', '.rst')):
                pages.append(os.path.relpath(os.path.join(folder, name),
                                             DOCS))
    return sorted(pages)


def _markdown_blocks(lines):
    """``(first line number, code, not-run reason)`` of every python
    fence."""
    blocks = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, info = match.groups()
        words = info.strip().split()
        if words and words[0] == '{code-block}':
            words = words[1:]
        language = words[0] if words else ''
        end = i + 1
        while end < len(lines) and not (
                lines[end].strip().startswith(fence)
                and set(lines[end].strip()) == {fence[0]}):
            end += 1
        if language in ('python', 'py', 'python3'):
            body = [line[len(indent):] if line.startswith(indent) else line
                    for line in lines[i + 1:end]]
            reason = None
            if i > 0:
                marker = _NOT_RUN.match(lines[i - 1])
                reason = marker.group(1) if marker else None
            blocks.append((i + 2, '\n'.join(body), reason))
        i = end + 1
    return blocks


def _rst_blocks(lines):
    blocks = []
    for i, line in enumerate(lines):
        match = _RST_CODE.match(line)
        if not match:
            continue
        body, start = [], None
        for j in range(i + 1, len(lines)):
            text = lines[j]
            if text.strip() and not text.startswith(match.group(1) + ' '):
                break
            if text.strip() and start is None:
                start = j
                indent = len(text) - len(text.lstrip())
            if start is not None:
                body.append(text[indent:])
        if start is not None:
            blocks.append((start + 1, '\n'.join(body).rstrip(), None))
    return blocks


def code_blocks(page):
    with open(os.path.join(DOCS, page), encoding='utf-8') as f:
        lines = f.read().splitlines()
    if page.endswith('.md'):
        return _markdown_blocks(lines)
    return _rst_blocks(lines)


PAGES_WITH_CODE = [page for page in _doc_pages() if code_blocks(page)]


def page_namespace():
    """What the pages say their snippets start from."""
    example = runpy.run_path(SINGLE_EXAMPLE)
    numpy.random.seed(0)
    train, test = example['digits']()
    x, t = chainer.dataset.concat_examples(train[:64])
    return {
        'chainer': chainer, 'chainerkfac': chainerkfac, 'numpy': numpy,
        'F': F, 'L': L, 'CNN': example['CNN'], 'digits': example['digits'],
        'model': L.Classifier(example['CNN']()), 'train': train,
        'test': test, 'x': x, 't': t,
    }


def test_pages_have_code_and_fixtures_exist():
    assert 'getting_started.md' in PAGES_WITH_CODE
    assert len(PAGES_WITH_CODE) >= 10
    for page in _doc_pages():
        for line, code, reason in code_blocks(page):
            assert code.strip(), '{}:{}: empty code block'.format(page, line)


@pytest.mark.parametrize('page', PAGES_WITH_CODE)
def test_code_blocks_run(page, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # snippets may write result/, *.npz
    namespace = page_namespace()
    ran = 0
    for line, code, reason in code_blocks(page):
        if reason is not None:
            continue
        # Padding keeps tracebacks on the page's own line numbers.
        source = '\n' * (line - 1) + code
        exec(compile(source, os.path.join('docs', page), 'exec'), namespace)
        ran += 1
    assert ran, '{}: every python block is marked not-run'.format(page)


def test_stated_outputs():
    """Values the pages state in prose, computed as the snippets do."""
    namespace = page_namespace()
    optimizer = chainerkfac.optimizers.KFAC()
    optimizer.setup(namespace['model'])
    described = optimizer.describe()
    with open(os.path.join(DOCS, 'getting_started.md'),
              encoding='utf-8') as f:
        page = f.read()
    assert described in page, described


# -- the complete examples ----------------------------------------------------

def test_getting_started_shows_the_examples_as_they_are():
    # The page shows each example in full, readable outside Sphinx; the
    # files are what the tests below run.
    shown = {reason.split()[0]: code for _, code, reason
             in code_blocks('getting_started.md') if reason}
    for path in (SINGLE_EXAMPLE, MPI_EXAMPLE):
        with open(path, encoding='utf-8') as f:
            assert shown[os.path.relpath(path, os.path.dirname(DOCS))] \
                == f.read().rstrip('\n'), path


def test_single_process_example(tmp_path, monkeypatch, capsys):
    out = str(tmp_path / 'digits')
    monkeypatch.setattr(sys, 'argv', [SINGLE_EXAMPLE, '--epochs', '2',
                                      '--out', out])
    numpy.random.seed(0)
    runpy.run_path(SINGLE_EXAMPLE, run_name='__main__')
    assert re.search(r'predictor/fc +K-FAC A 513x513, G 10x10',
                     capsys.readouterr().out)
    with open(os.path.join(out, 'log')) as f:
        log = json.load(f)
    assert [entry['epoch'] for entry in log] == [1, 2]
    assert log[-1]['validation/main/accuracy'] > 0.6


def test_distributed_example_and_resume(tmp_path):
    out = str(tmp_path / 'digits_mpi')
    first = mpi_helpers.run_mpi(
        2, MPI_EXAMPLE, ['--epochs', '1', '--out', out], timeout=120,
        check=True)
    assert 'kfac/bytes/reduce_scatter_v' in first.stdout, first.stdout
    # docs/design.md: a refresh step's reduce-scatter-v moves 613,288
    # bytes, a stale step's 40,104; with the default adaptive intervals the
    # epoch's mean lies between them.
    with open(os.path.join(out, 'log')) as f:
        mean_bytes = json.load(f)[0]['kfac/bytes/reduce_scatter_v']
    assert 40104 < mean_bytes < 613288
    for rank in (0, 1):
        assert os.path.exists(os.path.join(
            out, 'snapshot_epoch_1.rank{}'.format(rank)))
    # docs/guide/checkpointing.md: the same snapshot resumed on 3
    # processes (in a copy), then on as many.
    resized = str(tmp_path / 'digits_mpi_3')
    shutil.copytree(out, resized)
    runs = [(3, resized), (2, out)]
    for n, folder in runs:
        mpi_helpers.run_mpi(
            n, MPI_EXAMPLE, ['--epochs', '2', '--out', folder, '--resume',
                             os.path.join(folder, 'snapshot_epoch_1')],
            timeout=120, check=True)
        with open(os.path.join(folder, 'log')) as f:
            log = json.load(f)
        assert [entry['epoch'] for entry in log] == [1, 2]
        assert log[-1]['validation/main/accuracy'] > 0.6
        assert os.path.exists(os.path.join(
            folder, 'snapshot_epoch_2.rank{}'.format(n - 1)))


def test_failure_modes_name_tests_that_exist():
    # docs/guide/failure_modes.md: every `tests/FILE.py::NAME` it cites is
    # a test function of that file.
    with open(os.path.join(DOCS, 'guide', 'failure_modes.md')) as f:
        cited = re.findall(r'`(tests/[\w/]+\.py)::(\w+)`', f.read())
    assert len(cited) >= 10
    for path, name in cited:
        with open(os.path.join(mpi_helpers.REPO_ROOT, path)) as f:
            assert re.search(r'^def {}\('.format(name), f.read(), re.M), \
                (path, name)


def test_make_targets_and_files_the_docs_name_exist():
    # `make TARGET` and repository paths in README.md, docs/ and the
    # examples' and benchmarks' READMEs: the target is in the Makefile,
    # the file exists (build outputs excepted).
    root = mpi_helpers.REPO_ROOT
    pages = [os.path.join(root, 'README.md'),
             os.path.join(root, 'benchmarks', 'README.md'),
             os.path.join(root, 'examples', 'imagenet', 'README.md')]
    for folder, _, names in os.walk(DOCS):
        if '_build' not in folder:
            pages += [os.path.join(folder, n) for n in names
                      if n.endswith('.md')]
    with open(os.path.join(root, 'Makefile')) as f:
        targets = set(re.findall(r'^([\w-]+):', f.read(), re.M))
    built = ('docs/_build',)
    missing = []
    for page in pages:
        with open(page) as f:
            text = f.read()
        named = re.findall(r'(?:`|^)make ([a-z][\w-]*)', text, re.M)
        missing += ['{}: make {}'.format(page, t) for t in named
                    if t not in targets]
        for path in re.findall(
                r'`((?:benchmarks|docs|examples|tests|chainerkfac)/'
                r'[\w./-]+?)(?:::\w+)?`', text):
            if not path.startswith(built) and not os.path.exists(
                    os.path.join(root, path)):
                missing.append('{}: {}'.format(page, path))
    assert not missing, missing


def test_options_page_documents_every_option_with_its_default():
    # docs/options.md is the one place KFAC's options are documented: each
    # constructor option has a row giving its default.
    text = open(os.path.join(DOCS, 'options.md')).read()
    rows = {line.split('|')[1].strip().strip('`'): line.split('|')[2]
            for line in text.splitlines()
            if line.startswith('| `') and line.count('|') >= 4}
    for name, parameter in inspect.signature(
            chainerkfac.optimizers.KFAC.__init__).parameters.items():
        if name in ('self', 'unknown'):
            continue
        assert name in rows, name
        shown = rows[name].split('`')[1]
        default = parameter.default
        if isinstance(default, float):
            assert float(shown) == default, (name, shown)
        else:
            assert shown == repr(default), (name, shown)
