"""Write docs/cli.md from ``persia-launcher --help`` and every subcommand's ``--help``.

    .venv/bin/python scripts/gen_cli_docs.py          # rewrite docs/cli.md
    .venv/bin/python scripts/gen_cli_docs.py --check  # exit 1 if docs/cli.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from persia_py.launcher.cli import build_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
WIDTH = 100


def _fixed_width(parser: argparse.ArgumentParser) -> None:
    """Help text independent of the terminal it is generated in."""
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=WIDTH)


def cli_reference() -> str:
    parser = build_parser()
    _fixed_width(parser)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = ["# `persia-launcher` command line\n",
             "Generated from `--help` by `scripts/gen_cli_docs.py`; do not edit by hand.\n",
             "```text\n" + parser.format_help() + "```\n"]
    for name, subparser in sub.choices.items():
        _fixed_width(subparser)
        parts.append(f"## `persia-launcher {name}`\n")
        parts.append("```text\n" + subparser.format_help() + "```\n")
    return "\n".join(parts)


def main() -> int:
    text = cli_reference()
    if "--check" in sys.argv[1:]:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale; run: python scripts/gen_cli_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
