"""Fitting alpha-beta constants: exact recovery from noise-free synthetic data (rel 1e-6), recovery
within the noise from noisy data, a gloo-like switched network, and the CSV / nccl-tests readers."""

import json

import numpy as np
import pytest

from netsim.collectives import DGX_H100_INTER, DGX_H100_INTRA, GB, AlphaBeta, Collective
from netsim.fit import (
    Measurement,
    fit_constants,
    read_csv,
    read_nccl_tests,
    read_sidecar_bandwidth,
    synthetic_measurements,
)


def _close(a: AlphaBeta, b: AlphaBeta, rel):
    for f in ("alpha0", "alpha_round", "alpha_dest", "utilization"):
        assert getattr(a, f) == pytest.approx(getattr(b, f), rel=rel), f


@pytest.mark.parametrize("topo,ranks", [("switch", (4, 8, 16, 32)), ("scale-up", (4, 8, 16, 32)),
                                        ("torus3d", (8, 16, 32, 64)), ("fullmesh3d", (8, 16, 32, 64))])  # fmt: skip
def test_recovers_constants_exactly(topo, ranks):
    """Noise-free data made by the model (fastest algorithm per row) gives back its constants."""
    truth = AlphaBeta(3.1e-6, 1.7e-6, 0.45e-6, 0.62)
    rows = synthetic_measurements(truth, 200 * GB, topo, ranks)
    res = fit_constants(rows, topo, 200 * GB)
    _close(res.constants, truth, 1e-6)
    assert res.mean_relative_error < 1e-9 and res.identifiable


def test_recovers_constants_with_noise():
    """3% log-normal noise: the constants come back within 15% and the error is about the noise."""
    rows = synthetic_measurements(DGX_H100_INTER, 50 * GB, "switch", noise=0.03, seed=3)
    res = fit_constants(rows, "switch", 50 * GB)
    _close(res.constants, DGX_H100_INTER, 0.15)
    assert 0.01 < res.mean_relative_error < 0.04


def test_pinned_algorithm_and_unknown_bandwidth():
    truth = DGX_H100_INTRA
    rows = synthetic_measurements(truth, 450 * GB, "switch", ranks=(4, 8))
    free = fit_constants(rows, "switch", None)  # bandwidth unknown: fit seconds per byte
    assert free.beta_s_per_byte == pytest.approx(1 / (truth.utilization * 450 * GB), rel=1e-6)
    pinned = fit_constants(rows, "switch", 450 * GB, {"all_to_all": "spread_out", "all_reduce": "ring"})
    assert all(a.split(":")[1] in ("spread_out", "ring") for a in pinned.algorithms)
    assert pinned.mean_relative_error > free.mean_relative_error  # the data were not made by these
    with pytest.raises(ValueError, match="not available"):
        fit_constants(rows, "switch", 450 * GB, {"all_to_all": "swing"})
    with pytest.raises(ValueError, match="one network tier"):
        fit_constants(rows, "scale-out", 450 * GB)


def test_gloo_like_switched_link():
    """A switched link with a per-message latency and per-rank bandwidth, the way gloo runs over a
    shaped veth: all-to-all sends every peer concurrently (one latency, p-1 messages), all-reduce is
    a ring (2(p-1) latency steps). 2 and 4 ranks, 4 KiB..64 MiB, 5% noise: the fit's error must stay
    well under the 15% target."""
    rng = np.random.default_rng(7)
    lat, per_msg, bw, overhead = 120e-6, 15e-6, 1e9 / 8 * 0.95, 40e-6
    rows = []
    for p in (2, 4):
        for k in range(12, 27):
            m = 2.0**k
            a2a = overhead + lat + (p - 1) * per_msg + (p - 1) / p * m / bw
            ar = overhead + 2 * (p - 1) * (lat + per_msg) + 2 * (p - 1) / p * m / bw
            rows.append(Measurement(Collective.ALL_TO_ALL, p, m, a2a * np.exp(rng.normal(0, 0.05))))
            rows.append(Measurement(Collective.ALL_REDUCE, p, m, ar * np.exp(rng.normal(0, 0.05))))
    pinned = fit_constants(rows, "switch", 1e9 / 8, {"all_to_all": "p2p", "all_reduce": "ring"})
    assert pinned.mean_relative_error < 0.06  # about the noise
    assert pinned.constants.utilization == pytest.approx(0.95, rel=0.05)
    auto = fit_constants(rows, "switch", 1e9 / 8)  # may explain rows with other algorithms
    assert auto.mean_relative_error <= pinned.mean_relative_error * 1.001  # same optimum up to solver tolerance


def test_read_csv_and_sidecar(tmp_path):
    f = tmp_path / "cal.csv"
    f.write_text("op,ranks,bytes,seconds,min_s\nall_to_all,2,4096,0.001,0.0009\nall_reduce,4,65536,0.01,0.009\n")
    rows = read_csv(f)
    assert rows == [Measurement(Collective.ALL_TO_ALL, 2, 4096.0, 0.001), Measurement(Collective.ALL_REDUCE, 4, 65536.0, 0.01)]
    assert read_sidecar_bandwidth(f) is None
    (tmp_path / "cal.json").write_text(json.dumps({"link": {"gbit": 2.0, "latency_ms": 0.5}}))
    assert read_sidecar_bandwidth(f) == pytest.approx(2e9 / 8)
    bad = tmp_path / "bad.csv"
    bad.write_text("op,ranks,bytes\nall_to_all,2,4096\n")
    with pytest.raises(ValueError, match="missing CSV column"):
        read_csv(bad)
    bad.write_text("op,ranks,bytes,seconds\nbroadcast,2,4096,0.1\n")
    with pytest.raises(ValueError, match=r"bad.csv:2.*unknown op"):
        read_csv(bad)
    bad.write_text("op,ranks,bytes,seconds\nall_to_all,1,4096,0.1\n")
    with pytest.raises(ValueError, match="ranks >= 2"):
        read_csv(bad)
    with pytest.raises(ValueError, match="no such CSV"):
        read_csv(tmp_path / "nope.csv")


NCCL_LOG = """\
# nThread 1 nGpus 1 minBytes 1024 maxBytes 1048576 step: 4(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  12345 on   node-a device  0 [0x18] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  12346 on   node-a device  1 [0x2a] NVIDIA H100 80GB HBM3
#  Rank  2 Group  0 Pid  12347 on   node-a device  2 [0x3a] NVIDIA H100 80GB HBM3
#  Rank  3 Group  0 Pid  12348 on   node-a device  3 [0x5d] NVIDIA H100 80GB HBM3
#
# Collective test starting: alltoall_perf
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
        1024            64     float    none      -1    10.50    0.10    0.07      0    10.40    0.10    0.07    N/A
        4096           256     float    none      -1    11.00    0.37    0.28      0    11.10    0.37    0.28    N/A
       16384          1024     float    none      -1    12.25    1.34    1.00      0    12.20    1.34    1.01    N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.45
"""


def test_read_nccl_tests(tmp_path):
    f = tmp_path / "a2a.txt"
    f.write_text(NCCL_LOG)
    rows = read_nccl_tests(f)
    assert [(m.op, m.ranks, m.bytes) for m in rows] == [(Collective.ALL_TO_ALL, 4, b) for b in (1024.0, 4096.0, 16384.0)]
    assert [m.seconds for m in rows] == pytest.approx([10.5e-6, 11.0e-6, 12.25e-6])
    # a log without banner or rank lines needs --op / --ranks
    bare = tmp_path / "bare.txt"
    bare.write_text("\n".join(l for l in NCCL_LOG.splitlines() if "Rank" not in l and "starting" not in l))
    with pytest.raises(ValueError, match="--op"):
        read_nccl_tests(bare)
    with pytest.raises(ValueError, match="--ranks"):
        read_nccl_tests(bare, op="all_reduce")
    assert read_nccl_tests(bare, op="all_reduce", ranks=8)[0].ranks == 8


def test_token_bucket_burst_is_recovered():
    """A shaped link lets the first `burst` bytes of a call through before its rate applies (tc
    tbf); data made that way are fitted exactly once the burst is searched for, and badly without."""
    truth = AlphaBeta(50e-6, 30e-6, 80e-6, 0.95)
    bw, burst = 125e6, 65536.0
    rows = []
    for p in (2, 4):
        for k in range(12, 27):
            for op, name in ((Collective.ALL_TO_ALL, "p2p"), (Collective.ALL_REDUCE, "ring")):
                m = 2.0**k
                wire = (p - 1) / p * m if name == "p2p" else 2 * (p - 1) / p * m
                r, d = (1, p - 1) if name == "p2p" else (2 * (p - 1), 2 * (p - 1))
                t = truth.alpha0 + r * truth.alpha_round + d * truth.alpha_dest + max(0, wire - burst) / (0.95 * bw)
                rows.append(Measurement(op, p, m, t))
    pin = {"all_to_all": "p2p", "all_reduce": "ring"}
    plain = fit_constants(rows, "switch", bw, pin)
    auto = fit_constants(rows, "switch", bw, pin, burst="auto")
    assert auto.burst_bytes == burst and auto.mean_relative_error < 1e-6
    assert auto.constants.utilization == pytest.approx(0.95, rel=1e-6)
    assert plain.mean_relative_error > 0.05
    with pytest.raises(ValueError, match="burst"):
        fit_constants(rows, "switch", bw, pin, burst=-1.0)


def test_sidecar_statistics_and_per_op(tmp_path):
    from netsim.fit import fit_per_op, read_bench_sidecar

    f = tmp_path / "cal.csv"
    f.write_text("op,ranks,bytes,seconds\nall_to_all,2,4096,0.002\n")
    rows = [{"op": "all_to_all", "ranks": 2, "bytes": 4096, "seconds": 0.002, "min_s": 0.001, "mean_s": 0.003}]
    (tmp_path / "cal.json").write_text(json.dumps({"link": {"gbit": 1}, "rows": rows}))
    assert read_bench_sidecar(f, "median")[0].seconds == 0.002
    assert read_bench_sidecar(f, "min")[0].seconds == 0.001
    assert read_bench_sidecar(f, "mean")[0].seconds == 0.003
    with pytest.raises(ValueError, match="--statistic"):
        read_bench_sidecar(f, "p99")
    data = synthetic_measurements(DGX_H100_INTRA, 450 * GB, "switch")
    fits, err = fit_per_op(data, "switch", 450 * GB)
    assert set(fits) == {"all_to_all", "all_reduce"} and err < 1e-9  # each op alone still identifies its constants
