"""The checkout the tests run in: its root (``ROOT``), the example job the tests start
(``EXAMPLE``), and the package as it is installed from it (:func:`package_tree`), which
the type check (:func:`start_type_check`; conftest's ``type_check`` fixture) runs over,
and numba's cached kernels of the checkout dropped when they may be stale
(:func:`drop_stale_kernel_caches`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "criteo_synthetic"


PACKAGE_DIRS = {"persia_py/servers": ROOT / "servers", "persia_py/workers": ROOT / "workers"}
"""setup.cfg's ``package_dir``: folders at the top that are installed inside persia_py."""


KERNEL_FOLDERS = ("persia_py", "servers", "workers")
"""Where the package's numba kernels are."""
KERNEL_STAMP = ".numba_sources"
"""The file (in the checkout's root, ignored by git) that records the kernels' sources as
they were when their cached compiles were last known to match them."""


def drop_stale_kernel_caches(root: Path = ROOT) -> bool:
    """Delete numba's cached kernels under ``root`` (``__pycache__/*.nbi``, ``*.nbc``) if a
    file that defines a cached kernel changed (size or time) since the last call; returns
    whether it did. numba checks a cached kernel against its own file only: a kernel whose
    callee in another file changed would run the callee's old machine code, and the tests
    would test code no longer there. A clean clone has nothing to delete."""
    sources = sorted(path for folder in KERNEL_FOLDERS for path in (root / folder).rglob("*.py")
                     if "cache=True" in path.read_text())
    stamp = "".join(f"{path.relative_to(root)} {path.stat().st_size} "
                    f"{path.stat().st_mtime_ns}\n" for path in sources)
    recorded = root / KERNEL_STAMP
    if recorded.exists() and recorded.read_text() == stamp:
        return False
    for folder in KERNEL_FOLDERS:
        for cached in (*(root / folder).rglob("__pycache__/*.nbi"),
                       *(root / folder).rglob("__pycache__/*.nbc")):
            cached.unlink(missing_ok=True)
    recorded.write_text(stamp)
    return True


def package_tree(folder: Path) -> Path:
    """The package as it is installed, in ``folder``, made of links to the checkout: mypy
    finds modules by their files' paths, and servers/ and workers/ import as
    persia_py.servers and persia_py.workers only through setup.cfg's ``package_dir``."""
    tree = folder / "tree"
    (tree / "persia_py").mkdir(parents=True)
    for entry in (ROOT / "persia_py").iterdir():
        if f"persia_py/{entry.name}" not in PACKAGE_DIRS:  # a checkout's stale __pycache__
            (tree / "persia_py" / entry.name).symlink_to(entry)
    for inside, source in PACKAGE_DIRS.items():
        (tree / inside).symlink_to(source, target_is_directory=True)
    (tree / "pyproject.toml").symlink_to(ROOT / "pyproject.toml")
    return tree


def start_type_check(folder: Path) -> tuple[subprocess.Popen, Path]:
    """``python -m mypy`` over the package as installed (:func:`package_tree`), writing
    into ``folder/output.txt``; its cache stays in the checkout."""
    output = folder / "output.txt"
    with output.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mypy", "--cache-dir",
                                 str(ROOT / ".mypy_cache")], stdout=out,
                                stderr=subprocess.STDOUT, cwd=package_tree(folder))
    return proc, output
