"""What half-precision rows cost in accuracy: the other side of ``benchmarks.density``.

    python -m benchmarks.density --parts accuracy [--criteo-samples 50000] [--json PATH]

Real ``persia-launcher local`` jobs in the reproducible mode (one NN rank, staleness 1,
the same seeds and batch order), one after another, each with a copy of its example's
``embedding_config.yml`` that sets the file-level ``row_dtype`` (and
``stochastic_rounding``):

- UCI Adult (``examples/adult_income``, one epoch): float32 rows, float16 rows, and
  float16 rows rounded to nearest (``stochastic_rounding: false``);
- the synthetic Criteo example (``examples/criteo_synthetic``): float32 and float16 rows.

JSON keys: ``auc_fp32_adult``, ``auc_fp16_adult``, ``auc_fp16_nosr_adult``,
``auc_fp32_criteo``, ``auc_fp16_criteo``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ADULT = ROOT / "examples" / "adult_income"
CRITEO = ROOT / "examples" / "criteo_synthetic"
ADULT_CSV = ROOT.parent / "shared" / "data" / "adult.csv"
JOB_TIMEOUT_S = 900
ROWS = {
    "fp32": "row_dtype: float32\n",
    "fp16": "row_dtype: float16\n",
    "fp16_nosr": "row_dtype: float16\nstochastic_rounding: false\n",
}
"""Lines added to an example's embedding config, by the key's middle part."""


def job_auc(command: list[str]) -> float:
    """Run one job to its end and return the ``test_auc`` its rank 0 printed."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
                          cwd=ROOT)
    found = re.findall(r"test_auc: ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or len(found) != 1:
        raise RuntimeError(f"{command[:4]}... exited {done.returncode} with "
                           f"{len(found)} test_auc line(s):\n{(done.stdout + done.stderr)[-3000:]}")
    return float(found[0])


def _config(example: Path, workdir: Path, rows: str) -> str:
    path = workdir / f"embedding_config_{rows}.yml"
    path.write_text((example / "embedding_config.yml").read_text() + ROWS[rows])
    return str(path)


def adult_auc(workdir: Path, rows: str) -> float:
    """Test AUC of the Adult example's reproducible run with ``rows`` (a key of ROWS)."""
    if not ADULT_CSV.exists():
        raise FileNotFoundError(f"{ADULT_CSV} is absent (UCI Adult, see "
                                f"examples/adult_income/README.md)")
    return job_auc([sys.executable, str(ADULT / "run_local.py"), "--csv", str(ADULT_CSV),
                     "--reproducible", "--embedding-config", _config(ADULT, workdir, rows)])


def criteo_auc(workdir: Path, rows: str, samples: int) -> float:
    """Test AUC of the synthetic Criteo example, ``samples`` training samples, one rank,
    reproducible, with ``rows`` (a key of ROWS)."""
    return job_auc([
        sys.executable, "-m", "persia_py.launcher.cli", "local",
        "--nn-worker", str(CRITEO / "train.py"), "--data-loader", str(CRITEO / "data_loader.py"),
        "--embedding-config", _config(CRITEO, workdir, rows),
        "--global-config", str(CRITEO / "global_config.yml"), "--num-ps", "2",
        "--data-loader-args", f"--train-samples {samples}",
        "--nn-worker-args", "--reproducible --embedding-staleness 1 --test-samples 20000"])


def accuracy(criteo_samples: int) -> dict[str, float]:
    """Every run of the module's docstring, in turn; printed as each ends."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="density-accuracy-") as tmp:
        for rows in ("fp32", "fp16", "fp16_nosr"):
            results[f"auc_{rows}_adult"] = adult_auc(Path(tmp), rows)
            print(f"auc_{rows}_adult: {results[f'auc_{rows}_adult']:.5f}", flush=True)
        for rows in ("fp32", "fp16"):
            results[f"auc_{rows}_criteo"] = criteo_auc(Path(tmp), rows, criteo_samples)
            print(f"auc_{rows}_criteo: {results[f'auc_{rows}_criteo']:.5f}", flush=True)
    for data, bound in (("adult", 0.001), ("criteo", 0.002)):
        gap = results[f"auc_fp16_{data}"] - results[f"auc_fp32_{data}"]
        print(f"{data}: float16 - float32 = {gap:+.5f} (bound {bound})", flush=True)
    return results
