"""The strategy's arguments written out from each `Parallelism` field's ``help``: its docstring (read by ``--help``)
and the docs' table."""

from dataclasses import fields

from lit3d.parallel.settings import Parallelism


def argument_docs(indent: str = "    ") -> str:
    """Google-style ``Args:`` lines for every setting (the strategy's docstring, read by ``--help``)."""
    lines = ["Args:"]
    for f in fields(Parallelism):
        lines.append(f"{indent}{f.name}: {f.metadata['help']}")
    return "\n".join(lines)


def argument_table() -> str:
    """The settings as a Markdown table (the docs' table of the strategy's arguments)."""
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for f in fields(Parallelism):
        default = "10 minutes" if f.name == "timeout" else repr(f.default)
        rows.append(f"| `{f.name}` | `{default}` | {f.metadata['help']} |")
    return "\n".join(rows)
