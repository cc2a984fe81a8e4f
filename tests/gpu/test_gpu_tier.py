"""The GPU tier (``scripts/gpu_check.sh``, or ``pytest -m gpu tests/gpu``): what CPU CI cannot show.

Each check asserts what must hold on any GPU (the run completes, the loss falls, the overlapped
FarSkip forward is bit-identical to the simple one and its gradients agree within a stated
tolerance, deferred weight gradients run inside all-to-all windows, CUDA-event timing books non-zero
times, converted models match transformers, served tokens equal the offline forward) and reports
its figures in the tier's table; timings are reported, never asserted. Each check's docstring says
what it asserts and with which tolerance. Process groups are NCCL, in spawned processes (``run_distributed``) or
under torchrun. Skipped on machines without a CUDA GPU.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch

from tests.gpu.nccl import NCCL_DEBUG_ENV, shared_gpu_refusal
from tests.helpers import requires_gpu
from tools.spawn import run_distributed

pytestmark = [pytest.mark.gpu, requires_gpu()]

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny_moe_cpu.yaml"
SHAKESPEARE = ROOT / "megatron" / "training" / "assets" / "tinyshakespeare.txt"


def _spec() -> str:
    from megatron import compat

    return "te" if compat.have_transformer_engine() else "local"


def _torchrun(module: str, args: list, nproc: int, timeout: float = 240, env=None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
           *[str(a) for a in args]]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        proc = subprocess.CompletedProcess(cmd, 124, err.stdout or "", (err.stderr or "") + f"\ntimed out after {timeout}s")
    _save_log(f"{module.rsplit('.', 1)[-1]}-{nproc}", proc)
    return proc


def _save_log(name: str, proc) -> None:
    """The whole output of a subprocess, beside the tier's JSON (``gpu_check_<name>.log``)."""
    path = pathlib.Path(os.environ.get("GPU_CHECK_JSON", ROOT / "runs" / "gpu_check.json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f"gpu_check_{name}.log", "a") as f:
        f.write(f"$ {' '.join(map(str, proc.args))}\nexit {proc.returncode}\n{proc.stdout}\n{proc.stderr}\n")


def _tail(proc, n: int = 25) -> str:
    """The rank's own traceback if there is one (torchrun's follows it and says nothing), else the
    last ``n`` lines of the output."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", ln) for ln in (proc.stdout + "\n" + proc.stderr).splitlines()]
    one_line = [ln for ln in lines if re.match(r"^[\w.]+: error: ", ln)]  # the project's CLI errors
    if one_line:
        return one_line[-1]
    starts = [i for i, ln in enumerate(lines) if ln.lstrip().startswith("Traceback (most recent call last)")]
    for i in starts:
        block = lines[i:i + 200]
        if not any("torch/distributed/run.py" in ln for ln in block[:6]):
            end = next((j for j, ln in enumerate(block[1:], 1) if not ln.startswith((" ", "\t"))), len(block) - 1)
            return "\n".join(block[:end + 1][-40:])
    return "\n".join(lines[-n:])


def _records(path) -> tuple[list, list]:
    steps, events = [], []
    for line in pathlib.Path(path).read_text().splitlines():
        rec = json.loads(line)
        (events if "event" in rec else steps).append(rec)
    return steps, events


def _pretrain(save, nproc: int, ep: int, iters: int, heldout=None, env=None):
    args = ["--config", TINY, "--expert-model-parallel-size", ep, "--transformer-impl", "auto",
            "--train-iters", iters, "--lr-warmup-iters", min(10, iters // 2), "--log-interval", 5,
            "--eval-interval", iters, "--eval-iters", 2, "--save", save, "--save-interval", iters]
    if heldout is not None:
        args += ["--heldout-text", heldout]
    start = time.perf_counter()
    proc = _torchrun("megatron.training.pretrain_gpt", args, nproc, env=env)
    return proc, time.perf_counter() - start


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The tiny MoE pretrained on one GPU (world size 1, NCCL), with a held-out perplexity at the end
    (``evaluate_windows``: collectives on host tensors over NCCL)."""
    root = tmp_path_factory.mktemp("pretrain")
    heldout = root / "heldout.txt"
    heldout.write_text(SHAKESPEARE.read_text()[-20000:])
    proc, seconds = _pretrain(root / "ckpt", 1, 1, 40, heldout)
    return {"proc": proc, "seconds": seconds, "save": root / "ckpt"}


def test_pretrain_nccl_world_size_1(pretrained, report):
    """The tiny MoE trains 40 steps under torchrun/NCCL: the loss falls by more than 0.5 nats
    (7.3 -> 5.8 on the H100 run; a broken step leaves it flat), the held-out perplexity is a finite
    number over a non-empty window, and the CUDA-event step timers book non-zero forward and
    backward times inside the step (each positive, not a speed: a clock left on the host reads ~0)."""
    proc = pretrained["proc"]
    assert proc.returncode == 0, _tail(proc)
    steps, events = _records(pretrained["save"] / "metrics.jsonl")
    heldout = [e for e in events if e["event"] == "heldout"]
    last = steps[-1]
    report["figures"] = {"spec": _spec(), "first_loss": steps[0]["lm_loss"], "last_loss": last["lm_loss"],
                         "tokens_per_sec": last["tokens_per_sec"], "step_time_s": last["step_time_s"],
                         "fwd_time_s": last["fwd_time_s"], "bwd_time_s": last["bwd_time_s"],
                         "heldout_ppl": heldout[-1]["ppl"] if heldout else None, "wall_s": pretrained["seconds"]}
    report["result"] = (f"{_spec()} spec: lm loss {steps[0]['lm_loss']:.2f} (step {steps[0]['step']}) -> "
                        f"{last['lm_loss']:.2f} (step {last['step']}), "
                        f"{last['tokens_per_sec']:.0f} tok/s, step {1e3 * last['step_time_s']:.1f} ms "
                        f"(fwd {1e3 * last['fwd_time_s']:.1f} / bwd {1e3 * last['bwd_time_s']:.1f}, CUDA events), "
                        f"held-out ppl {heldout[-1]['ppl']:.1f}" if heldout else "no held-out record")
    assert last["lm_loss"] < steps[0]["lm_loss"] - 0.5
    assert heldout and heldout[-1]["tokens"] > 0 and math.isfinite(heldout[-1]["ppl"])
    assert 0 < last["fwd_time_s"] < last["step_time_s"]
    assert 0 < last["bwd_time_s"] < last["step_time_s"]


def _skip_only_if_nccl_refuses_a_shared_gpu(text: str, num_ranks: int) -> None:
    """Skip for NCCL's refusal of two ranks on one device, where they share one (``tests/gpu/nccl.py``):
    the only failure that means "this machine cannot run the check"; anything else is a failure."""
    found = shared_gpu_refusal(text, num_ranks, torch.cuda.device_count())
    if found:
        pytest.skip("NCCL refuses two ranks on one GPU: " + found)


def test_pretrain_two_ranks_on_one_gpu(tmp_path, report):
    """EP=2 on 2 processes: they share GPU 0 on a one-GPU machine (NCCL may refuse two ranks on one
    device: then skipped, see ``_skip_only_if_nccl_refuses_a_shared_gpu``), and take GPUs 0 and 1
    where there are two (``init_from_env``: ``LOCAL_RANK`` modulo the visible GPUs). Asserted: the
    loss falls over 20 steps, and the expert-parallel all-to-all really ran on NCCL (off-rank bytes
    and CUDA-event in-flight time both non-zero)."""
    proc, seconds = _pretrain(tmp_path / "ckpt", 2, 2, 20, env=NCCL_DEBUG_ENV)
    if proc.returncode != 0:
        _skip_only_if_nccl_refuses_a_shared_gpu(proc.stdout + proc.stderr, 2)
        raise AssertionError(_tail(proc))
    steps, _ = _records(tmp_path / "ckpt" / "metrics.jsonl")
    last = steps[-1]
    num_gpus = min(2, torch.cuda.device_count())
    report["figures"] = {"num_gpus": num_gpus, "first_loss": steps[0]["lm_loss"], "last_loss": last["lm_loss"],
                         "a2a_bytes_dispatch": last["a2a_bytes_dispatch"], "a2a_time_s": last["a2a_time_s"],
                         "exposed_comm_s": last["exposed_comm_s"], "step_time_s": last["step_time_s"], "wall_s": seconds}
    report["result"] = (f"EP=2 on {num_gpus} GPU(s): lm loss {steps[0]['lm_loss']:.2f} -> {last['lm_loss']:.2f}, all-to-all "
                        f"{1e3 * last['a2a_time_s']:.2f} ms in flight / {1e3 * last['exposed_comm_s']:.2f} ms exposed "
                        f"per step (CUDA events), step {1e3 * last['step_time_s']:.1f} ms")
    assert last["lm_loss"] < steps[0]["lm_loss"]
    assert last["a2a_bytes_dispatch"] > 0 and last["a2a_time_s"] > 0


# --- BigMac vs fine-grained at GPT3-XL sizes -------------------------------------------------------

GPT3_XL = dict(num_layers=2, hidden_size=2048, num_attention_heads=16, ffn_hidden_size=8192, seq_length=2048,
               max_position_embeddings=2048, num_experts=64, moe_router_topk=8, moe_ffn_hidden_size=512,
               moe_shared_expert_intermediate_size=None, swiglu=False, bf16=True, transformer_impl="auto",
               moe_aux_loss_coeff=0.0)
VOCAB_XL = 1024  # small: the comparison is of the layers, not the output GEMM


def _bigmac_rank(rank, world, repeats):
    from megatron.components.parallel import device, initialize_parallel
    from moe_variants.bigmac.accounting import model_accounting
    from moe_variants.builder import build_model, causal_attention_mask, padded_vocab_size
    from moe_variants.common import timing
    from moe_variants.config import ParallelConfig
    from tests.helpers import tiny_model_config

    parallel = ParallelConfig()
    pgc = initialize_parallel(parallel, seed=5)
    cfgs = {"fine-grained": tiny_model_config(**GPT3_XL),
            "bigmac": tiny_model_config(**GPT3_XL, moe_variant="bigmac", bigmac_ratio=0.25)}
    models = {k: build_model(c, parallel, vocab_size=VOCAB_XL, pg_collection=pgc) for k, c in cfgs.items()}
    dev = device()
    seq = GPT3_XL["seq_length"]
    tokens = torch.randint(0, VOCAB_XL, (1, seq), device=dev)
    positions = torch.arange(seq, device=dev)[None]
    mask = causal_attention_mask(seq, device=dev)
    clock = timing.clock_for(dev)
    spans = {k: [] for k in models}

    def step(model):
        for p in model.parameters():
            p.grad = None
        loss = model(tokens, positions, mask, labels=tokens).float().mean()
        loss.backward()
        return loss

    for name, model in models.items():  # warm-up (kernel selection, compilation)
        for _ in range(3):
            step(model)
    for _ in range(repeats):  # interleaved, so clock and thermal drift hit both alike
        for name, model in models.items():
            start = clock.stamp()
            loss = step(model)
            spans[name].append((start, clock.stamp()))
    torch.cuda.synchronize()
    ms = {k: statistics.median(1e3 * (b.seconds() - a.seconds()) for a, b in v) for k, v in spans.items()}
    vocab = padded_vocab_size(VOCAB_XL, cfgs["bigmac"], parallel)
    flops = {k: model_accounting(c, vocab).flops_per_token_fwd for k, c in cfgs.items()}
    return {"ms": ms, "flops_per_token": flops, "loss_finite": bool(torch.isfinite(loss)),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def test_bigmac_compute_overhead_gpt3_xl(report):
    """Forward+backward of a 2-layer model at GPT3-XL's layer sizes (h 2048, 64 experts, top-8,
    fine-grained expert 512, BigMac r = 0.25), EP=1 (no communication): the compute BigMac adds.
    The paper's +4.54% is Table 4's whole-model FLOPs (``accounting.paper_table3``)."""
    from moe_variants.bigmac.accounting import paper_table3

    out = run_distributed(_bigmac_rank, 1, 10, backend="nccl", timeout_s=400)[0]
    kw = dict(h=2048, l=24, e=64, r=0.25, v=50304, tokens=2**19, s=2048, top_k=8, ep=32)
    paper = paper_table3(bigmac=True, **kw)["flops"] / paper_table3(bigmac=False, **kw)["flops"] - 1
    ms, flops = out["ms"], out["flops_per_token"]
    measured = ms["bigmac"] / ms["fine-grained"] - 1
    ours = flops["bigmac"] / flops["fine-grained"] - 1
    report["figures"] = {**{f"{k}_ms": v for k, v in ms.items()}, "measured_overhead": measured,
                         "flops_overhead_this_model": ours, "paper_flops_overhead": paper, "spec": _spec(),
                         "peak_gib": out["peak_gib"]}
    report["result"] = (f"{_spec()} spec, bf16, 2048 tokens: fine-grained {ms['fine-grained']:.1f} ms, BigMac "
                        f"{ms['bigmac']:.1f} ms fwd+bwd: {100 * measured:+.1f}% time vs {100 * ours:+.1f}% FLOPs "
                        f"(this 2-layer model; paper +{100 * paper:.2f}% for GPT3-XL)")
    assert out["loss_finite"]
    assert round(100 * paper, 2) == 4.54 and ours > 0


# --- FarSkip: EP=1 (the schedule and the CUDA-event path) and EP=2 (the collectives) -----------------

FARSKIP = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, max_position_embeddings=256,
               num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256, moe_layer_freq=1, farskip="all",
               transformer_impl="auto")
# Overlapped vs simple gradients: the same fp32 terms, some summed in another order (the reordered
# backward reaches e.g. the embedding through both streams, deferred weight gradients are added
# later), which moves a sum by a few ulps of its largest terms (7.5e-9 absolute on the H100 at EP=1;
# the CPU test tests/farskip/test_farskip.py allows rtol 1e-5 / atol 2e-6). A missing, doubled or
# misrouted weight gradient moves a parameter's gradient by O(its own size), so each parameter's
# gradient must be within FARSKIP_GRAD_RTOL of its own largest |entry|, and both runs must give
# gradients to the same parameters.
FARSKIP_GRAD_RTOL = 1e-4
NUM_WINDOW_TASKS = 10_000  # stand-in deferred GEMMs offered to one all-to-all window (~30 s of GPU work)


def _grad_mismatches(ref: dict, got: dict) -> tuple[list, float]:
    """Names of the parameters whose gradient is on one side only or differs from ``ref`` by more
    than ``FARSKIP_GRAD_RTOL`` x max |ref|, and the largest relative difference seen."""
    bad = sorted(set(ref) ^ set(got))
    worst = 0.0
    for name in sorted(set(ref) & set(got)):
        scale = float(ref[name].abs().max())
        diff = float((ref[name] - got[name]).abs().max())
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        worst = max(worst, rel)
        if rel > FARSKIP_GRAD_RTOL:
            bad.append(name)
    return bad, worst


def _farskip_ep1_rank(rank, world):
    import torch.distributed as dist

    from megatron.components.parallel import device, initialize_parallel
    from moe_variants.builder import build_model, causal_attention_mask
    from moe_variants.common import comm, wgrad
    from moe_variants.common.moe_layer import comm_totals
    from moe_variants.config import ParallelConfig
    from tests.helpers import tiny_model_config

    out = {}
    parallel = ParallelConfig()
    dev = device()
    tokens = torch.randint(0, 1000, (2, FARSKIP["seq_length"]), generator=torch.Generator().manual_seed(0)).to(dev)
    positions = torch.arange(tokens.shape[1], device=dev)[None].expand_as(tokens)
    mask = causal_attention_mask(tokens.shape[1], device=dev)
    logits, grads = {}, {}
    for impl in ("simple", "overlapped"):
        pgc = initialize_parallel(parallel, seed=11)
        model = build_model(tiny_model_config(**FARSKIP, farskip_impl=impl), parallel, vocab_size=1024, pg_collection=pgc)
        logits[impl] = model(tokens, positions, mask).detach()
        model(tokens, positions, mask, labels=tokens).float().mean().backward()
        grads[impl] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out["forward_identical"] = torch.equal(logits["simple"], logits["overlapped"])
    out["grad_mismatches"], out["max_grad_rel_diff"] = _grad_mismatches(grads["simple"], grads["overlapped"])
    out["max_grad_diff"] = max((float((grads["simple"][n] - grads["overlapped"][n]).abs().max())
                                for n in set(grads["simple"]) & set(grads["overlapped"])), default=math.nan)
    out["model_a2a_calls"] = comm_totals([model])["calls"]  # EP=1: all_to_all returns before any collective

    # The CUDA-event path of the project's all-to-all on a real NCCL group (world size 1: the
    # collective still runs as a kernel on NCCL's stream), launched behind queued compute so that
    # it stays in flight while the host moves on.
    group = dist.group.WORLD
    x = torch.randn(64 * 2**20, device=dev)  # 256 MiB
    a = torch.randn(4096, 4096, device=dev)
    product = torch.empty_like(a)
    n = x.shape[0]
    for _ in range(2):  # warm-up: NCCL communicator and kernels
        comm._launch(group, x, [n], [n], None, "dispatch", False, "warm").wait()
    torch.cuda.synchronize()
    counters = comm.CommCounters()
    for _ in range(4):
        torch.matmul(a, a, out=product)  # the inputs' producer: the collective starts after these
    pending = comm._launch(group, x, [n], [n], counters, "dispatch", False, "dispatch")
    out["in_flight_after_launch"] = pending.in_flight()
    ran = []
    saved = list(wgrad._QUEUE)
    wgrad._QUEUE.clear()
    # stand-ins for deferred weight gradients: each queues one GEMM (no host sync), as the real ones do
    wgrad._QUEUE.extend((lambda i=i: (torch.matmul(a, a, out=product), ran.append(i)))
                        for i in range(NUM_WINDOW_TASKS))
    wgrad.run_while(pending.in_flight)
    out["wgrad_tasks_in_window"] = len(ran)
    wgrad._QUEUE.clear()
    wgrad._QUEUE.extend(saved)
    received = pending.wait()
    out["a2a_exact"] = torch.equal(received, x)
    d = counters.as_dict()
    out["time_fwd_s"], out["exposed_fwd_s"] = d["time_fwd_s"], d["exposed_fwd_s"]

    # What a host-side completion stamp (the CPU path's: the work future's callback) reads on NCCL,
    # against the host time at which the collective's done event is seen complete.
    outp = torch.empty_like(x)
    torch.cuda.synchronize()
    for _ in range(4):
        torch.matmul(a, a, out=product)
    stamps = {}
    launched = time.perf_counter()
    work = dist.all_to_all_single(outp, x, async_op=True)
    work.get_future().then(lambda fut: stamps.setdefault("future", time.perf_counter()))
    work.wait()
    done_ev = torch.cuda.Event()
    done_ev.record()
    while not done_ev.query():
        pass
    out["future_after_launch_s"] = stamps.get("future", float("nan")) - launched
    out["done_after_launch_s"] = time.perf_counter() - launched
    return out


def test_farskip_ep1_overlapped_vs_simple_and_cuda_events(report):
    """EP=1 on one GPU, so no expert-parallel collective runs (``all_to_all`` returns early for a
    group of one: asserted, the model books no all-to-all call); the EP=2 check below covers the
    collectives. Asserted here:

    - the overlapped schedule's forward (split attention, reordered layer code) is bit-identical to
      the simple one (it moves work, never arithmetic), and every parameter's gradient is within
      ``FARSKIP_GRAD_RTOL`` of its own scale (see there);
    - the CUDA-event path of the project's all-to-all on a real NCCL group (a 256 MiB all-to-all
      behind 4 queued 4096^3 GEMMs): the received tensor is exact, it is still in flight when the
      host returns from the launch, its CUDA-event in-flight time is non-zero, and the deferral
      queue launches work inside the window and stops when the done event fires: at least one and
      fewer than all ``NUM_WINDOW_TASKS`` queued GEMMs ran (the window waits for ~10 ms of GEMMs;
      the queue holds ~30 s). These are orders of events, not timings: the host enqueues in
      microseconds what the GPU runs in milliseconds."""
    out = run_distributed(_farskip_ep1_rank, 1, backend="nccl", timeout_s=300)[0]
    report["figures"] = out
    report["result"] = (f"EP=1 forward bit-identical: {out['forward_identical']} (grads max diff "
                        f"{out['max_grad_diff']:.1e}, {out['max_grad_rel_diff']:.1e} relative); "
                        f"256 MiB NCCL all-to-all: {1e3 * out['time_fwd_s']:.3f} ms in flight by CUDA events, "
                        f"{1e3 * out['exposed_fwd_s']:.3f} ms exposed, in flight after launch: "
                        f"{out['in_flight_after_launch']}, {out['wgrad_tasks_in_window']} queued GEMMs launched in the "
                        f"window; behind queued compute the NCCL work future fired "
                        f"{1e3 * out['future_after_launch_s']:.3f} ms after launch, the collective completed "
                        f"{1e3 * out['done_after_launch_s']:.3f} ms after")
    assert out["model_a2a_calls"] == 0
    assert out["forward_identical"]
    assert out["grad_mismatches"] == [], (out["grad_mismatches"][:5], out["max_grad_rel_diff"])
    assert out["a2a_exact"]
    assert out["in_flight_after_launch"]
    assert 0 < out["wgrad_tasks_in_window"] < NUM_WINDOW_TASKS
    assert out["time_fwd_s"] > 0


# EP=2 is sized so that the GPU trails the host in the backward (fp32 GEMMs over 4,096 tokens of
# width 1,024 take milliseconds; the host launches them in microseconds, and the backward has no host
# sync): a gradient all-to-all is then still in flight when the hook of its consumer runs, and the
# deferred weight gradients fill its window. Batch 2, as at EP=1, where the split attention's halves
# were bit-identical to the whole on the H100.
FARSKIP_EP2 = dict(FARSKIP, hidden_size=1024, num_attention_heads=16, seq_length=2048, max_position_embeddings=2048,
                   moe_ffn_hidden_size=2048)
FARSKIP_EP2_BATCH = 2


def _farskip_ep2_rank(rank, world):
    from megatron.components.parallel import device
    from moe_variants.builder import causal_attention_mask
    from moe_variants.common import wgrad
    from moe_variants.common.moe_layer import comm_counters, comm_totals, moe_layers
    from moe_variants.config import ParallelConfig
    from tests.helpers import VOCAB, build_and_load, tiny_model_config

    parallel = ParallelConfig(expert_model_parallel_size=world)
    dev = device()
    seq = FARSKIP_EP2["seq_length"]
    # each rank its own tokens: each routes to both ranks' experts
    tokens = torch.randint(0, VOCAB, (FARSKIP_EP2_BATCH, seq), generator=torch.Generator().manual_seed(rank)).to(dev)
    positions = torch.arange(seq, device=dev)[None].expand_as(tokens)
    mask = causal_attention_mask(seq, device=dev)
    logits, grads = {}, {}
    model = None
    for impl in ("simple", "overlapped"):
        del model  # the simple model's memory back before the overlapped one is built
        model, _ = build_and_load(tiny_model_config(**FARSKIP_EP2, farskip_impl=impl), parallel, seed=11)
        logits[impl] = model(tokens, positions, mask).detach()
        model(tokens, positions, mask, labels=tokens).float().mean().backward()
        grads[impl] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    out = {"forward_identical": torch.equal(logits["simple"], logits["overlapped"]),
           "max_logit_diff": float((logits["simple"] - logits["overlapped"]).abs().max()),
           "deferring_linears": sum(wgrad.is_deferred(m) for m in model.modules()),
           "layers": len(moe_layers(model))}
    out["grad_mismatches"], out["max_grad_rel_diff"] = _grad_mismatches(grads["simple"], grads["overlapped"])

    in_window = []  # weight gradients computed inside each gradient all-to-all's window
    original = wgrad.run_while

    def counting(busy):
        before = wgrad.pending()
        original(busy)
        in_window.append(before - wgrad.pending())

    wgrad.run_while = counting
    try:
        for _ in range(3):
            for c in comm_counters([model]):
                c.reset()
            for p in model.parameters():
                p.grad = None
            model(tokens, positions, mask, labels=tokens).float().mean().backward()
    finally:
        wgrad.run_while = original
    total = comm_totals([model])  # the last step's
    out.update({key: total[key] for key in ("bytes_dispatch", "bytes_backward", "time_fwd_s", "time_bwd_s",
                                            "exposed_fwd_s", "exposed_bwd_s")})
    out["windows"] = len(in_window)
    out["wgrad_in_windows"] = sum(in_window)  # over the 3 steps
    out["wgrad_left_after_backward"] = wgrad.pending()
    return out


def test_farskip_ep2_overlapped_vs_simple(report):
    """Overlapped FarSkip at EP=2 on two GPUs (NCCL): the expert-parallel all-to-alls really run
    (off-rank bytes forward and backward, non-zero CUDA-event in-flight time both ways), the
    overlapped forward is bit-identical to the simple one and the gradients agree within
    ``FARSKIP_GRAD_RTOL`` on every rank, and the deferral window is used: deferred weight gradients
    ran inside gradient all-to-all windows (> 0 on every rank, over 3 steps; sized so the GPU trails
    the host, see ``FARSKIP_EP2``; 0 would mean the backward waits on the host, e.g. a sync) and
    none is left after the backward. Skipped on one GPU: NCCL refuses two ranks on one device
    (docs/guides/gpu.md), and the EP=1 check does not stand in for this one."""
    num_gpus = torch.cuda.device_count()
    if num_gpus < 2:
        pytest.skip(f"needs 2 GPUs for EP=2 on NCCL, found {num_gpus} (NCCL refuses two ranks on one GPU); "
                    "FarSkip's all-to-all overlap is not checked on this machine")
    out = run_distributed(_farskip_ep2_rank, 2, backend="nccl", timeout_s=400)
    r = out[0]
    report["figures"] = {"rank0": out[0], "rank1": out[1]}
    report["result"] = (f"EP=2 on 2 GPUs, rank 0: forward bit-identical {r['forward_identical']} (max |dlogit| "
                        f"{r['max_logit_diff']:.1e}), grads max relative diff {r['max_grad_rel_diff']:.1e}; forward "
                        f"{1e3 * r['time_fwd_s']:.2f} ms in flight / {1e3 * r['exposed_fwd_s']:.2f} ms exposed, "
                        f"backward {1e3 * r['time_bwd_s']:.2f} / {1e3 * r['exposed_bwd_s']:.2f} ms, "
                        f"{r['wgrad_in_windows']} deferred weight gradients ran inside {r['windows']} all-to-all "
                        "windows (3 steps)")
    for rank, r in enumerate(out):
        assert r["bytes_dispatch"] > 0 and r["bytes_backward"] > 0, rank
        assert r["time_fwd_s"] > 0 and r["time_bwd_s"] > 0, rank
        assert r["forward_identical"], (rank, r["max_logit_diff"])
        assert r["grad_mismatches"] == [], (rank, r["grad_mismatches"][:5], r["max_grad_rel_diff"])
        assert r["deferring_linears"] > 0, rank
        assert r["wgrad_in_windows"] > 0, (rank, r["windows"])
        assert r["wgrad_left_after_backward"] == 0, rank


# --- HF conversion parity and lm-eval on GPU --------------------------------------------------------

GPU_ATOL = 1e-3  # fp32 on both sides, different GEMM kernels (cuBLAS vs CPU BLAS); a wrong conversion moves O(0.1-1)


def test_hf_conversion_parity_on_gpu(tmp_path, report):
    """transformers' fp32 forward on the CPU vs the converted model on the GPU (tiny random models
    of each family made here): logits within ``GPU_ATOL`` and identical 16-token greedy output."""
    transformers = pytest.importorskip("transformers")
    if int(transformers.__version__.split(".")[0]) >= 5:
        pytest.skip(f"transformers {transformers.__version__}: the converters target transformers<5 (the dev extra)")
    from tests.convert import hf_models as H

    diffs, same = {}, {}
    for family in ("qwen3_moe", "deepseek_v2", "mixtral"):
        hf_dir = H.make_hf_model(str(tmp_path / family / "hf"), family)
        ckpt = str(tmp_path / family / "ckpt")
        codes = run_distributed(H.cli_rank, 1, [["--from", "hf", "--hf-dir", hf_dir, "--to", "mcore", "--out", ckpt]],
                                backend="nccl", timeout_s=240)[0]
        assert [c for c, _ in codes] == [0], codes
        ref_logits, ref_tokens = H.hf_reference(hf_dir, family)
        logits, tokens = run_distributed(H.our_greedy_rank, 1, ckpt, 1, 1, backend="nccl", timeout_s=240)[0]
        diffs[family] = float((logits - ref_logits).abs().max())
        same[family] = bool(torch.equal(tokens, ref_tokens))
    report["figures"] = {"max_abs_logit_diff": diffs, "greedy_identical": same}
    report["result"] = ", ".join(f"{f}: max |dlogit| {d:.1e}, greedy {'=' if same[f] else '!='}" for f, d in diffs.items())
    for family in diffs:
        assert diffs[family] < GPU_ATOL, family
        assert same[family], family


def test_lm_eval_items_on_gpu(pretrained, tmp_path, report):
    """A few offline ARC-Easy-format items (generated) through lm-eval on the pretrained checkpoint,
    under torchrun with NCCL (the adapter's collectives on host values included)."""
    pytest.importorskip("lm_eval")
    from tests.helpers import write_arc_easy

    assert pretrained["proc"].returncode == 0, "pretraining failed"
    write_arc_easy(tmp_path / "data", num_questions=8)
    out = tmp_path / "results.json"
    proc = _torchrun("megatron.training.evaluate_lm", [
        "--load", pretrained["save"], "--tasks", "local_arc_easy", "--include-path", ROOT / "examples" / "lm_eval_tasks",
        "--data-dir", tmp_path / "data", "--limit", 8, "--output", out], 1)
    assert proc.returncode == 0, _tail(proc)
    results = json.loads(out.read_text())["results"]["local_arc_easy"]
    acc = {k: v for k, v in results.items() if k.startswith("acc") and "stderr" not in k}
    report["figures"] = acc
    report["result"] = "8 items of local_arc_easy: " + ", ".join(f"{k} {v:.3f}" for k, v in acc.items())
    assert acc and all(0.0 <= v <= 1.0 for v in acc.values())


def _offline_greedy_on_gpu(ckpt: str, prompts, max_new: int, generation: str = "auto"):
    """evaluate_lm's greedy generation (``tests/serving/conftest.offline_greedy_rank``) on the GPU:
    a spawned NCCL rank, since CUDA cannot start in a forked child (``offline_greedy`` forks gloo)."""
    from tests.serving.conftest import offline_greedy_rank

    return run_distributed(offline_greedy_rank, 1, ckpt, prompts, max_new, generation, backend="nccl",
                           timeout_s=300)[0]


def _vocab_size(ckpt: str) -> int:
    from megatron.components.loading import checkpoint_configs, load_tokenizer

    _, manifest, path = checkpoint_configs(ckpt)
    return load_tokenizer(manifest, path).vocab_size


def test_server_on_gpu(pretrained, tmp_path, report):
    """The OpenAI-compatible server (megatron-core's dynamic engine) on the GPU, on the pretrained
    checkpoint:

    - 3 greedy completions through HTTP equal evaluate_lm's offline generation on the same GPU
      (exact tokens: both are argmax over the same model's logits);
    - a seeded sampling request (temperature 1, ``seed`` 5, 16 tokens, EOS ignored) sent twice
      gives the same tokens both times (the request's own generator on the GPU), and ``seed`` 6
      gives a valid answer: 16 token ids inside the tokenizer's vocabulary (whether it differs is
      reported, not asserted: a tiny model may agree by chance);
    - ``/metrics`` answers, and SIGTERM stops the server with exit 0."""
    from tests.serving.conftest import Server, get_metrics, post

    assert pretrained["proc"].returncode == 0, "pretraining failed"
    ckpt = str(pretrained["save"])
    prompts = ["First Citizen:", "ROMEO: But soft", "To be, or not"]
    reference, mode = _offline_greedy_on_gpu(ckpt, prompts, 16)
    vocab_size = _vocab_size(ckpt)
    server = Server(ckpt, tmp_path)
    try:
        start = time.perf_counter()
        got = []
        for p in prompts:
            status, body = post(server.url, "/v1/completions", {"prompt": p, "max_tokens": 16, "temperature": 0,
                                                                "return_token_ids": True})
            assert status == 200, body
            got.append(body["choices"][0]["token_ids"])
        seconds = time.perf_counter() - start
        sampled = []
        for seed in (5, 5, 6):
            status, body = post(server.url, "/v1/completions", {"prompt": prompts[0], "max_tokens": 16,
                                                                "temperature": 1.0, "seed": seed, "ignore_eos": True,
                                                                "return_token_ids": True})
            assert status == 200, body
            sampled.append(body["choices"][0]["token_ids"])
        metrics = get_metrics(server.url)
    finally:
        code = server.stop()
    with open(tmp_path / "server.log", "w") as f:
        f.write(server.output())
    want = [tokens for tokens, _ in reference]
    report["figures"] = {"completions_s": seconds, "identical": got == want, "offline_mode": mode,
                         "seeded_reproducible": sampled[0] == sampled[1], "other_seed_differs": sampled[0] != sampled[2],
                         "exit_code": code}
    tokens = {k: v for k, v in metrics.items() if "token" in k}
    report["result"] = (f"3 greedy completions of 16 tokens in {seconds:.2f} s, identical to evaluate_lm's "
                        f"{mode} generation: {got == want}; seed 5 twice identical: {sampled[0] == sampled[1]}, "
                        f"seed 6 differs: {sampled[0] != sampled[2]}; SIGTERM exit {code}; metrics {tokens}")[:400]
    assert got == want
    assert sampled[0] == sampled[1]
    assert len(sampled[2]) == 16 and all(0 <= t < vocab_size for t in sampled[2]), sampled[2]
    assert metrics
    assert code == 0


def _save_mla(path: str) -> None:
    """Save the serving tests' tiny MLA model (``tests/serving/test_mla_tp.py``'s ``MLA_TINY``
    without its BigMac layers: latent KV with decoupled RoPE heads and latent norms, a dense first
    layer, init std 0.5 so next-token distributions are peaked), in a one-rank gloo world."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state

    from tests.eval.conftest import save_tiny
    from tests.serving.test_mla_tp import MLA_TINY

    overrides = {k: v for k, v in MLA_TINY.items() if k not in ("moe_variant", "bigmac_ratio")}
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            save_tiny(path, overrides)
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def test_server_on_gpu_mla(tmp_path, report):
    """The server on an MLA checkpoint on the GPU (the project serves DeepSeek-V2-shaped models):
    the checkpoint is built on the CPU as CPU CI builds it (``_save_mla``), then megatron-core's
    dynamic engine with the latent KV cache and absorbed decoding (megatron/compat/mla.py) serves
    it over HTTP. Its greedy tokens for 5 prompts (1 to 100 tokens) equal the plain forward without
    a cache (evaluate_lm's recompute generation) on the same GPU, exactly: the distributions are
    peaked (init std 0.5), so fp32 kernel differences (~1e-5 in a logit) cannot move an argmax;
    SIGTERM exits 0."""
    from tests.serving.conftest import REPO, Server
    from tests.serving.test_mla_tp import MAX_NEW, _prompts, served_greedy

    ckpt = str(tmp_path / "mla")
    code = f"import sys; sys.path.insert(0, {REPO!r}); from tests.gpu.test_gpu_tier import _save_mla; _save_mla({ckpt!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1"))
    _save_log("save_mla", proc)
    assert proc.returncode == 0, _tail(proc)
    prompts = _prompts(ckpt)
    reference, mode = _offline_greedy_on_gpu(ckpt, prompts, MAX_NEW, generation="recompute")
    server = Server(ckpt, tmp_path)
    try:
        got = served_greedy(server.url, prompts, MAX_NEW)
    finally:
        exit_code = server.stop()
    with open(tmp_path / "server.log", "w") as f:
        f.write(server.output())
    want = [tokens for tokens, _ in reference]
    same = [g == w for g, w in zip(got, want)]
    report["figures"] = {"prompt_lengths": [len(p) for p in prompts], "identical": same, "offline_mode": mode,
                         "exit_code": exit_code}
    report["result"] = (f"MLA checkpoint, {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
                        f"tokens, {MAX_NEW} greedy tokens: served (latent KV cache) = {mode} forward without a cache: "
                        f"{same}; SIGTERM exit {exit_code}")
    assert mode == "recompute"
    assert got == want
    assert exit_code == 0
