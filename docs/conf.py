"""Sphinx configuration of the megatron-mech documentation (MyST Markdown pages).

Build: ``sphinx-build -W --keep-going -b html docs docs/_build/html`` (``tests/project/test_docs.py`` builds it so
in CI, every warning an error). The reference pages (configuration.md, cli.md, metrics.md) are generated from the code:
see ``megatron_mech/references/`` and ``megatron_mech/records/metrics_reference.py``.
"""
project = "megatron-mech"
author = "megatron-mech developers"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# Tables, fenced code and HTML comments are plain CommonMark/GFM; no MyST syntax extension is needed.
myst_enable_extensions = []
html_theme = "alabaster"
html_title = "megatron-mech"
myst_heading_anchors = 3  # "page.md#a-heading" links, as GitHub renders them
