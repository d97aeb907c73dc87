"""`report.html`: a run's header, its per-model table and its plots, in
one page that opens in any browser (the plots are the PNG files beside
it)."""

import html
import math
import pathlib

from hftatf.report import format_hyperparameter, format_value

REPORT_FILE = "report.html"

_STYLE = """
body { font-family: sans-serif; margin: 2em; }
table { border-collapse: collapse; }
th, td { padding: 0.25em 0.75em; text-align: right;
         border-bottom: 1px solid #ddd; }
tr.best { background: #e8f5e9; font-weight: bold; }
tr.diverged { color: #b71c1c; }
img { max-width: 100%; margin: 1em 0; }
"""


def _cell(column, value, hyperparameters):
    if column in hyperparameters:
        return format_hyperparameter(value)
    if isinstance(value, float):
        return format_value(value) if math.isfinite(value) else str(value)
    return "" if value is None else str(value)


def table_html(rows, hyperparameters, best=None):
    """The rows as an HTML table, the best model's row marked."""
    if not rows:
        return "<p>No models.</p>"
    columns = list(rows[0])
    lines = ["<table>", "<tr>" + "".join(
        f"<th>{html.escape(column)}</th>" for column in columns) + "</tr>"]
    for row in rows:
        kind = "best" if row["model"] == best else (
            "diverged" if row.get("status") == "diverged" else "")
        cells = "".join(
            f"<td>{html.escape(_cell(c, row.get(c), hyperparameters))}</td>"
            for c in columns)
        lines.append(f'<tr class="{kind}">{cells}</tr>' if kind
                     else f"<tr>{cells}</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def write_report(path, title, header, rows, hyperparameters, best=None,
                 images=()):
    """Writes `report.html` to `path`: `title`, the `header` lines, the
    table of `rows` and each of `images` (PNG paths, referenced by their
    name: they sit beside the page). Returns `path`."""
    path = pathlib.Path(path)
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>",
        '<meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
        f"<style>{_STYLE}</style>", "</head>", "<body>",
        f"<h1>{html.escape(title)}</h1>",
        "<pre>" + html.escape("\n".join(header)) + "</pre>",
        "<h2>Models</h2>", table_html(rows, hyperparameters, best)]
    for image in images:
        name = pathlib.Path(image).name
        parts += [f"<h2>{html.escape(pathlib.Path(name).stem)}</h2>",
                  f'<img src="{html.escape(name)}" '
                  f'alt="{html.escape(name)}">']
    parts += ["</body>", "</html>"]
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text("\n".join(parts) + "\n", encoding="utf-8")
    temporary.replace(path)
    return path
