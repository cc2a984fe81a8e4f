"""The GPU tier (``scripts/gpu_check.sh``, or ``pytest -m gpu tests/gpu``): what CPU CI cannot show.

Each check asserts what must hold on any GPU (the run completes, the loss falls, the overlapped
FarSkip forward is bit-identical to the simple one, CUDA-event timing books non-zero times,
converted models match transformers) and reports its figures in the tier's table; timings are
reported, never asserted. Process groups are NCCL, in spawned processes (``run_distributed``) or
under torchrun. Skipped on machines without a CUDA GPU.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch

from megatron.training.testing import DistributedTestError, requires_gpu, run_distributed

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny_moe_cpu.yaml"
SHAKESPEARE = ROOT / "megatron" / "training" / "assets" / "tinyshakespeare.txt"


def _spec() -> str:
    from megatron import compat

    return "te" if compat.have_transformer_engine() else "local"


def _torchrun(module: str, args: list, nproc: int, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               PYTHONUNBUFFERED="1")
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


def _pretrain(save, nproc: int, ep: int, iters: int, heldout=None):
    args = ["--config", TINY, "--expert-model-parallel-size", ep, "--transformer-impl", "auto",
            "--train-iters", iters, "--lr-warmup-iters", min(10, iters // 2), "--log-interval", 5,
            "--eval-interval", iters, "--eval-iters", 2, "--save", save, "--save-interval", iters]
    if heldout is not None:
        args += ["--heldout-text", heldout]
    start = time.perf_counter()
    proc = _torchrun("megatron.training.pretrain_gpt", args, nproc)
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
    assert heldout and heldout[-1]["tokens"] > 0
    assert 0 < last["fwd_time_s"] < last["step_time_s"]


# NCCL's own refusal of two ranks on one device ("Duplicate GPU detected", reported as
# ncclInvalidUsage: "NCCL error in: ... invalid usage", as the H100 run in docs/gpu.md printed): the
# only failure that means "this machine cannot run the check"; anything else is a failure
NCCL_SHARED_GPU_REFUSAL = re.compile(r".*(?:Duplicate GPU detected|ncclInvalidUsage|NCCL error.*invalid usage).*")


def _skip_only_if_nccl_refuses_a_shared_gpu(text: str) -> None:
    found = NCCL_SHARED_GPU_REFUSAL.findall(text)
    if found:
        pytest.skip("NCCL refuses two ranks on one GPU: " + found[0].strip()[:240])


def test_pretrain_two_ranks_on_one_gpu(tmp_path, report):
    """EP=2 on 2 processes sharing GPU 0 (NCCL may refuse two ranks on one device)."""
    proc, seconds = _pretrain(tmp_path / "ckpt", 2, 2, 20)
    if proc.returncode != 0:
        _skip_only_if_nccl_refuses_a_shared_gpu(proc.stdout + proc.stderr)
        raise AssertionError(_tail(proc))
    steps, _ = _records(tmp_path / "ckpt" / "metrics.jsonl")
    last = steps[-1]
    report["figures"] = {"first_loss": steps[0]["lm_loss"], "last_loss": last["lm_loss"],
                         "a2a_bytes_dispatch": last["a2a_bytes_dispatch"], "a2a_time_s": last["a2a_time_s"],
                         "exposed_comm_s": last["exposed_comm_s"], "step_time_s": last["step_time_s"], "wall_s": seconds}
    report["result"] = (f"EP=2: lm loss {steps[0]['lm_loss']:.2f} -> {last['lm_loss']:.2f}, all-to-all "
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
    from megatron.training.parallel import device, initialize_parallel
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


# --- FarSkip on one GPU ----------------------------------------------------------------------------

FARSKIP = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=256, max_position_embeddings=256,
               num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256, moe_layer_freq=1, farskip="all",
               transformer_impl="auto")


def _farskip_rank(rank, world):
    import torch.distributed as dist

    from megatron.training.parallel import device, initialize_parallel
    from moe_variants.builder import build_model, causal_attention_mask
    from moe_variants.common import comm, wgrad
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
    out["max_grad_diff"] = max(float((grads["simple"][n] - grads["overlapped"][n]).abs().max()) for n in grads["simple"])

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
    wgrad._QUEUE.extend((lambda i=i: (torch.matmul(a, a, out=product), ran.append(i))) for i in range(10000))
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


def test_farskip_overlapped_vs_simple_one_gpu(report):
    """Forward bit-identity (the overlapped schedule moves collectives, never arithmetic) at EP=1,
    then the CUDA-event timing path on a real NCCL all-to-all: non-zero in-flight time and the
    deferred weight-gradient queue running while the done event has not fired."""
    out = run_distributed(_farskip_rank, 1, backend="nccl", timeout_s=300)[0]
    report["figures"] = out
    report["result"] = (f"forward bit-identical: {out['forward_identical']} (grads max diff {out['max_grad_diff']:.1e}); "
                        f"256 MiB NCCL all-to-all: {1e3 * out['time_fwd_s']:.3f} ms in flight by CUDA events, "
                        f"{1e3 * out['exposed_fwd_s']:.3f} ms exposed, in flight after launch: "
                        f"{out['in_flight_after_launch']}, {out['wgrad_tasks_in_window']} queued GEMMs launched in the "
                        f"window; behind queued compute the NCCL work future fired "
                        f"{1e3 * out['future_after_launch_s']:.3f} ms after launch, the collective completed "
                        f"{1e3 * out['done_after_launch_s']:.3f} ms after")
    assert out["forward_identical"]
    assert out["a2a_exact"]
    assert out["time_fwd_s"] > 0


def _farskip_ep2_rank(rank, world):
    from megatron.training.parallel import device
    from moe_variants.builder import causal_attention_mask
    from moe_variants.common.moe_layer import moe_layers
    from moe_variants.common import wgrad
    from moe_variants.config import ParallelConfig
    from moe_variants.common.moe_layer import comm_counters
    from moe_variants.common.comm import CommCounters
    from tests.helpers import VOCAB, build_and_load, tiny_model_config

    model, _ = build_and_load(tiny_model_config(**FARSKIP, farskip_impl="overlapped"),
                              ParallelConfig(expert_model_parallel_size=world))
    dev = device()
    tokens = torch.randint(0, VOCAB, (2, FARSKIP["seq_length"]), generator=torch.Generator().manual_seed(rank)).to(dev)
    positions = torch.arange(tokens.shape[1], device=dev)[None].expand_as(tokens)
    mask = causal_attention_mask(tokens.shape[1], device=dev)
    in_window = []
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
            in_window.clear()
            model(tokens, positions, mask, labels=tokens).float().mean().backward()
    finally:
        wgrad.run_while = original
    total = CommCounters.total(comm_counters([model]))
    return {"time_fwd_s": total["time_fwd_s"], "time_bwd_s": total["time_bwd_s"],
            "exposed_fwd_s": total["exposed_fwd_s"], "exposed_bwd_s": total["exposed_bwd_s"],
            "wgrad_in_windows": sum(in_window), "layers": len(moe_layers(model))}


def test_farskip_ep2_two_ranks_on_one_gpu(report):
    try:
        out = run_distributed(_farskip_ep2_rank, 2, backend="nccl", timeout_s=150)
    except DistributedTestError as err:
        _skip_only_if_nccl_refuses_a_shared_gpu(str(err))
        raise
    r = out[0]
    report["figures"] = {"rank0": out[0], "rank1": out[1]}
    report["result"] = (f"overlapped EP=2, rank 0: forward {1e3 * r['time_fwd_s']:.2f} ms in flight / "
                        f"{1e3 * r['exposed_fwd_s']:.2f} ms exposed, backward {1e3 * r['time_bwd_s']:.2f} / "
                        f"{1e3 * r['exposed_bwd_s']:.2f} ms, {r['wgrad_in_windows']} deferred weight gradients ran "
                        "inside all-to-all windows")
    for r in out:
        assert r["time_fwd_s"] > 0 and r["time_bwd_s"] > 0


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


def test_server_on_gpu(pretrained, tmp_path, report):
    """The OpenAI-compatible server (megatron-core's dynamic engine) on the GPU: greedy completions
    through HTTP equal evaluate_lm's offline generation on the same GPU, ``/metrics`` answers, and
    SIGTERM stops the server with exit 0."""
    from tests.serving.conftest import Server, get_metrics, offline_greedy, post

    assert pretrained["proc"].returncode == 0, "pretraining failed"
    ckpt = str(pretrained["save"])
    prompts = ["First Citizen:", "ROMEO: But soft", "To be, or not"]
    reference, mode = offline_greedy(ckpt, prompts, 16)
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
        metrics = get_metrics(server.url)
    finally:
        code = server.stop()
    with open(tmp_path / "server.log", "w") as f:
        f.write(server.output())
    want = [tokens for tokens, _ in reference]
    report["figures"] = {"completions_s": seconds, "identical": got == want, "offline_mode": mode,
                         "exit_code": code}
    tokens = {k: v for k, v in metrics.items() if "token" in k}
    report["result"] = (f"3 greedy completions of 16 tokens in {seconds:.2f} s, identical to evaluate_lm's "
                        f"{mode} generation: {got == want}; SIGTERM exit {code}; metrics {tokens}")[:400]
    assert got == want
    assert code == 0
