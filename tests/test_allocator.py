"""persia_py.ops.allocator: big message buffers are reused, not faulted in again each time."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from persia_py.ops import allocator

glibc_only = pytest.mark.skipif(
    sys.platform != "linux" or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
    reason="glibc malloc settings")

# A child that builds and drops 30 answers of 12.8 MB, as a server does, and prints how
# many page faults that took.
_CHURN = """
import resource
import numpy as np
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rows = np.ones((100_000, 32), np.float32)
for _ in range(30):
    buffer = bytearray(rows.nbytes)
    np.frombuffer(buffer, np.float32)[:] = rows.reshape(-1)
    answer = bytes(buffer)
    del buffer, answer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", _CHURN], env=env, capture_output=True,
                         text=True, check=True, timeout=120)
    return int(out.stdout)


def test_with_tunables_adds_them_but_a_users_choice_wins() -> None:
    huge = {"PATH": "/bin", "PERSIA_HUGE_PAGES": "on"}
    small = {"PATH": "/bin", "PERSIA_HUGE_PAGES": "off"}
    if sys.platform == "linux":
        assert allocator.with_tunables(huge) == {**huge, "GLIBC_TUNABLES": allocator.TUNABLES}
        assert allocator.with_tunables(small) == {
            **small, "GLIBC_TUNABLES": allocator.BASE_TUNABLES, "NUMPY_MADVISE_HUGEPAGE": "0"}
        assert "hugetlb" not in allocator.BASE_TUNABLES
    mine = {"GLIBC_TUNABLES": "glibc.malloc.perturb=0", "NUMPY_MADVISE_HUGEPAGE": "1",
            "PERSIA_HUGE_PAGES": "off"}
    assert allocator.with_tunables(mine) == mine
    with pytest.raises(ValueError, match="PERSIA_HUGE_PAGES='maybe'"):
        allocator.with_tunables({"PERSIA_HUGE_PAGES": "maybe"})


@pytest.mark.processes
@glibc_only
def test_tuned_process_reuses_message_buffers() -> None:
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    plain = _faults({**base, "GLIBC_TUNABLES": "glibc.malloc.perturb=0"})
    tuned = _faults(allocator.with_tunables(base))
    # 30 x 2 buffers of 12.8 MB are ~190k pages: untuned, most are faulted in anew.
    assert plain > 50_000, plain
    assert tuned < plain / 5, (tuned, plain)


@pytest.mark.processes
@glibc_only
def test_tune_this_process_sets_the_thresholds_at_run_time() -> None:
    code = ("from persia_py.ops import allocator; import sys; "
            "sys.exit(0 if allocator.tune_this_process() else 3)")
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    assert subprocess.run([sys.executable, "-c", code], env=base, timeout=60).returncode == 0
    # Settings given at start are left alone.
    given = {**base, "GLIBC_TUNABLES": allocator.TUNABLES}
    assert subprocess.run([sys.executable, "-c", code], env=given, timeout=60).returncode == 3
