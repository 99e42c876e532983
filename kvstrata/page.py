"""The one-page HTML report of ``--html FILE``: a command's tables and plots together, in one file.

:class:`HtmlPage` is printed to the way the CLI prints to a rich ``Console`` (``page.print(table)``,
``page.print("[bold]text[/]")``), so a command renders its page with the very code that renders
its terminal output, and the two cannot drift apart. Figures are embedded as base64 PNG, and the
page's content security policy allows nothing else: it loads nothing from the network.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from rich.console import Console
from rich.style import Style
from rich.table import Table
from rich.text import Text

import kvstrata

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; color: #222; max-width: 1280px; margin: 1.5em auto; padding: 0 1em; }
h1 { font-size: 1.4em; margin-bottom: .2em; }
.generator { color: #777; font-size: .85em; margin-top: 0; }
table { border-collapse: collapse; margin: 1.2em 0; }
caption { font-weight: bold; text-align: left; padding: .3em 0; }
th, td { border: 1px solid #ccc; padding: .25em .6em; vertical-align: top; }
th { background: #f2f2f2; }
.r { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 1.5em 0; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #555; }
"""
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
_TEXT_CONSOLE = Console(file=io.StringIO(), color_system="truecolor", width=10_000)


def text_html(text: str | Text) -> str:
    """``text`` (rich markup, or a ``Text``) as escaped HTML, its bold, italic, dim and colours as inline CSS."""
    if isinstance(text, str):
        text = Text.from_markup(text)
    out = []
    for segment in text.render(_TEXT_CONSOLE):
        chunk = html.escape(segment.text)
        css = _css(segment.style) if segment.style else ""
        out.append(f'<span style="{css}">{chunk}</span>' if css else chunk)
    return "".join(out)


def _css(style: Style) -> str:
    rules = []
    if style.bold:
        rules.append("font-weight:bold")
    if style.italic:
        rules.append("font-style:italic")
    if style.dim:
        rules.append("opacity:.65")
    if style.color is not None and not style.color.is_default:
        rules.append(f"color:{style.color.get_truecolor().hex}")
    return ";".join(rules)


def table_html(table: Table) -> str:
    """A rich ``Table`` as an HTML table: its title as the caption, columns justified as in the terminal."""
    cls = [' class="r"' if c.justify == "right" else "" for c in table.columns]
    head = "".join(f"<th{k}>{_cell(c.header)}</th>" for k, c in zip(cls, table.columns))
    columns = [list(c.cells) for c in table.columns]
    rows = [
        "<tr>" + "".join(f"<td{k}>{_cell(col[i]) if i < len(col) else ''}</td>" for k, col in zip(cls, columns)) + "</tr>"
        for i in range(table.row_count)
    ]
    caption = f"<caption>{_cell(table.title)}</caption>" if table.title else ""
    return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _cell(value: object) -> str:
    return text_html(value) if isinstance(value, (str, Text)) else html.escape(str(value))


class HtmlPage:
    """A one-page report: a title, then what is printed to it, then its figures, in order."""

    def __init__(self, title: str) -> None:
        self.title = title
        self._parts: list[str] = []

    def print(self, *objects: object, **_console_options: object) -> None:
        """As ``Console.print``: a ``Table`` becomes a table, text (rich markup) a paragraph."""
        for obj in objects:
            if isinstance(obj, Table):
                self._parts.append(table_html(obj))
            else:
                self._parts.append(f"<p>{_cell(obj)}</p>")

    def image(self, png: bytes, caption: str) -> None:
        """A PNG (a figure, from :func:`kvstrata.plots.png_bytes`) embedded, ``caption`` below it and as its alt text."""
        data = base64.b64encode(png).decode("ascii")
        alt = html.escape(caption, quote=True)
        self._parts.append(
            f'<figure><img src="data:image/png;base64,{data}" alt="{alt}"><figcaption>{alt}</figcaption></figure>'
        )

    def html(self) -> str:
        """The whole page."""
        title = html.escape(self.title)
        return (
            '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{title}</title><style>{_CSS}</style></head>\n<body><h1>{title}</h1>"
            f'<p class="generator">kvstrata {html.escape(kvstrata.__version__)}</p>\n'
            + "\n".join(self._parts)
            + "\n</body></html>\n"
        )

    def write(self, path: str | Path) -> Path:
        """Write the page to ``path`` (its folder made if missing); the path written."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.html(), encoding="utf-8")
        return path
