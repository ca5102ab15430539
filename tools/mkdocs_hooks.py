"""MkDocs hooks for the documentation site (mkdocs.yml's ``hooks:``).

fedge's docstrings cross-reference in Sphinx's style (:func:`check_app`); mkdocstrings renders the
name as code but leaves the role's prefix in front of it. The prefix is dropped here, so the API
page reads as the source means it without rewriting every docstring for the site's sake.
"""

from __future__ import annotations

import re

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj):(?=<code>)")


def on_page_content(html: str, **_: object) -> str:
    return _ROLE.sub("", html)
