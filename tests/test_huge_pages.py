"""persia_py.ops.huge_pages: big memory goes on huge pages only where they pay, as the
machine (its balloon's free page reporting) or ``PERSIA_HUGE_PAGES`` says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from persia_py.ops import huge_pages
from persia_py.servers import memory


def _balloon(tmp_path: Path, name: str, bits: str) -> str:
    device = tmp_path / name / "virtio0"
    device.mkdir(parents=True)
    (device / "features").write_text(bits + "\n")
    return str(tmp_path / name / "virtio*" / "features")


def test_free_page_reporting_is_read_from_the_balloons_feature_bits(tmp_path: Path) -> None:
    # This project's VMs: bits 1, 2, 5 (reporting) and 32 (virtio 1.0).
    reporting = "0110010" + "0" * 25 + "1" + "0" * 95
    assert huge_pages.host_takes_free_pages(_balloon(tmp_path, "a", reporting))
    assert not huge_pages.host_takes_free_pages(_balloon(tmp_path, "b", "0110000" + "0" * 121))
    assert not huge_pages.host_takes_free_pages(str(tmp_path / "none" / "virtio*" / "features"))


def test_the_setting_decides_and_a_wrong_one_is_named() -> None:
    assert huge_pages.enabled({"PERSIA_HUGE_PAGES": "on"})
    assert not huge_pages.enabled({"PERSIA_HUGE_PAGES": "OFF"})
    assert huge_pages.enabled({}) == (not huge_pages.host_takes_free_pages())
    with pytest.raises(ValueError, match=r"PERSIA_HUGE_PAGES='2M': expected one of auto, on, off"):
        huge_pages.enabled({"PERSIA_HUGE_PAGES": "2M"})


def _vm_flags(array: np.ndarray) -> list[str]:
    """The kernel's flags of the mapping that holds the middle of ``array`` (``hg``:
    advised huge; numpy advises only a malloc block's 2 MiB-aligned part)."""
    address = array.ctypes.data + array.nbytes // 2
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(sys.platform != "linux" or not Path(
    "/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="Linux with THP")
def test_table_arrays_are_advised_huge_only_where_they_pay(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for setting, advised in (("on", True), ("off", False)):
        monkeypatch.setenv("PERSIA_HUGE_PAGES", setting)
        arrays = [memory.zeros((1 << 20, 8), np.uint8), memory.empty((3 << 20,), np.float32)]
        reserved = memory.reserve((1 << 22, 16), np.float32)
        if reserved is not None:
            arrays.append(reserved)
        for array in arrays:
            assert ("hg" in _vm_flags(array)) == advised, (setting, array.shape)


_NUMPY_ADVICE = """
import sys
import numpy as np
from persia_py.ops import allocator
sys.path.insert(0, {tests!r})
from test_huge_pages import _vm_flags
allocator.tune_this_process()
print("hg" in _vm_flags(np.ones(16 << 20, np.uint8)))
"""


@pytest.mark.processes
@pytest.mark.skipif(sys.platform != "linux" or not Path(
    "/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="Linux with THP")
def test_a_server_started_without_the_launcher_turns_numpys_advice_off_too() -> None:
    code = _NUMPY_ADVICE.format(tests=str(Path(__file__).parent))
    base = {k: v for k, v in os.environ.items()
            if k not in ("GLIBC_TUNABLES", "NUMPY_MADVISE_HUGEPAGE")}
    for setting, advised in (("on", "True"), ("off", "False")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**base, "PERSIA_HUGE_PAGES": setting}, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == advised, (setting, out.stdout)


@pytest.mark.processes
def test_a_launcher_with_a_wrong_setting_stops_before_anything_starts() -> None:
    from persia_py.ops.start_checks import CONFIG_EXIT_CODE
    out = subprocess.run(
        [sys.executable, "-m", "persia_py.launcher.cli", "embedding-parameter-server",
         "--port", "1"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PERSIA_HUGE_PAGES": "bogus"})
    assert out.returncode == CONFIG_EXIT_CODE, out.stderr
    assert "config error: PERSIA_HUGE_PAGES='bogus': expected one of auto, on, off" in out.stderr
