"""The α-β model: union sizes, formulas against the Communicator's counters, calibration."""

from __future__ import annotations

import csv
import importlib.util
import io
import math

import numpy as np
import pytest

from sparsecoll import available_algorithms
from sparsecoll.algorithms.base import Fold, range_bounds
from sparsecoll.benchmarks.model import (
    FORMULAS,
    LINKS,
    Counts,
    Link,
    Problem,
    calibrate,
    check_messages,
    range_nnz,
    read_rows,
    union_size,
)
from sparsecoll.benchmarks.osu import FIELDS

from .mpirun import ROOT, run_mpi

# Formulas that are the Communicator's count exactly (the others are estimates: their
# volume depends on how the data falls, e.g. build-up or the selected count).
EXACT_FORMULAS = ("dense", "rabenseifner", "allgather")


def test_union_size() -> None:
    n, k = 10_000, 100
    assert union_size(n, k, 1, "random") == pytest.approx(k)
    assert union_size(n, k, 7, "same") == k
    assert union_size(n, k, 7, "disjoint") == 7 * k
    assert union_size(n, k, 1000, "disjoint") == n
    assert union_size(n, k, 0) == 0
    grow = [union_size(n, k, m, "random") for m in (1, 2, 4, 8, 1024)]
    assert grow == sorted(grow)
    assert grow[-1] < n
    assert union_size(n, k, 2, "random") == pytest.approx(n * (1 - (1 - k / n) ** 2))
    assert union_size(n, k, 1, "skewed") == pytest.approx(k, rel=0.01)
    with pytest.raises(ValueError):
        union_size(n, k, 2, "nope")


def test_formulas_shapes() -> None:
    x = Problem(n=2**24, k=2**17)
    for name, f in FORMULAS.items():
        assert f(1, x) == Counts(0, 0), name
        assert f(8, x).bytes > 0, name
    # dense and oktopk are flat in P, allgather linear, gtopk logarithmic
    assert FORMULAS["dense"](1024, x).bytes < 2 * x.n * 4
    assert FORMULAS["oktopk"](1024, x).bytes < 6 * x.k * x.pair
    assert FORMULAS["allgather"](1024, x).bytes == 1023 * x.k * 8
    assert FORMULAS["gtopk"](1024, x).bytes == 10 * x.k * 8
    # dsa switches the gathered result to dense once the union passes break-even
    assert FORMULAS["dsa"](1024, x).bytes <= (x.k * 1023 / 1024) * 8 + x.n * 4


def test_range_nnz_follows_the_overlap_pattern() -> None:
    """Each rank's expected counts add up to its k, the union never exceeds a range and adds
    up to union_size, and the patterns put the nonzeros where make_problem does."""
    n, k = 100_003, 1000
    for overlap in ("random", "same", "disjoint", "skewed"):
        for P in (2, 3, 7, 16):
            c, union = range_nnz(Problem(n=n, k=k, overlap=overlap), P)
            lengths = np.diff(range_bounds(n, P))
            assert c.sum(axis=1) == pytest.approx(np.full(P, k)), (overlap, P)
            assert (union <= lengths + 1e-9).all() and (union >= c.max(axis=0) - 1e-9).all()
            if overlap == "disjoint":  # every rank's indices in its own range
                assert (c == np.diag(union)).all() and (union == k).all()
            if overlap == "same":
                assert union == pytest.approx(c[0])
            assert union.sum() == pytest.approx(union_size(n, k, P, overlap))
    c, union = range_nnz(Problem(n=n, k=k, overlap="skewed"), 4)  # range 0 holds the hot 10%
    assert c[0, 0] > 0.9 * k and union[0] > union_size(n // 10, 900, 4)


@pytest.mark.parametrize("overlap", ["hot", "zipf", "tokens"])
def test_range_nnz_of_the_skewed_patterns(overlap) -> None:
    """As above for hot (80% in the first 1/P), zipf and tokens (inclusion probabilities
    of the weighted draw): the model's union matches make_problem's within 2%, and range 0
    carries the most."""
    from sparsecoll.benchmarks.problems import make_problem

    n, k = 1 << 18, 3000
    for P in (2, 3, 8):
        x = Problem(n=n, k=k, overlap=overlap, ranks=P)
        c, union = range_nnz(x, P)
        lengths = np.diff(range_bounds(n, P))
        assert c.sum(axis=1) == pytest.approx(np.full(P, k), rel=1e-6), (overlap, P)
        assert (union <= lengths + 1e-9).all() and (union >= c.max(axis=0) - 1e-9).all()
        assert union.sum() == pytest.approx(union_size(n, k, P, overlap, P))
        assert c[0, 0] == c[0].max() and union[0] == union.max()
        drawn = [make_problem(n, k / n, r, P, overlap)[1] for r in range(P)]
        got = np.unique(np.concatenate(drawn)).size
        assert union.sum() == pytest.approx(got, rel=0.02), (overlap, P)
    assert range_nnz(Problem(n=n, k=k, overlap="hot", ranks=4), 4)[0][0, 0] == 2400
    with pytest.raises(ValueError, match="'hot' needs the ranks"):
        Problem(n=n, k=k, overlap="hot")


def test_dsa_owner_of_the_hot_range_sends_it_every_round() -> None:
    """Skewed inputs: rank 0 owns the hot range and sends it in each of Bruck's lg rounds;
    disjoint inputs: nothing to reduce-scatter, each rank's k pairs sent P − 1 times."""
    x = Problem(n=1 << 16, k=655, overlap="skewed")
    for P in (3, 4, 8):
        _, union = range_nnz(x, P)
        hot = x.sp(union[0], (1 << 16) // P)
        assert FORMULAS["dsa"](P, x).bytes >= math.ceil(math.log2(P)) * hot
    for P in (2, 5, 8):
        x = Problem(n=1 << 16, k=655, overlap="disjoint")
        assert FORMULAS["dsa"](P, x).bytes == (P - 1) * 655 * x.pair


def test_link_time_and_check_messages() -> None:
    link = Link("test", 1e-5, 1e9)
    assert link.time(10, 1e9) == pytest.approx(1.0001)
    assert check_messages(1) == 0
    assert check_messages(8) == 6
    assert set(LINKS) == {"1gbe", "ib100", "aries"}


def _rows(P: int, t_us: float = 0.0, nbytes: int = 0, msgs: int = 0, meta: int = 0, **over):
    """One CSV row as the suite writes it (bytes received = bytes sent)."""
    r = dict.fromkeys(FIELDS, "")
    r.update(algorithm="allgather", n=1000, k=10, dtype="float32", overlap="random")
    r.update(density=0.01, iterations=1, avg_us=t_us, min_us=t_us, max_us=t_us, result_nnz=0)
    r.update(P=P, median_us=t_us, bytes_per_rank=nbytes, bytes_recv_per_rank=nbytes)
    r.update(messages_per_rank=msgs, meta_messages_per_rank=meta, meta_bytes_per_rank=0)
    r.update(over)
    return r


def test_calibration_uses_measurements_and_scales_formulas() -> None:
    x = Problem(n=1000, k=10)
    # (allgather: one allgatherv and the counts' allgather, lg messages each)
    rows = [_rows(1, 100.0), _rows(2, 300.0, 100, 1, 1), _rows(4, 900.0, 480, 2, 2)]
    cal = calibrate("allgather", x, rows)
    assert cal.counts(4) == Counts(480, 4)  # measured where measured
    assert cal.bytes_factor == pytest.approx(480 / (3 * 10 * 8))  # at the largest P
    assert cal.messages_factor == pytest.approx(4 / 4)
    assert cal.counts(16).bytes == pytest.approx(15 * 10 * 8 * cal.bytes_factor)
    assert cal.c0 == pytest.approx(100e-6)
    assert cal.c1 == pytest.approx(200e-6 / 100)
    link = Link("l", 1e-6, 1e6)
    want = 1e-6 * (4 + check_messages(4)) + 480 / 1e6 + 100e-6 + 2e-6 * 480
    assert cal.time(4, link) == pytest.approx(want)
    assert cal.time(1, link) == pytest.approx(100e-6)
    with pytest.raises(KeyError):
        calibrate("nosuch", x, rows)


def test_read_rows_round_trip(tmp_path) -> None:
    path = tmp_path / "a.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        w.writerow(_rows(2, 1.0, 5, 1))
        w.writerow(_rows(2, error="boom"))
    (row,) = read_rows([str(path)])
    assert row["P"] == 2
    assert row["bytes_per_rank"] == 5


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_formulas_match_the_communicator(nprocs: int) -> None:
    """Every formula against a real run: exact ones to the byte, the others within 15%."""
    n = 1 << 15
    # steady state (--reuse after one warm-up call), as the formulas describe
    args = ["-m", "sparsecoll", "bench", "osu", "-m", str(n), "-i", "1", "-x", "1", "-q"]
    proc = run_mpi(nprocs, [*args, "--reuse", "--format", "csv"], timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    x = Problem(n=n, k=int(rows[0]["k"]))
    seen = set()
    for r in rows:
        name = r["algorithm"]
        if name not in FORMULAS:
            continue
        seen.add(name)
        f = FORMULAS[name](nprocs, x)
        got = int(r["bytes_per_rank"])
        msgs = int(r["messages_per_rank"]) + int(r["meta_messages_per_rank"])
        if name in EXACT_FORMULAS:
            assert got == math.floor(f.bytes) or got == round(f.bytes), (name, got, f)
            assert msgs == f.messages, (name, msgs, f)
        else:  # estimates (union sizes, selected counts): within 15%
            assert 0.85 <= got / f.bytes <= 1.15, (name, got, f)
            assert 0.85 <= msgs / f.messages <= 1.15, (name, msgs, f)
    assert seen >= set(EXACT_FORMULAS) & set(available_algorithms())


def test_recursive_doubling_formula_follows_the_fold() -> None:
    """The busiest rank's volume, from the fold plan itself: with disjoint inputs (a union
    of m inputs is m·k exactly) and no dense switch, each member of the power-of-two group
    sends, in round i, the inputs of its aligned block of 2^i members (a member that took
    a folded partner's holds two), and a member with a partner sends it the result."""
    x = Problem(n=2**40, k=1000, overlap="disjoint")
    for P in range(2, 41):
        p = 1 << (P.bit_length() - 1)
        holds = [0] * p
        for rank in range(P):
            fold = Fold.plan(rank, P)
            if not fold.folded:
                holds[fold.newrank] += 1 + (fold.partner >= 0)
        sent = [0] * p
        for i in range(p.bit_length() - 1):
            for r in range(p):
                block = r & ~((1 << i) - 1)
                sent[r] += sum(holds[block : block + (1 << i)]) * x.k * x.pair
        for r in range(p):
            if holds[r] == 2:  # back to the folded partner
                sent[r] += P * x.k * x.pair
        want = max(sent)
        assert FORMULAS["recursive_doubling"](P, x).bytes == want, P


@pytest.mark.mpi
def test_fold_and_bruck_formulas_match_the_communicator() -> None:
    """P = 7 folds three pairs (recursive doubling's busiest rank holds two inputs per member
    of its block) and dsa's Bruck runs wrap (two pieces a round): recursive doubling's bytes
    within 3% (random overlap: expected union sizes) and both algorithms' messages exactly."""
    n = 1 << 16
    args = ["-m", "sparsecoll", "bench", "osu", "-m", str(n), "-i", "1", "-x", "0", "-q"]
    args += ["--algorithm", "recursive_doubling,dsa", "--format", "csv"]
    proc = run_mpi(7, args, timeout=300)
    assert proc.returncode == 0, proc.stdout[-6000:]
    rows = {r["algorithm"]: r for r in csv.DictReader(io.StringIO(proc.stdout))}
    x = Problem(n=n, k=int(rows["dsa"]["k"]))
    for name, r in rows.items():
        f = FORMULAS[name](7, x)
        msgs = int(r["messages_per_rank"]) + int(r["meta_messages_per_rank"])
        assert msgs == f.messages, (name, msgs, f)
        if name == "recursive_doubling":
            assert 0.97 <= int(r["bytes_per_rank"]) / f.bytes <= 1.03, (name, r, f)
    assert set(rows) == {"recursive_doubling", "dsa"}


def test_project_model_script_runs(tmp_path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("pm", ROOT / "bench" / "project_model.py")
    pm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pm)
    shm, emu = tmp_path / "shm.csv", tmp_path / "emu.csv"
    x = Problem(n=1 << 20, k=1 << 13)
    for path, slow in ((shm, 0.0), (emu, 1.0)):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            for name in ("dense", "allgather"):
                for P in (1, 2, 4):
                    c = FORMULAS[name](P, x)
                    t = 1e3 + slow * (c.bytes / 125e6 * 1e6 + 50 * (c.messages + 2))
                    b, m = int(c.bytes), int(c.messages)
                    w.writerow(_rows(P, t, b, m, algorithm=name, n=x.n, k=x.k))
    assert (
        pm.main(
            ["--shm", str(shm), "--emulated", str(emu), "--emu-alpha", "50e-6", "--P", "8,1024"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "## Validation on the emulated cluster" in out
    assert "| allgather | 4 |" in out
    assert "median |error|" in out
    assert "Projected latency" in out
    assert "| dense |" in out


def test_main_bench_projection() -> None:
    """The main job's 1G/10G columns: the time here plus α·messages + bytes/B."""
    from sparsecoll.benchmarks.main import PROJECTED, projected_ms

    one, ten = PROJECTED
    assert one == LINKS["1gbe"]
    assert (ten.alpha, ten.bandwidth) == (10e-6, 1.25e9)
    assert projected_ms(one, 0.010, 125_000_000, 20) == pytest.approx(10 + 1000 + 1)
    assert projected_ms(ten, 0.0, 0, 0) == 0
