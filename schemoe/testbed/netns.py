"""Network namespaces, veths, bridges and tc shaping: the emulated cluster's wiring.

Without an intra-node rate, one namespace per node and the node's ranks share it:

    smoe-n0 [lo, eth0 10.77.0.1/24] ── veth ──┐
    smoe-n1 [lo, eth0 10.77.0.2/24] ── veth ──┼── br0 in smoe-sw (the "switch")
    ...                                        ┘

Each node link is shaped in both directions with `tbf` at `rate` (node egress on eth0, switch egress
on the node's port), so a node sends and receives at most `rate` each way, like a full-duplex NIC,
and several senders into one node share its downlink. `latency` adds a `netem` delay of half the
one-way latency on each side (node to node = `latency`); kernels without sch_netem refuse it with a
clear error. Ranks of one node talk to each other through the node's own address, which the kernel
routes over that namespace's loopback: intra-node traffic never touches eth0 and is never shaped.

With an intra-node rate Q (`intra_rate`), every rank has a namespace of its own and the node's
namespace holds only a bridge and the node's uplink:

    smoe-n0r0 [eth0 10.77.0.1/16] ─ Q ─ r0 ┐
    smoe-n0r1 [eth0 10.77.0.2/16] ─ Q ─ r1 ┼ br0 in smoe-n0 ─ uplink ─ R ─ p0 ┐ br0 in smoe-sw
    smoe-n1r0 ...                                                          ┘

Intra-node pairs cross two rank links (sender's egress, receiver's ingress, each shaped at Q);
inter-node pairs cross the sender's rank link, its node's uplink (R, shared by the node's ranks
as a NIC is), the other node's downlink and the receiver's rank link. `intra_link` says what the
rank link shapes: "shared" (every byte, at Q: the rank's one PCIe link carries its NIC traffic
too), or "separate" (only bytes to or from the rank's own node, at Q: intra-node pairs have their
own path, as over NVLink, and inter-node pairs are limited by the uplink alone).

Nothing is created outside these namespaces: the veth ends are created directly inside them and
the 10.77.0.0/16 addresses exist only there. What exists is recorded in STATE_FILE, plus a hosts
file per namespace under /etc/netns/; `down` removes every `smoe-*` namespace (with everything in
it) and those files whether or not the state file survived.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass

from ..dist.links import INTRA_LINKS, STATE_FILE  # where ranks read it back (Links.of_run)
from .units import parse_latency, parse_rate  # re-exported: the CLI and tools use them here

__all__ = [
    "IFNAME",
    "INTRA_LINKS",
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
    "queue_bytes",
    "up",
]

PREFIX = "smoe-"
SWITCH = PREFIX + "sw"
IFNAME = "eth0"  # the interface gloo binds inside a rank's namespace (GLOO_SOCKET_IFNAME)
SUBNET = "10.77"
# Near loopback's MTU: far fewer packets per byte, so the two CPU cores that also run the ranks
# spend little on softirq and the link, not the CPU, is the limit (9000 gave ~0.8 of the rate).
MTU = 65000
ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts ETC/NS/hosts over /etc/hosts


@dataclass(frozen=True)
class Testbed:
    """What `up` created; serialised to STATE_FILE."""

    nodes: int
    rate_bps: float  # bits per second, each direction of each node link (uplink)
    latency_s: float  # one-way node-to-node latency added by netem (0 = none)
    # One address per namespace that runs ranks: per node (loopback mode) or per rank, node-major.
    addresses: tuple[str, ...]
    intra_rate_bps: float = 0.0  # each direction of each rank link; 0 = ranks share the node's lo
    ranks_per_node: int = 0  # fixed by `up` when intra_rate_bps > 0, else chosen by each run
    intra_link: str = "shared"  # what a rank link shapes (see the module docstring)

    @property
    def per_rank(self) -> bool:
        return self.intra_rate_bps > 0

    def node_ns(self, n: int) -> str:
        return f"{PREFIX}n{n}"

    def rank_ns(self, node: int, local: int) -> str:
        """The namespace local rank `local` of `node` runs in."""
        return f"{PREFIX}n{node}r{local}" if self.per_rank else self.node_ns(node)

    def host_ns(self) -> list[str]:
        """The namespaces that own `addresses`, in the same order."""
        if not self.per_rank:
            return [self.node_ns(n) for n in range(self.nodes)]
        k = self.ranks_per_node
        return [self.rank_ns(n, j) for n in range(self.nodes) for j in range(k)]

    @property
    def master_addr(self) -> str:
        return self.addresses[0]

    def describe(self) -> str:
        lat = f", +{self.latency_s * 1e3:g} ms one-way" if self.latency_s else ""
        up = f"{self.rate_bps / 1e9:g} Gbit/s per node uplink each way{lat}"
        if not self.per_rank:
            return f"testbed: {self.nodes} nodes, {up}; intra-node pairs on the node's loopback"
        what = "all its bytes" if self.intra_link == "shared" else "only intra-node bytes"
        return (
            f"testbed: {self.nodes} nodes x {self.ranks_per_node} rank namespaces, {up}; "
            f"{self.intra_rate_bps / 1e9:g} Gbit/s per rank link each way, shaping {what} "
            f"(intra_link={self.intra_link})"
        )


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


def run_cmd(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Run `cmd` (inside namespace `ns`); RuntimeError with its stderr if it fails and `check`."""
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    p = subprocess.run(full, capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode:
        raise RuntimeError(f"`{' '.join(full)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


def namespaces() -> list[str]:
    """Every testbed namespace that exists now."""
    out = run_cmd("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(PREFIX))


def bucket_bytes(rate_bps: float) -> int:
    """tbf's bucket: what may leave at line speed after an idle spell. 1 ms of traffic, but at
    least two full frames (tbf drops a frame bigger than its bucket)."""
    return int(max(rate_bps / 8 * 1e-3, 2 * MTU + 1000))


def queue_bytes(rate_bps: float) -> int:
    """What a shaped link may hold: ~50 ms beyond the bucket, so TCP sees delay before it sees
    loss, and the ACKs of the other direction never wait behind seconds of data."""
    return int(max(rate_bps / 8 * 0.05, 16 * MTU)) + bucket_bytes(rate_bps)


def _tbf(rate_bps: float) -> list[str]:
    burst, limit = str(bucket_bytes(rate_bps)), str(queue_bytes(rate_bps))
    return ["tbf", "rate", f"{int(rate_bps)}bit", "burst", burst, "limit", limit]


def shape(
    ns: str, dev: str, rate_bps: float, delay_s: float = 0.0, only: tuple[str, str] | None = None
) -> None:
    """tbf at rate_bps on dev's egress, with a netem delay under it if delay_s > 0.

    `only=("dst" | "src", "a.b.c.d/n")` shapes only IPv4 packets to / from that prefix: an htb
    class at rate_bps, with a byte fifo as deep as tbf's queue, takes them (u32 filter) and
    everything else (other IPv4, ARP) leaves unshaped through htb's direct queue.
    """
    assert not (only and delay_s), "a delay applies to whole links only"
    tc = ("tc", "qdisc", "add", "dev", dev)
    if only is None:
        run_cmd(*tc, "root", "handle", "1:", *_tbf(rate_bps), ns=ns)
    else:
        run_cmd(*tc, "root", "handle", "1:", "htb", ns=ns)
        rate, burst = f"{int(rate_bps)}bit", str(bucket_bytes(rate_bps))
        cls = ("rate", rate, "ceil", rate, "burst", burst, "cburst", burst, "quantum", str(2 * MTU))
        run_cmd(
            "tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", *cls, ns=ns
        )
        match = ("u32", "match", "ip", only[0], only[1], "flowid", "1:1")
        run_cmd("tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", *match, ns=ns)
        # The class's own queue, bounded like tbf's (htb's default holds txqueuelen frames,
        # seconds at these rates: a bidirectional exchange then took twice the one-way time).
        run_cmd(
            *tc,
            "parent",
            "1:1",
            "handle",
            "10:",
            "bfifo",
            "limit",
            str(queue_bytes(rate_bps)),
            ns=ns,
        )
    if delay_s > 0:
        netem = ("netem", "delay", f"{delay_s * 1e6:.0f}us", "limit", "100000")
        p = run_cmd(*tc, "parent", "1:1", "handle", "10:", *netem, ns=ns, check=False)
        if p.returncode:
            raise RuntimeError(
                f"cannot add latency ({p.stderr.strip()}): this kernel lacks sch_netem "
                "(CONFIG_NET_SCH_NETEM); bring the testbed up without --latency"
            )


def add_bridge(ns: str) -> None:
    """A new namespace `ns` with lo up and an up bridge br0."""
    run_cmd("ip", "netns", "add", ns)
    run_cmd("ip", "link", "set", "lo", "up", ns=ns)
    run_cmd("ip", "link", "add", "br0", "type", "bridge", ns=ns)
    run_cmd("ip", "link", "set", "br0", "mtu", str(MTU), "up", ns=ns)


def add_veth(ns: str, dev: str, bridge_ns: str, port: str) -> None:
    """A veth from `dev` in `ns` to `port`, enslaved to br0 of `bridge_ns`; both ends up."""
    mtu = ("mtu", str(MTU))
    link = ("ip", "link", "add", dev, "netns", ns, *mtu, "type", "veth", "peer", "name", port)
    run_cmd(*link, "netns", bridge_ns, *mtu)
    run_cmd("ip", "link", "set", port, "master", "br0", "up", ns=bridge_ns)
    run_cmd("ip", "link", "set", dev, "up", ns=ns)


def up(
    nodes: int,
    rate: str,
    latency: str | None = None,
    intra_rate: str | None = None,
    ranks_per_node: int | None = None,
    intra_link: str = "shared",
) -> Testbed:
    """Create the namespaces, links and shaping; on any failure remove everything and re-raise.

    Without `intra_rate` the ranks of a node share its namespace (any ranks_per_node per run);
    with it, `ranks_per_node` rank namespaces per node are created, each linked to its node's
    bridge at `intra_rate`.
    """
    if not isinstance(nodes, int) or not 1 <= nodes <= 200:
        raise ValueError(f"nodes must be an int in 1..200, got {nodes!r}")
    rate_bps, latency_s = parse_rate(rate), parse_latency(latency)
    intra_bps = 0.0
    if intra_rate is not None:
        intra_bps = parse_rate(intra_rate, "intra-rate")
        if nodes < 2:
            raise ValueError(
                f"intra-rate {intra_rate!r} with {nodes} node: the rank links only differ from "
                "the uplinks with 2 or more nodes; give --nodes >= 2 or drop --intra-rate"
            )
        if not isinstance(ranks_per_node, int) or not 1 <= ranks_per_node <= 250:
            raise ValueError(
                f"intra-rate {intra_rate!r} gives each rank its own namespace, so `up` needs "
                f"ranks per node (an int in 1..250), got {ranks_per_node!r}"
            )
        if intra_link not in INTRA_LINKS:
            raise ValueError(f"intra-link {intra_link!r}: expected one of {', '.join(INTRA_LINKS)}")
    elif ranks_per_node is not None or intra_link != "shared":
        raise ValueError(
            f"ranks per node ({ranks_per_node!r}) and intra-link ({intra_link!r}) are set by "
            "`up` only with --intra-rate; without it each run chooses its ranks per node"
        )
    check_prerequisites()
    if namespaces() or os.path.exists(STATE_FILE):
        raise RuntimeError("a testbed is already up; run `schemoe testbed down` first")
    if intra_bps:
        k = ranks_per_node
        addrs = tuple(f"{SUBNET}.{n}.{j + 1}" for n in range(nodes) for j in range(k))
        bed = Testbed(nodes, rate_bps, latency_s, addrs, intra_bps, k, intra_link)
    else:
        addrs = tuple(f"{SUBNET}.0.{n + 1}" for n in range(nodes))
        bed = Testbed(nodes, rate_bps, latency_s, addrs)
    try:
        _save(bed)  # first, so `down` knows about a half-built testbed
        add_bridge(SWITCH)
        for n in range(nodes):
            if bed.per_rank:
                _wire_node_of_ranks(bed, n)
            else:
                _wire_node(bed, n)
        for ns in bed.host_ns():
            _write_hosts(bed, ns)
        return bed
    except BaseException:
        down()
        raise


def _wire_node(bed: Testbed, n: int) -> None:
    ns = bed.node_ns(n)
    run_cmd("ip", "netns", "add", ns)
    run_cmd("ip", "link", "set", "lo", "up", ns=ns)
    add_veth(ns, IFNAME, SWITCH, f"p{n}")
    run_cmd("ip", "addr", "add", f"{bed.addresses[n]}/24", "dev", IFNAME, ns=ns)
    shape(ns, IFNAME, bed.rate_bps, bed.latency_s / 2)  # uplink: node -> switch
    shape(SWITCH, f"p{n}", bed.rate_bps, bed.latency_s / 2)  # downlink: switch -> node


def _wire_node_of_ranks(bed: Testbed, n: int) -> None:
    node = bed.node_ns(n)
    add_bridge(node)
    add_veth(node, "uplink", SWITCH, f"p{n}")
    run_cmd("ip", "link", "set", "uplink", "master", "br0", ns=node)
    shape(node, "uplink", bed.rate_bps, bed.latency_s / 2)  # uplink: node -> switch
    shape(SWITCH, f"p{n}", bed.rate_bps, bed.latency_s / 2)  # downlink: switch -> node
    local = f"{SUBNET}.{n}.0/24"  # this node's ranks (and nothing else)
    for j in range(bed.ranks_per_node):
        ns = bed.rank_ns(n, j)
        run_cmd("ip", "netns", "add", ns)
        run_cmd("ip", "link", "set", "lo", "up", ns=ns)
        add_veth(ns, IFNAME, node, f"r{j}")
        addr = bed.addresses[n * bed.ranks_per_node + j]
        run_cmd("ip", "addr", "add", f"{addr}/16", "dev", IFNAME, ns=ns)
        shared = bed.intra_link == "shared"
        shape(ns, IFNAME, bed.intra_rate_bps, only=None if shared else ("dst", local))
        shape(node, f"r{j}", bed.intra_rate_bps, only=None if shared else ("src", local))


def down() -> list[str]:
    """Remove every testbed namespace and the state file; return what was removed. Idempotent."""
    removed = []
    if shutil.which("ip") is not None and os.geteuid() == 0:
        for ns in namespaces():
            run_cmd("ip", "netns", "del", ns, check=False)  # takes its veths, bridge, qdiscs
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
    # Names for the testbed's addresses, so c10d's reverse lookups answer from files, not a DNS
    # that is unreachable from inside the namespaces (it warns otherwise).
    os.makedirs(os.path.join(ETC, ns), exist_ok=True)
    with open(os.path.join(ETC, ns, "hosts"), "w") as f:
        f.write("127.0.0.1 localhost\n")
        # c10d's store sees IPv4 peers as ::ffff:a.b.c.d, so name both forms.
        names = zip(bed.addresses, bed.host_ns())
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
    return Testbed(**{**d, "addresses": tuple(d["addresses"])})


def _save(bed: Testbed) -> None:
    os.makedirs(os.path.dirname(STATE_FILE), exist_ok=True)
    with open(STATE_FILE, "w") as f:
        json.dump(asdict(bed), f, indent=1)


def link_bytes(ns: str, dev: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of `dev` inside namespace `ns`, from the kernel's counters."""
    base = f"/sys/class/net/{dev}/statistics"
    out = run_cmd("cat", f"{base}/tx_bytes", f"{base}/rx_bytes", ns=ns).stdout.split()
    return int(out[0]), int(out[1])
