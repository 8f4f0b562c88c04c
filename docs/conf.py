"""Sphinx configuration of the chainerkfac documentation (``make docs``).

Built with ``sphinx-build -W --keep-going``: every warning is an error. The
API reference documents the source tree beside this folder, not an installed
copy.
"""
import os
import sys

DOCS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(DOCS)
sys.path.insert(0, ROOT)

import chainerkfac  # NOQA: E402  (before Chainer: the NumPy-2 shims)

project = 'chainerkfac'
author = 'the chainerkfac authors'
copyright = author
version = release = chainerkfac.__version__

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.autosummary',
    'sphinx.ext.napoleon',
    'sphinx.ext.viewcode',
    'myst_parser',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'markdown'}
root_doc = 'index'
# docs/examples holds the runnable scripts getting_started.md shows in full.
exclude_patterns = ['_build', 'examples', 'Thumbs.db', '.DS_Store']
templates_path = []

# -- API reference ------------------------------------------------------------
# Google-style docstrings ("Args:", "Returns:"), as in Chainer.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# "Attributes:" sections become fields of their class rather than entries of
# their own, which would clash with attributes autodoc documents as well.
napoleon_use_ivar = True
autodoc_member_order = 'bysource'
autodoc_typehints = 'none'
autodoc_default_options = {'show-inheritance': True}
autosummary_generate = False

# -- Markdown -----------------------------------------------------------------
# Anchors for headings down to ###, so that pages can link to sections.
myst_heading_anchors = 3

# -- HTML ---------------------------------------------------------------------
# The Read the Docs theme, as on docs.chainer.org.
html_theme = 'sphinx_rtd_theme'
html_theme_options = {'navigation_depth': 3}
html_static_path = ['_static']
html_css_files = ['custom.css']
html_show_sourcelink = False

# -- Pages written elsewhere --------------------------------------------------
# docs/benchmarks.md (the benchmarks), docs/measurements.md (the
# measurements behind the guides) and docs/reproduce.md (the ImageNet
# example) join the site when they exist: the index names only the pages
# that are there.
OPTIONAL_PAGES = ['benchmarks', 'measurements', 'reproduce']
OPTIONAL_MARKER = '.. optional-pages'


def _add_optional_pages(app, docname, source):
    if docname != root_doc:
        return
    present = [page for page in OPTIONAL_PAGES
               if os.path.exists(os.path.join(DOCS, page + '.md'))]
    toctree = ''
    if present:
        toctree = ('.. toctree::\n   :maxdepth: 2\n   :caption: Results\n\n'
                   + ''.join('   {}\n'.format(page) for page in present))
    source[0] = source[0].replace(OPTIONAL_MARKER, toctree)


def setup(app):
    app.connect('source-read', _add_optional_pages)
