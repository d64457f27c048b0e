"""MkDocs hook: tidies the option tables mkdocs-click writes from the click commands.

mkdocs-click prints an option's default as Python sees it; since click 8.3 an option given no default holds
click's own `UNSET` marker, which would read as "Sentinel.UNSET" on every page. Such an option has no default to
show, so its cell is left empty.
"""

from __future__ import annotations

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

UNSET_CELL = "<td><code>Sentinel.UNSET</code></td>"


def on_page_content(html: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Empties the default cell of options that have none (click's UNSET marker)."""
    return html.replace(UNSET_CELL, "<td></td>")
