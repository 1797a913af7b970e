"""Network namespaces, veths, a bridge and tc shaping: the emulated cluster's wiring.

    smoe-n0 [lo, eth0 10.77.0.1/24] ── veth ──┐
    smoe-n1 [lo, eth0 10.77.0.2/24] ── veth ──┼── br0 in smoe-sw (the "switch")
    ...                                        ┘

Each node link is shaped in both directions with `tbf` at `rate` (node egress on eth0, switch egress
on the node's port), so a node sends and receives at most `rate` each way, like a full-duplex NIC,
and several senders into one node share its downlink. `latency` adds a `netem` delay of half the
one-way latency on each side (node to node = `latency`); kernels without sch_netem refuse it with a
clear error. Ranks of one node talk to each other through the node's own address, which the kernel
routes over that namespace's loopback: intra-node traffic never touches eth0 and is never shaped.

Nothing is created outside these namespaces: the veth ends are created directly inside them and
the 10.77.0.0/24 addresses exist only there. What exists is recorded in STATE_FILE, plus a hosts file
per node under /etc/netns/; `down` removes every `smoe-*` namespace (with everything in it) and
those files whether or not the state file survived.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

__all__ = [
    "IFNAME",
    "PREFIX",
    "STATE_FILE",
    "Testbed",
    "bucket_bytes",
    "check_prerequisites",
    "down",
    "link_bytes",
    "load",
    "namespaces",
    "parse_latency",
    "parse_rate",
    "up",
]

PREFIX = "smoe-"
SWITCH = PREFIX + "sw"
IFNAME = "eth0"  # the node's interface inside its namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.77.0"
STATE_FILE = "/run/schemoe/testbed.json"
# Near loopback's MTU: far fewer packets per byte, so the two CPU cores that also run the ranks
# spend little on softirq and the link, not the CPU, is the limit (9000 gave ~0.8 of the rate).
MTU = 65000
ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts ETC/NS/hosts over /etc/hosts

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Testbed:
    """What `up` created; serialised to STATE_FILE."""

    nodes: int
    rate_bps: float  # bits per second, each direction of each node link
    latency_s: float  # one-way node-to-node latency added by netem (0 = none)
    addresses: tuple[str, ...]  # node n's address, inside namespace node_ns(n)

    def node_ns(self, n: int) -> str:
        return f"{PREFIX}n{n}"

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    def describe(self) -> str:
        lat = f", +{self.latency_s * 1e3:g} ms one-way" if self.latency_s else ""
        return f"testbed: {self.nodes} nodes, {self.rate_bps / 1e9:g} Gbit/s per link each way{lat}"


def parse_rate(text: str) -> float:
    """'400mbit' -> 4e8 bits/s. Units: bit, kbit, mbit, gbit, tbit (powers of 1000)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _RATE_UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"rate {text!r}: expected a positive number and one of {', '.join(_RATE_UNITS)} "
            "(e.g. 400mbit; tc's 'bps' means bytes/s and is not accepted to avoid confusion)"
        )
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_latency(text: str | None) -> float:
    """'2ms' -> 0.002 s; None or '0' -> 0. Units: us, ms, s."""
    if text is None or str(text).strip() in ("", "0"):
        return 0.0
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(us|ms|s)\s*", str(text))
    if not m:
        raise ValueError(f"latency {text!r}: expected a number and us, ms or s (e.g. 2ms)")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def check_prerequisites() -> None:
    """Raise PermissionError / FileNotFoundError saying what is missing."""
    if os.geteuid() != 0:
        raise PermissionError(
            "the testbed needs root (network namespaces and tc); run as root, or benchmark on "
            "plain loopback with --nproc P instead of --testbed"
        )
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise FileNotFoundError(
                f"`{tool}` not found: install iproute2 (Debian/Ubuntu: apt-get install iproute2)"
            )


def _run(*cmd: str, ns: str | None = None, check: bool = True) -> str:
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    p = subprocess.run(full, capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode:
        raise RuntimeError(f"`{' '.join(full)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def namespaces() -> list[str]:
    """Every testbed namespace that exists now."""
    out = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=30, check=False
    )
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX))


def bucket_bytes(rate_bps: float) -> int:
    """tbf's bucket: what may leave at line speed after an idle spell. 1 ms of traffic, but at
    least two full frames (tbf drops a frame bigger than its bucket)."""
    return int(max(rate_bps / 8 * 1e-3, 2 * MTU + 1000))


def _shape(ns: str, dev: str, rate_bps: float, delay_s: float) -> None:
    """tbf at rate_bps on dev's egress, with a netem delay under it if delay_s > 0."""
    rate_Bps = rate_bps / 8
    burst = bucket_bytes(rate_bps)
    # The queue holds ~50 ms beyond the bucket, so TCP sees delay before it sees loss.
    limit = int(max(rate_Bps * 0.05, 16 * MTU)) + burst
    tbf = ["tbf", "rate", f"{int(rate_bps)}bit", "burst", str(burst), "limit", str(limit)]
    _run("tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf, ns=ns)
    if delay_s > 0:
        netem = ["netem", "delay", f"{delay_s * 1e6:.0f}us", "limit", "100000"]
        p = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:1",
                "handle",
                "10:",
                *netem,
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if p.returncode:
            raise RuntimeError(
                f"cannot add latency ({p.stderr.strip()}): this kernel lacks sch_netem "
                "(CONFIG_NET_SCH_NETEM); bring the testbed up without --latency"
            )


def up(nodes: int, rate: str, latency: str | None = None) -> Testbed:
    """Create the namespaces, links and shaping; on any failure remove everything and re-raise."""
    if not isinstance(nodes, int) or not 1 <= nodes <= 200:
        raise ValueError(f"nodes must be an int in 1..200, got {nodes!r}")
    rate_bps, latency_s = parse_rate(rate), parse_latency(latency)
    check_prerequisites()
    if namespaces() or os.path.exists(STATE_FILE):
        raise RuntimeError("a testbed is already up; run `schemoe testbed down` first")
    bed = Testbed(nodes, rate_bps, latency_s, tuple(f"{SUBNET}.{n + 1}" for n in range(nodes)))
    try:
        _save(bed)  # first, so `down` knows about a half-built testbed
        _run("ip", "netns", "add", SWITCH)
        _run("ip", "link", "set", "lo", "up", ns=SWITCH)
        _run("ip", "link", "add", "br0", "type", "bridge", ns=SWITCH)
        _run("ip", "link", "set", "br0", "mtu", str(MTU), "up", ns=SWITCH)
        for n in range(nodes):
            ns, port = bed.node_ns(n), f"p{n}"
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "set", "lo", "up", ns=ns)
            _run(
                "ip",
                "link",
                "add",
                IFNAME,
                "netns",
                ns,
                "mtu",
                str(MTU),
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                SWITCH,
                "mtu",
                str(MTU),
            )
            _run("ip", "link", "set", port, "master", "br0", "up", ns=SWITCH)
            _run("ip", "addr", "add", f"{bed.addresses[n]}/24", "dev", IFNAME, ns=ns)
            _run("ip", "link", "set", IFNAME, "up", ns=ns)
            _write_hosts(bed, ns)
            _shape(ns, IFNAME, rate_bps, latency_s / 2)  # uplink: node -> switch
            _shape(SWITCH, port, rate_bps, latency_s / 2)  # downlink: switch -> node
        return bed
    except BaseException:
        down()
        raise


def down() -> list[str]:
    """Remove every testbed namespace and the state file; return what was removed. Idempotent."""
    removed = []
    if shutil.which("ip") is not None and os.geteuid() == 0:
        for ns in namespaces():
            _run("ip", "netns", "del", ns, check=False)  # takes its veths, bridge, qdiscs along
            removed.append(ns)
    for d in glob.glob(os.path.join(ETC, PREFIX + "*")):
        shutil.rmtree(d, ignore_errors=True)
    if os.path.exists(STATE_FILE):
        os.remove(STATE_FILE)
    for d in (ETC, os.path.dirname(STATE_FILE)):
        try:
            os.rmdir(d)  # only if empty: someone else's netns files stay
        except OSError:
            pass
    return removed


def _write_hosts(bed: Testbed, ns: str) -> None:
    # Names for the node addresses, so c10d's reverse lookups answer from files, not a DNS
    # that is unreachable from inside the namespaces (it warns otherwise).
    os.makedirs(os.path.join(ETC, ns), exist_ok=True)
    with open(os.path.join(ETC, ns, "hosts"), "w") as f:
        f.write("127.0.0.1 localhost\n")
        # c10d's store sees IPv4 peers as ::ffff:a.b.c.d, so name both forms.
        names = [(a, bed.node_ns(n)) for n, a in enumerate(bed.addresses)]
        f.writelines(f"{a} {name}\n::ffff:{a} {name}\n" for a, name in names)


def load() -> Testbed:
    """The testbed that is up; RuntimeError if none."""
    try:
        with open(STATE_FILE) as f:
            d = json.load(f)
    except FileNotFoundError:
        raise RuntimeError(
            "no testbed is up: run `schemoe testbed up --nodes N --rate RATE` as root first"
        ) from None
    return Testbed(d["nodes"], d["rate_bps"], d["latency_s"], tuple(d["addresses"]))


def _save(bed: Testbed) -> None:
    os.makedirs(os.path.dirname(STATE_FILE), exist_ok=True)
    with open(STATE_FILE, "w") as f:
        json.dump(asdict(bed), f, indent=1)


def link_bytes(ns: str, dev: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of `dev` inside namespace `ns`, from the kernel's counters."""
    base = f"/sys/class/net/{dev}/statistics"
    out = _run("cat", f"{base}/tx_bytes", f"{base}/rx_bytes", ns=ns).split()
    return int(out[0]), int(out[1])
