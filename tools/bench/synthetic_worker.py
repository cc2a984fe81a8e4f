"""Synthetic EP worker (``--variants synthetic``): real all-to-alls plus real matmuls, no model.

Test and calibration infrastructure for the harness itself, never a stand-in for a model
variant: it lets the aggregation, the table and the link-rate bisection be exercised with a load
whose communication share responds to the link rate the way an expert-parallel MoE step does.

Per layer, each rank routes ``T x K`` rows of ``H`` fp32 values evenly to all ranks through the
project's counted all-to-all (``moe_variants.common.comm.all_to_all``, the same wrapper and
counters the model's dispatchers use), applies an expert MLP ``H -> F -> H`` (GELU) to the rows
it received, sends them back, sums the K copies and adds the residual. Backward runs the mirrored
all-to-alls through autograd; an SGD step updates the weights.

Shape legend: ``T`` tokens per rank, ``K`` top-k, ``H`` hidden, ``F`` expert FFN, ``N`` rows sent
(= T x K), ``M`` rows received.
"""

from __future__ import annotations

import sys
import time

from .schema import RankResult, SyntheticOptions, peak_rss_mb
from .worker_env import init_gloo_from_env, read_spec_from_argv
from megatron.common import collectives

__all__ = ["even_splits", "main"]


def even_splits(num_rows: int, num_ranks: int) -> list[int]:
    """Split ``num_rows`` rows over ``num_ranks`` destinations as evenly as possible."""
    base, rem = divmod(num_rows, num_ranks)
    return [base + (1 if r < rem else 0) for r in range(num_ranks)]


def main(argv=None) -> int:
    spec = read_spec_from_argv(argv)
    opts = SyntheticOptions(**spec.options)
    group = init_gloo_from_env(spec.num_threads)

    import torch
    import torch.distributed as dist

    from moe_variants.common.comm import CommCounters, TimelineRecorder, all_to_all

    from .overlap import comm_spans

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(spec.seed + 7919 * rank)
    T, K, H, F = opts.tokens, opts.topk, opts.hidden, opts.ffn
    layers = [
        (torch.nn.Parameter(torch.randn(H, F) * H**-0.5), torch.nn.Parameter(torch.randn(F, H) * F**-0.5))
        for _ in range(opts.layers)
    ]
    params = [p for pair in layers for p in pair]
    optimizer = torch.optim.SGD(params, lr=1e-3)
    counters = CommCounters()
    input_splits = even_splits(T * K, world)  # rows to each destination, same on every rank
    output_splits = [input_splits[rank]] * world  # every rank sends us the same share

    def forward(x_TH):
        h_TH = x_TH
        for w1_HF, w2_FH in layers:
            rows_NH = h_TH.repeat_interleave(K, dim=0)
            recv_MH = all_to_all(
                group, rows_NH, output_splits, input_splits, counters=counters, kind="dispatch"
            )
            out_MH = torch.nn.functional.gelu(recv_MH @ w1_HF) @ w2_FH
            back_NH = all_to_all(
                group, out_MH, input_splits, output_splits, counters=counters, kind="combine"
            )
            h_TH = h_TH + back_NH.view(T, K, H).sum(dim=1)
        return h_TH.pow(2).mean()

    rec = {k: [] for k in ("step", "fwd", "bwd", "a2a", "exposed", "disp", "comb", "bwdbytes", "loss", "spans")}
    for step in range(spec.warmup + spec.steps):
        gen = torch.Generator().manual_seed(spec.seed * 1000003 + step * 31 + rank)
        x_TH = torch.randn(T, H, generator=gen)
        x_TH.requires_grad_(True)  # as if from an embedding: the first dispatch has a backward too
        collectives.barrier()  # steps start together, so skew from the previous step is not booked as comm
        counters.reset()
        counters.timeline = TimelineRecorder()  # each collective's span: the transfer/skew split
        t0 = time.perf_counter()
        loss = forward(x_TH)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if step < spec.warmup:
            continue
        c = counters.as_dict()
        rec["step"].append(t3 - t0)
        rec["fwd"].append(t1 - t0)
        rec["bwd"].append(t2 - t1)
        rec["a2a"].append(c["time_fwd_s"] + c["time_bwd_s"])
        rec["exposed"].append(c["exposed_fwd_s"] + c["exposed_bwd_s"])
        rec["disp"].append(int(c["bytes_dispatch"]))
        rec["comb"].append(int(c["bytes_combine"]))
        rec["bwdbytes"].append(int(c["bytes_backward"]))
        rec["loss"].append(float(loss.detach()))
        rec["spans"].append(comm_spans(counters.timeline))

    result = RankResult(
        rank=rank,
        world_size=world,
        variant=spec.variant,
        step_time_s=rec["step"],
        fwd_time_s=rec["fwd"],
        bwd_time_s=rec["bwd"],
        a2a_time_s=rec["a2a"],
        exposed_comm_s=rec["exposed"],
        a2a_bytes_dispatch=rec["disp"],
        a2a_bytes_combine=rec["comb"],
        a2a_bytes_backward=rec["bwdbytes"],
        tokens=[T] * spec.steps,
        peak_rss_mb=peak_rss_mb(),
        extra={"loss": rec["loss"], "options": spec.options, "a2a_spans": rec["spans"]},
    )
    collectives.barrier()
    dist.destroy_process_group()
    result.write(spec.result_path(rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
