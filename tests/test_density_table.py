"""bench/convergence.py's K/k summary and bench/density_table.py (in-process, no MPI)."""

from __future__ import annotations

import csv
import importlib.util
import math
import sys

import numpy as np

from .mpirun import ROOT


def _load(name: str):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_ratio_stats_verdicts() -> None:
    cv = _load("convergence")
    const = cv.ratio_stats(np.full(100, 643 / 643.43))
    assert const["in_band"] == 1.0 and not const["period2"] and math.isnan(const["ratio_lag1"])
    alt = cv.ratio_stats(np.tile([0.5, 2.0], 50))  # a period-2 cycle, half out of the band
    assert alt["period2"] and alt["ratio_lag1"] < -0.9 and alt["in_band"] == 0.0
    assert alt["out_of_band_steps"] == 100 and alt["ratio_min"] == 0.5 and alt["ratio_max"] == 2.0
    tiny = cv.ratio_stats(1 + 1e-3 * np.tile([-1.0, 1.0], 50))  # alternating, but negligibly
    assert tiny["ratio_lag1"] < -0.9 and not tiny["period2"]
    noise = cv.ratio_stats(1 + 0.1 * np.random.default_rng(0).standard_normal(1000))
    assert not noise["period2"] and abs(noise["ratio_lag1"]) < 0.2


def test_density_table_reads_a_convergence_csv(tmp_path, capsys) -> None:
    cv = _load("convergence")
    dt = _load("density_table")
    path = tmp_path / "run.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, cv.FIELDS)
        w.writeheader()
        for method, dens in (("dense", [1.0] * 20), ("x", [0.0] + [0.01] * 19),
                             ("y", [0.0] * 6 + [0.005, 0.02] * 7)):  # fmt: skip
            for step, d in enumerate(dens, 1):
                w.writerow({"task": "t", "method": method, "step": step, "achieved_density": d})
    assert dt.main([str(path)]) == 0
    out = capsys.readouterr().out
    rows = {ln.split("|")[1].strip(): ln for ln in out.splitlines() if ln.startswith("| ")}
    assert "dense" not in rows and "| 14 | 1.000 | 1.000 | 1.000 |" in rows["x"]
    assert rows["x"].rstrip().endswith("| 100.0% | – | no |")
    assert rows["y"].rstrip().endswith("| 0.0% | -1.00 | yes |")
    assert "# y: 14 step(s) out of the band (step: K/k): 7: 0.500, 8: 2.000" in out
