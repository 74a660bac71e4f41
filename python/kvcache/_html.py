"""The small HTML tables Jupyter shows for kvcache objects (their ``_repr_html_``)."""

from __future__ import annotations

from html import escape


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(title: str, rows: dict, note: str = "") -> str:
    """``<b>title</b>`` then a two-column table of ``rows`` (values already formatted, escaped here)."""
    body = "".join(f"<tr><td style='text-align:left'>{escape(str(k))}</td>"
                   f"<td style='text-align:right'>{escape(str(v))}</td></tr>" for k, v in rows.items())
    extra = f" <span style='color:gray'>{escape(note)}</span>" if note else ""
    return f"<div><b>{escape(title)}</b>{extra}<table>{body}</table></div>"


def percent(x: float) -> str:
    return f"{100 * x:.1f}%"
