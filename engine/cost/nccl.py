"""NCCL's collectives as NCCL prices and chooses them: ring and tree algorithms, the LL,
LL128 and Simple protocols, and NVLink SHARP (NVLS) inside an H100 node.

NCCL picks, per call, the (algorithm, protocol) of least predicted time from its own
cost model (`ncclTopoTuneModel` and `ncclTopoGetAlgoTime` in src/graph/tuning.cc of
github.com/NVIDIA/nccl, read at commit 5067397c2676d5aed50042fc39e5c8ee96eb0027): a
latency per call plus bytes over an algorithm bandwidth. This module is that model with
its published constants (latencies in microseconds below, verbatim) and with the bus
bandwidths of the links measured by nccl-tests (`NcclNet`, each figure cited where a
profile sets it) in place of NCCL's topology search. For a group of n ranks, ppn of them
per node, on nodes = n / ppn nodes:

    ring   latency: base + (steps - inter) * intra_lat + inter * net_lat,
                    steps = 2 (n-1) all-reduce, n-1 all-gather / reduce-scatter,
                    inter = 2 (nodes-1) or nodes-1 (the ring's node crossings)
           time:    latency + frac * bytes / busbw   (frac = 2(n-1)/n or (n-1)/n)
    tree   latency: base + 2 ((ppn-1) * intra_lat + log2(nodes) * net_lat)   (all-reduce)
           time:    latency + 2 * bytes / busbw_tree (a double binary tree: reduce up,
                    broadcast down, each at half the bus bandwidth: NCCL's ratio .5)
    nvls   (one H100 node, all-reduce): 25 us + 2(n-1)/n * bytes / nvls_busbw

busbw: inside one node the NVLink ring's bus bandwidth; across nodes the node's NICs
(ppn NICs' worth, one per GPU on rail-optimised nodes) capped by NVLink. Protocols scale
it as tuning.cc does: LL half the bandwidth (capped at NCCL's `llMaxBws`), LL128 120/128,
Simple all of it; trees 0.92 of it (1/3.8 with LL). all-to-all and collective-permute
are point-to-point sends: each rank's slice to each peer at the bandwidth of one link
(one NIC across nodes: "Alltoall cannot aggregate the bandwidth of multiple NICs",
S. Jeaugey, github.com/NVIDIA/nccl-tests/issues/267), one Simple-protocol latency.
"""
from __future__ import annotations

import dataclasses
import math

LL, LL128, SIMPLE = 0, 1, 2
PROTOCOLS = ("LL", "LL128", "Simple")

# tuning.cc `baseLatencies` (us), [protocol] for Tree and Ring
BASE_LAT = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
# tuning.cc `hwLatencies` (us) per step: NVLink (inside a node) and NET (across nodes)
NVLINK_LAT = {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "nvls": (0.0, 0.0, 25.0)}
NET_LAT = {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0)}
# tuning.cc `getNetOverhead` (us, x86 Intel hosts; x3 for Simple): the floor of an
# intra-node step of a ring that crosses nodes
NET_OVERHEAD = 1.0
# tuning.cc `llMaxBws` (GB/s) by architecture, for 1 node / 2 nodes / more
LL_MAX_BW = {"ampere": (87.7, 22.5, 19.0), "hopper": (141.0, 45.0, 35.0)}
# tuning.cc `treeCorrectionFactor`[protocol][log2(bytes / 64)], 64 B to 256 MiB
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0,
     1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9,
     1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9,
     .9, .9))
# tuning.cc `ncclTopoGetAlgoTime`: a multi-node Simple ring all-reduce's latency x1.4 on
# sm80+ once each rank's share of a channel reaches 64 B ("plateau effect of ring"),
# taken at NCCL's 16-channel default for these nodes
RING_PLATEAU, CHANNELS = 1.4, 16


@dataclasses.dataclass(frozen=True)
class NcclNet:
    """The bus bandwidths (bytes/s) nccl-tests measures on a GPU platform: `nvlink` a
    ring's inside one node, `nic` one NIC's, `nvls` an NVLink SHARP all-reduce's inside
    one node (0: none); `arch` indexes NCCL's per-architecture constants."""

    nvlink: float
    nic: float
    arch: str
    nvls: float = 0.0


def _ll_cap(net: NcclNet, nodes: int) -> float:
    return LL_MAX_BW[net.arch][0 if nodes == 1 else 1 if nodes == 2 else 2] * 1e9


def _busbw(net: NcclNet, ppn: int, nodes: int) -> float:
    return net.nvlink if nodes == 1 else min(net.nvlink, ppn * net.nic)


def _ring(kind: str, n: int, ppn: int, nbytes: float, net: NcclNet, p: int) -> float:
    nodes = n // ppn
    steps = 2 * (n - 1) if kind == "all-reduce" else n - 1
    inter = 0 if nodes == 1 else (2 if kind == "all-reduce" else 1) * (nodes - 1)
    intra = NVLINK_LAT["ring"][p]
    if nodes > 1:
        intra = max(intra, NET_OVERHEAD * (3 if p == SIMPLE else 1))
    lat = BASE_LAT["ring"][p] + (steps - inter) * intra + inter * NET_LAT["ring"][p]
    if kind == "all-reduce" and p == SIMPLE and nodes > 1 and nbytes / (CHANNELS * n) >= 64:
        lat *= RING_PLATEAU
    bw = _busbw(net, ppn, nodes)
    bw = (min(bw * .5, _ll_cap(net, nodes)), bw * 120 / 128, bw)[p]
    frac = (2 if kind == "all-reduce" else 1) * (n - 1) / n
    return lat * 1e-6 + frac * nbytes / bw


def _tree(n: int, ppn: int, nbytes: float, net: NcclNet, p: int) -> float:
    nodes = n // ppn
    intra = NVLINK_LAT["tree"][p]
    net_lat = NET_LAT["tree"][p]
    lat = BASE_LAT["tree"][p] + 2 * ((ppn - 1) * intra + int(math.log2(nodes)) * net_lat)
    bw = _busbw(net, ppn, nodes) * .92
    if p == LL:
        bw = min(bw / 3.8, _ll_cap(net, nodes))
    elif p == LL128:
        bw *= 7 / 9 if nodes == 1 else 120 / 128
    log_size = int(math.log2(max(nbytes, 1) / 64)) if nbytes >= 64 else -1
    if 0 <= log_size < 23:
        bw *= TREE_CORRECTION[p][log_size]
    return lat * 1e-6 + 2 * nbytes / bw


def choices(kind: str, n: int, ppn: int, nbytes: float, net: NcclNet) -> dict:
    """{(algorithm, protocol): seconds} of every way NCCL may run one `kind` over n
    ranks, ppn per node, of `nbytes` (a rank's whole buffer: an all-reduce's input, an
    all-gather's output, a reduce-scatter's input, an all-to-all's send buffer)."""
    ppn = max(1, min(ppn, n))
    nodes = n // ppn
    if kind in ("all-to-all", "collective-permute"):
        bw = net.nvlink if nodes == 1 else net.nic
        frac = (n - 1) / n if kind == "all-to-all" else 1.0
        lat = BASE_LAT["ring"][SIMPLE] + (NVLINK_LAT if nodes == 1 else NET_LAT)["ring"][SIMPLE]
        return {("p2p", "Simple"): lat * 1e-6 + frac * nbytes / bw}
    out = {("ring", PROTOCOLS[p]): _ring(kind, n, ppn, nbytes, net, p) for p in (LL, LL128, SIMPLE)}
    if kind == "all-reduce":
        out.update({("tree", PROTOCOLS[p]): _tree(n, ppn, nbytes, net, p)
                    for p in (LL, LL128, SIMPLE)})
        if nodes == 1 and net.nvls and n > 2:
            out[("nvls", "Simple")] = (NVLINK_LAT["nvls"][SIMPLE] * 1e-6
                                       + 2 * (n - 1) / n * nbytes / net.nvls)
    return out


def seconds(kind: str, n: int, ppn: int, nbytes: float, net: NcclNet) -> float:
    """Seconds of one `kind` as NCCL runs it: its fastest (algorithm, protocol)."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return min(choices(kind, n, ppn, nbytes, net).values())


def choice(kind: str, n: int, ppn: int, nbytes: float, net: NcclNet) -> tuple[str, str]:
    """The (algorithm, protocol) NCCL's model picks for the call."""
    c = choices(kind, n, ppn, nbytes, net)
    return min(c, key=c.get)
