#!/usr/bin/env python3
"""Run an MPI command as P emulated hosts on one machine, over rate-capped links.

Each host is a network namespace joined to a bridge by a veth pair; both ends of every
veth are shaped (each host sends and receives at most ``--rate``, like a full-duplex port
of a switched network; with netem, ``--delay`` is added on the host's egress). MPICH is
forced off shared memory onto TCP (``MPIR_CVAR_CH4_NETMOD=ofi``, ``FI_PROVIDER=tcp``),
one rank per host: hydra's ssh launcher is pointed at a small script that runs each
proxy inside the namespace named by its host argument, and ``-iface`` makes the proxies
call mpiexec back over the bridge. The links' byte counters are printed afterwards, so
one can check that the traffic really crossed the capped links.

Needs root and iproute2 (``ip``, ``tc``). Namespaces, veths and the bridge are removed on
exit, on error and on SIGINT/SIGTERM/SIGHUP; ``--cleanup`` removes leftovers of a run that
was killed with SIGKILL. Only private addresses (``--subnet``, default 10.77.0.0/24) are
used, inside the namespaces and on the bridge.

Example (4 hosts at 1 Gbit/s, the OSU suite on a ResNet-50-sized gradient):

    python bench/emulate_cluster.py -n 4 -- \\
        python -m sparsecoll bench osu -m 25557032:25557032 --density 0.01

If the kernel has no netem qdisc, rates are capped with tbf and no delay is added (a
warning says so); the latency is then that of the veth/TCP path itself.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

__all__ = ["Cluster", "main", "parse_rate", "parse_time"]

PREFIX = "scemu"  # namespaces scemu-h0.., root-side veths scemu-v0.., bridge scemu-br
LOCK = Path("/run/lock/sparsecoll-emulate.lock")

# hydra's ssh launcher calls: SCRIPT [-x ...] HOST "PROXY" ARGS...; run the proxy inside
# the namespace named HOST (the host names passed to mpiexec are the namespace names).
LAUNCHER = """#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
exec ip netns exec "$host" sh -c "$*"
"""

RATE_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
}
TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def parse_rate(text: str) -> float:
    """A tc-style rate ('1gbit', '100mbit', '125mbps') in bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]+)\s*", text.lower())
    if not m or m.group(2) not in RATE_UNITS:
        raise ValueError(f"expecting a rate like 1gbit or 100mbit, got {text!r}")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]


def rate_arg(text: str) -> str:
    """A positive :func:`parse_rate` rate as an argparse ``type`` (the text kept, for tc)."""
    try:
        ok = parse_rate(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expecting a rate like 1gbit or 100mbit, got {text!r}")
    return text


def parse_time(text: str) -> float:
    """A tc-style time ('50us', '1ms', '0') in seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", text.lower())
    if not m or (m.group(2) and m.group(2) not in TIME_UNITS):
        raise ValueError(f"expecting a time like 50us or 1ms, got {text!r}")
    return float(m.group(1)) * TIME_UNITS[m.group(2) or "s"]


def time_arg(text: str) -> str:
    """A :func:`parse_time` time as an argparse ``type`` (the text kept, for tc)."""
    try:
        parse_time(text)
    except ValueError:
        message = f"expecting a time like 50us or 1ms, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None
    return text


def sh(*cmd: str, check: bool = True, ns: str | None = None) -> str:
    """Run a command (inside namespace ``ns`` when given); return its stdout."""
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    proc = subprocess.run(full, capture_output=True, text=True)
    if check and proc.returncode:
        raise RuntimeError(f"{' '.join(full)} failed: {proc.stderr.strip()}")
    return proc.stdout


class Cluster:
    """P namespaces on a bridge, shaped; a context manager that always cleans up."""

    def __init__(self, hosts: int, rate: str, delay: str, subnet: str) -> None:
        net = ipaddress.ip_network(subnet)
        if not net.is_private:
            raise ValueError(f"subnet must be private, got {subnet}")
        if net.num_addresses < hosts + 3:
            raise ValueError(f"subnet {subnet} too small for {hosts} hosts")
        self.hosts = hosts
        self.rate = rate
        self.rate_bps = parse_rate(rate)
        self.delay = delay
        self.delay_s = parse_time(delay)
        self.prefix_len = net.prefixlen
        addrs = list(net.hosts())
        self.bridge_ip = str(addrs[0])
        self.host_ips = [str(a) for a in addrs[1 : hosts + 1]]
        self.names = [f"{PREFIX}-h{i}" for i in range(hosts)]
        self.veths = [f"{PREFIX}-v{i}" for i in range(hosts)]
        self.bridge = f"{PREFIX}-br"
        self.netem = False
        self._lock: int | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self._lock = os.open(LOCK, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            raise RuntimeError(f"another emulated cluster is running (lock {LOCK})") from None
        cleanup()  # leftovers of a run killed with SIGKILL
        try:
            self._setup()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        cleanup()
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            os.close(self._lock)
            self._lock = None

    def _setup(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.bridge_ip}/{self.prefix_len}", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        self.netem = netem_available()
        for name, veth, ip in zip(self.names, self.veths, self.host_ips):
            sh("ip", "netns", "add", name)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            if not self.netem:  # tbf passes no packet larger than its burst
                gso = str(self.gso_max_size)
                sh("ip", "link", "set", veth, "gso_max_size", gso)
                sh("ip", "-n", name, "link", "set", "eth0", "gso_max_size", gso)
            sh("ip", "link", "set", veth, "master", self.bridge)
            sh("ip", "link", "set", veth, "up")
            sh("ip", "-n", name, "link", "set", "lo", "up")
            sh("ip", "-n", name, "addr", "add", f"{ip}/{self.prefix_len}", "dev", "eth0")
            sh("ip", "-n", name, "link", "set", "eth0", "up")
            # the host's egress carries the delay; the switch port towards it only the rate
            sh("tc", *self._qdisc("eth0", self.delay_s), ns=name)
            sh("tc", *self._qdisc(veth, 0.0))

    @property
    def burst(self) -> int:
        """tbf's bucket: 1 ms of traffic, at least 8 KiB. A bigger one lets a link idle
        for a while send that much at full speed: the old floor of 128 KiB was 21 ms of
        traffic at 50 Mbit/s, which favoured bursty (synchronous) traffic over a steady
        stream."""
        return max(8 << 10, int(self.rate_bps / 8 * 1e-3))

    @property
    def gso_max_size(self) -> int:
        """The largest packet TCP may hand the veths (segmentation offload builds up to
        64 KiB): half of tbf's burst, which drops any packet larger than the burst."""
        return min(65536, self.burst // 2)

    def _qdisc(self, dev: str, delay: float) -> list[str]:
        rate = f"{int(self.rate_bps)}bit"
        queue = max(1 << 20, int(self.rate_bps / 8 * 0.02))  # 20 ms of traffic, >= 1 MiB
        if self.netem:
            args = ["netem", "rate", rate, "limit", str(max(1000, queue // 1500))]
            if delay > 0:
                args[1:1] = ["delay", f"{delay * 1e6:.0f}us"]
            return ["qdisc", "add", "dev", dev, "root", *args]
        burst = self.burst
        return [
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            str(burst),
            "limit",
            str(queue),
        ]

    # -- running ------------------------------------------------------------------------
    def mpiexec_args(self, mpiexec: str, launcher: str) -> list[str]:
        return [
            mpiexec,
            "-launcher",
            "ssh",
            "-launcher-exec",
            launcher,
            "-hosts",
            ",".join(self.names),
            "-ppn",
            "1",
            "-n",
            str(self.hosts),
            "-iface",
            self.bridge,
            "-genv",
            "MPIR_CVAR_CH4_NETMOD",
            "ofi",
            "-genv",
            "FI_PROVIDER",
            "tcp",
            "-genv",
            "FI_TCP_IFACE",
            "eth0",
        ]

    def counters(self) -> list[dict[str, int]]:
        """Per host: bytes sent and received on its eth0, and bytes through its shaper."""
        out = []
        for name in self.names:
            link = json.loads(sh("ip", "-n", name, "-s", "-j", "link", "show", "dev", "eth0"))
            qd = json.loads(sh("tc", "-s", "-j", "qdisc", "show", "dev", "eth0", ns=name))
            stats = link[0]["stats64"]
            out.append(
                {
                    "tx_bytes": int(stats["tx"]["bytes"]),
                    "rx_bytes": int(stats["rx"]["bytes"]),
                    "shaped_bytes": int(sum(q.get("bytes", 0) for q in qd if q.get("root"))),
                }
            )
        return out

    def describe(self) -> str:
        delay = f"delay {self.delay}" if self.netem else "no added delay (kernel has no netem)"
        shaper = "netem" if self.netem else "tbf"
        return (
            f"{self.hosts} hosts on bridge {self.bridge} ({self.bridge_ip}/{self.prefix_len}), "
            f"each link capped at {self.rate} both ways ({shaper}), {delay}"
        )


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (probed on a throwaway namespace's lo)."""
    probe = f"{PREFIX}-probe"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    try:
        sh("ip", "netns", "add", probe)
        proc = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                probe,
                "tc",
                "qdisc",
                "add",
                "dev",
                "lo",
                "root",
                "netem",
                "delay",
                "1us",
            ],
            capture_output=True,
        )
        return proc.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def cleanup() -> list[str]:
    """Remove every namespace and link this script creates; return what was removed."""
    removed = []
    for line in subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True
    ).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(f"{PREFIX}-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    for line in subprocess.run(
        ["ip", "-o", "link", "show"], capture_output=True, text=True
    ).stdout.splitlines():
        m = re.match(r"\d+:\s+([^:@\s]+)", line)
        if m and m.group(1).startswith(f"{PREFIX}-"):
            subprocess.run(["ip", "link", "del", m.group(1)], capture_output=True)
            removed.append(m.group(1))
    return removed


def _find_mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return os.environ.get("SPARSECOLL_MPIEXEC") or (
        str(here) if here.exists() else shutil.which("mpiexec") or "mpiexec"
    )


def _is_hydra(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is MPICH's Hydra, whose options (-launcher, -iface, -genv) and
    MPICH's variables (MPIR_CVAR_*) this script uses; Open MPI's mpiexec has neither."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in out.stdout + out.stderr


class _Terminated(Exception):
    pass


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _on_signal(signum: int, frame: object) -> None:
    raise _Terminated(signal.Signals(signum).name)


def _start(cmd: list[str]) -> tuple[subprocess.Popen, str | None]:
    """Start ``cmd`` in a session of its own, and name the signal that came meanwhile, if
    one did: raised inside Popen, after the command had started, it would have left the
    command running unknown to the caller. Raises it if the command could not start."""
    held: list[int] = []
    old = {sig: signal.signal(sig, lambda s, _: held.append(s)) for sig in SIGNALS}
    proc = None
    try:
        proc = subprocess.Popen(cmd, start_new_session=True)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if held and proc is None:
            raise _Terminated(signal.Signals(held[0]).name)
    return proc, signal.Signals(held[0]).name if held else None


def main(argv: list[str] | None = None) -> int:
    from sparsecoll.benchmarks.cli import int_arg

    p = argparse.ArgumentParser(
        prog="emulate_cluster.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Everything after -- is the command each rank runs (under mpiexec).",
    )
    p.add_argument("-n", "--hosts", type=int_arg(1), default=4, help="hosts = ranks (default 4)")
    p.add_argument(
        "--rate", type=rate_arg, default="1gbit", help="link rate, tc syntax (default 1gbit)"
    )
    p.add_argument(
        "--delay",
        type=time_arg,
        default="50us",
        help="one-way delay added by netem (default 50us)",
    )
    p.add_argument("--subnet", default="10.77.0.0/24", help="private subnet for the hosts")
    p.add_argument("--mpiexec", default=None, help="mpiexec to use (default: the venv's)")
    p.add_argument("--cleanup", action="store_true", help="only remove leftovers, then exit")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:  # (the subnet against --hosts: checked before the root and tool checks, not after)
        cluster = Cluster(args.hosts, args.rate, args.delay, args.subnet)
    except ValueError as exc:
        p.error(f"argument --subnet: {exc}")
    if args.cleanup:
        print("removed:", " ".join(cleanup()) or "nothing", file=sys.stderr)
        return 0
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        p.error("no command given (put it after --)")
    mpiexec = args.mpiexec or _find_mpiexec()
    if not _is_hydra(mpiexec):
        p.error(
            f"{mpiexec} is not MPICH's Hydra mpiexec: this script drives Hydra's ssh launcher "
            f"and MPICH's TCP settings (pass --mpiexec, with an mpi4py built on MPICH)"
        )
    if os.geteuid() != 0:
        p.error("needs root (network namespaces and tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            p.error(f"{tool} not found: apt-get install -y iproute2")
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)
    log = lambda msg: print(f"[emulate] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    rc = 1
    try:
        with (
            cluster as cl,
            tempfile.TemporaryDirectory(prefix="sparsecoll-emulate-") as tmp,
        ):
            if not cl.netem:
                log(
                    "warning: this kernel has no netem qdisc: rates are capped with tbf, "
                    "no delay is added"
                )
            log(cl.describe())
            launcher = Path(tmp) / "netns-launcher"
            launcher.write_text(LAUNCHER)
            launcher.chmod(0o755)
            full = cl.mpiexec_args(mpiexec, str(launcher)) + cmd
            log("running: " + shlex.join(full))
            before = cl.counters()
            t0 = time.monotonic()
            proc, held = _start(full)
            try:
                if held:
                    raise _Terminated(held)
                rc = proc.wait()
            finally:  # never leave ranks running in namespaces that are about to go
                _kill(proc)
            elapsed = time.monotonic() - t0
            after = cl.counters()
            log(f"command exited with {rc} after {elapsed:.1f} s; traffic on the capped links:")
            log(f"{'host':<10}{'tx bytes':>16}{'rx bytes':>16}{'through shaper':>16}")
            for name, b, a in zip(cl.names, before, after):
                d = {key: a[key] - b[key] for key in a}
                log(f"{name:<10}{d['tx_bytes']:>16}{d['rx_bytes']:>16}{d['shaped_bytes']:>16}")
            total = sum(a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before))
            log(
                f"{'total':<10}{total:>16}  ({total / max(elapsed, 1e-9) * 8 / 1e6:.0f} Mbit/s "
                f"averaged over the whole run, all hosts)"
            )
    except (KeyboardInterrupt, _Terminated) as exc:
        log(f"interrupted ({exc or 'SIGINT'}): cleaning up")
        rc = 130
    left = [line for line in sh("ip", "netns", "list").splitlines() if line.startswith(PREFIX)]
    log("cleaned up" if not left else f"warning: namespaces left behind: {left}")
    return rc


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
