"""bench/emulate_cluster.py: argument handling, the netns launcher, and (as root) a real run."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .mpirun import ROOT

SCRIPT = ROOT / "bench" / "emulate_cluster.py"


def _module():
    spec = importlib.util.spec_from_file_location("emulate_cluster", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


emu = _module()


def test_parse_rate_and_time() -> None:
    assert emu.parse_rate("1gbit") == 1e9
    assert emu.parse_rate("100mbit") == 1e8
    assert emu.parse_rate("125mbps") == 1e9
    assert emu.parse_time("50us") == pytest.approx(50e-6)
    assert emu.parse_time("0") == 0.0
    for bad in ("fast", "1gbyte", ""):
        with pytest.raises(ValueError):
            emu.parse_rate(bad)
    with pytest.raises(ValueError):
        emu.parse_time("1 hour")


def test_cluster_plan_uses_private_addresses_and_forces_tcp() -> None:
    cl = emu.Cluster(4, "1gbit", "50us", "10.77.0.0/24")
    assert cl.bridge_ip == "10.77.0.1"
    assert cl.host_ips == ["10.77.0.2", "10.77.0.3", "10.77.0.4", "10.77.0.5"]
    assert all(len(v) <= 15 for v in [*cl.veths, cl.bridge])  # Linux interface names
    args = cl.mpiexec_args("mpiexec", "/tmp/launcher")
    joined = " ".join(args)
    assert "-launcher ssh -launcher-exec /tmp/launcher" in joined
    assert "-ppn 1 -n 4" in joined
    assert f"-iface {cl.bridge}" in joined
    assert "-genv MPIR_CVAR_CH4_NETMOD ofi -genv FI_PROVIDER tcp" in joined
    assert f"-hosts {','.join(cl.names)}" in joined
    with pytest.raises(ValueError, match="private"):
        emu.Cluster(2, "1gbit", "0", "8.8.8.0/24")
    with pytest.raises(ValueError, match="too small"):
        emu.Cluster(8, "1gbit", "0", "10.0.0.0/29")


def test_qdisc_caps_rate_both_ways() -> None:
    cl = emu.Cluster(2, "1gbit", "50us", "10.77.0.0/24")
    cl.netem = False
    args = cl._qdisc("eth0", 50e-6)
    assert args[:6] == ["qdisc", "add", "dev", "eth0", "root", "tbf"]
    assert args[args.index("rate") + 1] == "1000000000bit"
    cl.netem = True
    args = cl._qdisc("eth0", 50e-6)
    assert "netem" in args
    assert args[args.index("delay") + 1] == "50us"
    assert "delay" not in cl._qdisc("veth", 0.0)


def test_tbf_burst_is_short_and_packets_fit() -> None:
    """tbf's bucket holds about 1 ms of traffic (a slow link idle for a while must not send
    tens of ms of traffic at full speed), and packets fit in it (tbf drops bigger ones)."""
    for rate, bps in (("30mbit", 30e6), ("1gbit", 1e9), ("10gbit", 10e9)):
        cl = emu.Cluster(2, rate, "0", "10.77.0.0/24")
        cl.netem = False
        args = cl._qdisc("eth0", 0.0)
        burst = int(args[args.index("burst") + 1])
        assert burst == cl.burst <= max(8 << 10, bps / 8 * 1e-3)
        assert 1514 < cl.gso_max_size <= burst // 2


def test_launcher_runs_the_proxy_inside_the_named_namespace(tmp_path: Path) -> None:
    """hydra calls ``SCRIPT -x HOST "PROXY" ARGS...``; the script must run
    ``ip netns exec HOST sh -c "PROXY ARGS..."`` (checked with a fake ``ip``)."""
    launcher = tmp_path / "launcher"
    launcher.write_text(emu.LAUNCHER)
    launcher.chmod(0o755)
    fake_ip = tmp_path / "ip"
    fake_ip.write_text('#!/bin/sh\nfor a in "$@"; do echo "[$a]"; done\n')
    fake_ip.chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    out = subprocess.run(
        [
            str(launcher),
            "-x",
            "scemu-h1",
            '"/venv/bin/hydra_pmi_proxy"',
            "--control-port",
            "10.77.0.1:1234",
        ],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout.split("\n")
    assert out[:5] == ["[netns]", "[exec]", "[scemu-h1]", "[sh]", "[-c]"]
    assert out[5] == '["/venv/bin/hydra_pmi_proxy" --control-port 10.77.0.1:1234]'


def _netns_usable() -> bool:
    if not emu._is_hydra(emu._find_mpiexec()):  # the script drives MPICH's Hydra only
        return False
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = subprocess.run(["ip", "netns", "add", "scemu-testprobe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "scemu-testprobe"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(not _netns_usable(), reason="needs root, network namespaces and MPICH")
def test_real_run_crosses_the_links_and_cleans_up() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        str(SCRIPT),
        "-n",
        "2",
        "--",
        sys.executable,
        "-m",
        "sparsecoll",
        "bench",
        "osu",
        "-m",
        "64K",
        "-i",
        "2",
        "-x",
        "1",
        "-c",
        "-q",
        "--format",
        "csv",
        "--algorithm",
        "dense",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = [line for line in proc.stdout.splitlines() if line.startswith("dense,")]
    assert ",yes," in row
    # three calls of 2 (P-1)/P * 256 KiB each: the bytes must show on both hosts' links
    tx = [
        int(line.split()[2])
        for line in proc.stderr.splitlines()
        if line.startswith("[emulate] scemu-h")
    ]
    assert len(tx) == 2
    assert all(t >= 3 * 2**18 for t in tx), proc.stderr
    assert "[emulate] cleaned up" in proc.stderr
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "scemu-" not in left


@pytest.mark.slow
@pytest.mark.skipif(not _netns_usable(), reason="needs root, network namespaces and MPICH")
def test_sigterm_stops_the_command_and_cleans_up() -> None:
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "-n", "2", "--", "sleep", "120"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while "scemu-h1" not in _netns() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "scemu-h1" in _netns()
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert "interrupted (SIGTERM)" in err
    assert "scemu-" not in _netns()


def _netns() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_other_launchers_are_refused_before_any_setup(tmp_path: Path) -> None:
    """Open MPI's mpiexec has no -launcher/-iface: it failed at once, after the namespaces
    were made (and a test waiting for them timed out); now a usage error up front."""
    fake = tmp_path / "mpiexec"
    fake.write_text('#!/bin/sh\necho "mpiexec (Open MPI) 5.0.11"\n')
    fake.chmod(0o755)
    cmd = [sys.executable, str(SCRIPT), "-n", "2", "--mpiexec", str(fake), "--", "true"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "is not MPICH's Hydra mpiexec" in proc.stderr
    assert "[emulate]" not in proc.stderr


# _start in a process of its own, whose Popen signals that process before or after starting
_SIGNAL_IN_START = """
import importlib.util, os, signal, subprocess, sys

spec = importlib.util.spec_from_file_location("emulate_cluster", sys.argv[1])
emu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(emu)
when, sig, cmd = sys.argv[2], int(sys.argv[3]), sys.argv[4:]
for s in emu.SIGNALS:
    signal.signal(s, emu._on_signal)

class Popen(subprocess.Popen):
    def __init__(self, cmd, **kwargs):
        if when == "before":
            os.kill(os.getpid(), sig)
        super().__init__(cmd, **kwargs)
        if when == "after":
            os.kill(os.getpid(), sig)

subprocess.Popen = Popen
try:
    proc, held = emu._start(cmd)
except emu._Terminated as exc:
    print("raised", exc)
else:
    print(held, proc.poll() is None)
    proc.kill()
print(all(signal.getsignal(s) is emu._on_signal for s in emu.SIGNALS))
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
@pytest.mark.parametrize(
    ("when", "cmd", "printed"),
    [("after", ["sleep", "30"], "{sig} True"), ("before", ["/nonexistent/x"], "raised {sig}")],
)
def test_a_signal_while_mpiexec_starts_is_named_not_raised_inside_popen(sig, when, cmd, printed):
    """A signal that came while Popen started mpiexec was raised inside Popen, after the
    command had started: the command ran on, unknown to the script, which tore down the
    namespaces under it. Now _start returns the command with the signal's name (the caller
    stops it, then cleans up); when the command could not start, the signal is raised."""
    args = [str(SCRIPT), when, str(int(getattr(signal, sig))), *cmd]
    out = subprocess.run(
        [sys.executable, "-c", _SIGNAL_IN_START, *args],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert out.stdout.split("\n")[:2] == [printed.format(sig=sig), "True"], out.stderr
