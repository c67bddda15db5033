"""Benchmarks: stripped copies of the hot paths, run as ``python -m benchmarks.<name>``.

Every one takes ``--smoke``: the same run at tiny sizes, in seconds, that the test suite
makes (``tests/test_benchmark_smoke.py``) so that a benchmark the code has moved away from
fails there rather than when someone next needs its figures. A smoke run's figures mean
nothing; it writes only into temporary folders and its ``--json`` file.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

SMOKE_HELP = ("a check that it runs, at tiny sizes, in seconds (the test suite's); the "
              "figures mean nothing. Sizes given explicitly still win")


def parse_args_with_smoke(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                          **smoke: Any) -> argparse.Namespace:
    """``parser``'s arguments plus ``--smoke``, which makes ``smoke`` (option dest ->
    value) the defaults: flags given on the command line still win over them."""
    parser.add_argument("--smoke", action="store_true",
                        help=f"{SMOKE_HELP} ({', '.join(f'{k}={v}' for k, v in smoke.items())})")
    args = parser.parse_args(argv)
    if args.smoke:
        unknown = set(smoke) - set(vars(args))
        assert not unknown, f"smoke sizes for options the parser lacks: {sorted(unknown)}"
        parser.set_defaults(**smoke)
        args = parser.parse_args(argv)
    return args
