"""The suite's start drops numba's cached kernels when a kernel's source changed
(tests/checkout.py ``drop_stale_kernel_caches``): numba itself would keep a caller's
compiled code after its callee's file changed."""

from __future__ import annotations

import os
from pathlib import Path

from checkout import KERNEL_STAMP, drop_stale_kernel_caches


def _tree(root: Path) -> tuple[Path, Path, list[Path]]:
    (root / "servers" / "__pycache__").mkdir(parents=True)
    (root / "persia_py" / "ids" / "__pycache__").mkdir(parents=True)
    (root / "workers").mkdir()
    kernel = root / "servers" / "kernels.py"
    kernel.write_text("@njit(cache=True)\ndef step(x):\n    return x + 1\n")
    plain = root / "persia_py" / "ids" / "names.py"
    plain.write_text("NAME = 'no kernel here'\n")
    cached = [root / "servers" / "__pycache__" / "kernels.step-2.py311.nbi",
              root / "servers" / "__pycache__" / "kernels.step-2.py311.1.nbc",
              root / "persia_py" / "ids" / "__pycache__" / "hashing.mix-9.py311.nbi"]
    return kernel, plain, cached


def _write(paths: list[Path]) -> None:
    for path in paths:
        path.write_bytes(b"compiled")


def test_cached_kernels_go_when_a_kernel_source_changes_and_stay_otherwise(tmp_path) -> None:
    kernel, plain, cached = _tree(tmp_path)
    _write(cached)
    assert drop_stale_kernel_caches(tmp_path)  # no record yet: nothing is known to match
    assert not any(path.exists() for path in cached)
    assert (tmp_path / KERNEL_STAMP).exists()

    _write(cached)  # compiled by the run that follows
    assert not drop_stale_kernel_caches(tmp_path)
    assert all(path.exists() for path in cached)

    plain.write_text("NAME = 'still no kernel'\n")  # not a kernel's file: caches stay
    assert not drop_stale_kernel_caches(tmp_path)
    assert all(path.exists() for path in cached)

    stat = kernel.stat()
    kernel.write_text(kernel.read_text().replace("x + 1", "x + 2"))  # same size
    os.utime(kernel, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert drop_stale_kernel_caches(tmp_path)
    assert not any(path.exists() for path in cached)  # every kernel's: callers too
