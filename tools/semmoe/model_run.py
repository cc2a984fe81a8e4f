"""Running a checkpoint for Sem-MoE: routing traces (``profile``) and measured LAR (``lar``).

Both run the model (any TP/EP for ``profile``; EP = D and TP = 1 or D for ``lar``) on prompts, with the
routers' observers (``ProjectRouter.routing_observer``) reporting every routing decision.

* :func:`profile_rank`: each data-parallel group takes every DP-th prompt, runs it in padded
  batches (right padding: causal attention and dropless routing leave the real tokens' routing
  unchanged), and records per MoE layer and token the top-k expert ids in router order; TP ranks
  all-gather their sequence-parallel shards. All ranks run the same number of forwards (ranks
  with fewer batches run a one-token dummy) so that the EP all-to-alls stay in lockstep. Rank 0
  builds the :class:`Profile` with ``profile_from_traces`` and extends it to unseen tokens by
  nearest neighbour in the model's input embedding table.
* :func:`lar_rank`: the local activation rate counted in a real forward of a (placed) model at
  EP = D. ``dp`` (TP = 1): Algorithm 2 assigns each request to a rank (round-robin for tables
  without a token table), the rank runs it, and an activation is local when its expert lives on
  that rank. ``tp`` (TP = EP = D, the served attention-TP path): attention is tensor-parallel with
  the activations replicated outside the experts, as the server runs it, and
  ``moe_variants.semmoe.attention_tp`` re-batches each MoE layer's tokens by Algorithm 3 (tables
  without a token table: contiguous slices, the sequence-parallel split) inside the shuffled
  reduce-scatter of attention's un-reduced output; the MoE runs on each rank's rows with the real
  EP all-to-all and the shuffled all-gather restores the order. The dispatchers' own byte
  counters give a second count of the remote activations.

Shape legend: ``L`` MoE layers, ``N`` experts, ``K`` top-k, ``S`` padded sequence, ``B`` batch,
``T`` tokens of a forward (``S * B`` flattened in megatron's ``[s, b]`` order), ``D`` EP ranks,
``H`` hidden, ``V`` vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from moe_variants.common.moe_layer import comm_totals, reset_comm_counters
from moe_variants.common.routing import LocalActivationCounter, RouteRecorder
from megatron.common import collectives
from megatron.common.cli import UserError
from moe_variants.semmoe.placement import gather_embedding

__all__ = [
    "Prompt",
    "read_prompts",
    "encode_prompts",
    "pack_batches",
    "RunOptions",
    "profile_rank",
    "lar_rank",
]


# ------------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str


def read_prompts(path: str, limit: Optional[int] = None) -> list[Prompt]:
    """Prompts of a JSONL file: one object per line with a string ``text`` (and optionally ``id``).

    The first ``limit`` prompts when given. A missing file, a bad line or an empty file is a one-line
    ``UserError`` naming the file (and line).
    """
    out: list[Prompt] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UserError(f"--data {path}: cannot read prompts ({e.strerror or e})") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"--data {path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise UserError(f"--data {path}:{lineno}: expected an object with a string \"text\"")
            out.append(Prompt(str(rec.get("id", f"{lineno}")), rec["text"]))
    if not out:
        raise UserError(f"--data {path}: no prompts")
    return out


def encode_prompts(prompts: list[Prompt], tokenizer, max_tokens: int) -> list[np.ndarray]:
    """[R] int64 token ids of each prompt, truncated to ``max_tokens`` (possibly empty)."""
    ids = tokenizer.tokenize_batch([p.text for p in prompts]) if hasattr(tokenizer, "tokenize_batch") else [
        tokenizer.tokenize(p.text) for p in prompts]  # fmt: skip
    return [np.asarray(t[:max_tokens], dtype=np.int64) for t in ids]


def pack_batches(indices: list[int], lengths: np.ndarray, batch_tokens: int) -> list[list[int]]:
    """Group requests into batches of at most ``batch_tokens`` padded tokens (B x longest),
    longest first so that padding stays small; a request longer than the budget goes alone."""
    order = sorted(indices, key=lambda i: (-int(lengths[i]), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = int(lengths[current[0]]) if current else int(lengths[i])
        if current and (len(current) + 1) * longest > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def resolve_max_tokens(model_cfg, requested: Optional[int], multiple: int) -> int:
    """Longest request the model takes: ``--max-tokens`` or its context, such that the padded
    length (a multiple of TP for sequence parallelism) stays within the position table."""
    context = model_cfg.max_position_embeddings or model_cfg.seq_length
    limit = context // multiple * multiple
    if requested is None:
        return limit
    if requested < 1:
        raise UserError(f"--max-tokens must be >= 1, got {requested}")
    if requested > limit:
        raise UserError(f"--max-tokens {requested} exceeds the model's context ({context} positions)")
    return requested


def _forward(model, tokens: torch.Tensor):
    """Logits of a GPTModel for right-padded ``tokens`` [B, S] (explicit causal mask)."""
    from moe_variants.builder import causal_attention_mask

    seq = tokens.shape[1]
    positions = torch.arange(seq, device=tokens.device)[None].expand_as(tokens)
    return model(tokens, positions, causal_attention_mask(seq, device=tokens.device))


def _batch_tensor(ids: list[np.ndarray], seq: int) -> torch.Tensor:
    out = torch.zeros((len(ids), seq), dtype=torch.long)
    for j, t in enumerate(ids):
        out[j, : len(t)] = torch.from_numpy(t)
    return out


# ------------------------------------------------------------------------------------- running


@dataclass
class RunOptions:
    """What ``profile`` / ``lar`` run: a checkpoint at a layout over a prompts file."""

    load: str
    data: str
    tensor_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    max_tokens: Optional[int] = None
    batch_tokens: int = 2048
    limit: Optional[int] = None
    seed: int = 1234

    def parallel(self):
        from moe_variants.config import ParallelConfig

        return ParallelConfig(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _load(opts: RunOptions):
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel

    parallel = opts.parallel()
    pgc = initialize_parallel(parallel, seed=opts.seed)
    model, configs, tokenizer, manifest = load_model(opts.load, parallel=parallel, pg_collection=pgc)
    return model, configs, tokenizer, manifest, pgc


def profile_rank(opts: RunOptions):
    """Run on every rank; returns the :class:`Profile` on global rank 0 and None elsewhere."""
    from megatron.core import parallel_state

    from moe_variants.semmoe.profile import extend_vocabulary, profile_from_traces

    model, configs, tokenizer, manifest, pgc = _load(opts)
    tp = opts.tensor_model_parallel_size
    max_tokens = resolve_max_tokens(configs.model, opts.max_tokens, tp)
    prompts = read_prompts(opts.data, opts.limit)
    ids = encode_prompts(prompts, tokenizer, max_tokens)
    lengths = np.array([len(t) for t in ids])
    keep = [i for i in range(len(ids)) if lengths[i] > 0]
    if not keep:
        raise UserError(f"--data {opts.data}: every prompt tokenizes to nothing")
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    schedules = [pack_batches(keep[r::dp_size], lengths, opts.batch_tokens) for r in range(dp_size)]
    num_steps = max(len(s) for s in schedules)
    mine = schedules[dp_rank]
    recorder = RouteRecorder(model)
    traces: dict[int, np.ndarray] = {}
    route_dtype = np.uint8 if recorder.num_experts <= 256 else np.int32
    with torch.no_grad(), recorder:
        for step in range(num_steps):
            batch = mine[step] if step < len(mine) else []
            seq = _round_up(int(max((lengths[i] for i in batch), default=1)), tp)
            tokens = _batch_tensor([ids[i] for i in batch] or [np.zeros(1, dtype=np.int64)], seq)
            _forward(model, tokens)
            topk = torch.stack(recorder.take(pgc.tp))  # [L, S*B, K]
            topk = topk.view(topk.shape[0], seq, tokens.shape[0], -1).numpy()
            for j, i in enumerate(batch):
                traces[i] = topk[:, : lengths[i], j, :].astype(route_dtype)
    contribution = traces if parallel_state.get_tensor_model_parallel_rank() == 0 else {}
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    collectives.gather_object(contribution, gathered, dst=0)
    vocab = int(tokenizer.vocab_size)
    embedding = gather_embedding(model, pgc, vocab)
    if rank != 0:
        return None
    routes: dict[int, np.ndarray] = {}
    for part in gathered:
        routes.update(part)
    assert sorted(routes) == keep, "every kept prompt is traced exactly once"
    meta = {
        "model": opts.load,
        "iteration": manifest.get("iteration"),
        "hidden_size": int(configs.model.hidden_size),
        "data": opts.data,
        "max_tokens": max_tokens,
        "num_prompts": len(prompts),
        "num_skipped_empty": len(prompts) - len(keep),
        "request_ids": [prompts[i].id for i in keep],
        "parallel": {"tp": tp, "ep": opts.expert_model_parallel_size, "world": dist.get_world_size()},
    }
    profile = profile_from_traces(((ids[i], routes[i]) for i in keep), vocab, recorder.num_experts, meta)
    return extend_vocabulary(profile, embedding)


# ------------------------------------------------------------------------ measured LAR (lar)


def lar_rank(opts: RunOptions, tables_path: str, mode: str) -> Optional[dict]:
    """Measured LAR of the checkpoint at EP = D (the tables' D) on the prompts; dict on rank 0.

    Per request: activations of its real tokens whose expert lives on the device that holds the
    token (``dp``: the request's rank; ``tp``: the rank Algorithm 3 put the token on before that
    layer). Also counts, over every token forwarded (padding and lockstep dummies included), the
    remote activations seen by the routers and the rows the dispatchers actually sent, which
    must agree.
    """
    from moe_variants.semmoe.placement import check_tables_match_checkpoint
    from moe_variants.semmoe.scheduling import schedule_requests
    from moe_variants.semmoe.tables import load_tables

    tables = load_tables(tables_path)
    model, configs, tokenizer, manifest, pgc = _load(opts)
    check_tables_match_checkpoint(tables, manifest, tables_path, opts.load)
    d = tables.num_devices
    tp = d if mode == "tp" else 1
    if dist.get_world_size() != d or opts.expert_model_parallel_size != d or opts.tensor_model_parallel_size != tp:
        raise UserError(f"lar --mode {mode} runs at TP = {tp} and EP = world = the tables' D ({d})")
    rank = dist.get_rank(pgc.ep)
    max_tokens = resolve_max_tokens(configs.model, opts.max_tokens, d if mode == "tp" else 1)
    prompts = read_prompts(opts.data, opts.limit)
    ids = encode_prompts(prompts, tokenizer, max_tokens)
    lengths = np.array([len(t) for t in ids])
    keep = [i for i in range(len(ids)) if lengths[i] > 0]
    counter = LocalActivationCounter(model, rank, d)
    recorder = counter.recorder
    n_exp, k, num_layers = recorder.num_experts, recorder.top_k, len(recorder.layers)
    if tables.expert2device.shape != (num_layers, n_exp):
        raise UserError(f"--tables are for {tables.expert2device.shape} layers x experts, the model has "
                        f"{(num_layers, n_exp)}")  # fmt: skip
    local = np.zeros(len(ids), dtype=np.int64)  # this rank's local activations per request
    per_layer = np.zeros(num_layers, dtype=np.int64)
    seen_remote = 0  # remote (token, expert) rows over every forwarded token, pads included
    reset_comm_counters(model)
    with torch.no_grad(), counter:
        if mode == "dp":
            if tables.has_schedule:
                req_dev = schedule_requests([ids[i] for i in keep], tables)
            else:
                req_dev = np.arange(len(keep)) % d
            schedules = [pack_batches([i for i, r in zip(keep, req_dev) if r == q], lengths, opts.batch_tokens)
                         for q in range(d)]  # fmt: skip
            mine = schedules[rank]
            for step in range(max(len(s) for s in schedules)):
                batch = mine[step] if step < len(mine) else []
                seq = int(max((lengths[i] for i in batch), default=1))
                tokens = _batch_tensor([ids[i] for i in batch] or [np.zeros(1, dtype=np.int64)], seq)
                _forward(model, tokens)
                real_BS = torch.zeros(tokens.shape, dtype=torch.bool)
                for j, i in enumerate(batch):
                    real_BS[j, : lengths[i]] = True
                local_LB = counter.count(real_BS)
                for j, i in enumerate(batch):
                    local[i] += int(local_LB[:, j].sum())
            per_layer = counter.local.copy()
            seen_remote = counter.remote_all
        elif mode == "tp":
            from megatron.inference.engine import replicate_activations
            from moe_variants.semmoe.attention_tp import install

            replicate_activations(model)  # the server's attention-TP layout
            state = install(model, tables, pgc.tp)
            for i in keep:
                n = int(lengths[i])
                state.num_real = n  # the padding to a multiple of D fills the free slots
                before = int(counter.local.sum())
                _forward(model, _batch_tensor([ids[i]], _round_up(n, d)))
                counter.count_layers([state.local_rows(layer, n) for layer in range(num_layers)])
                local[i] = int(counter.local.sum()) - before
            per_layer = counter.local.copy()
            seen_remote = counter.remote_all
        else:
            raise ValueError(f"--mode {mode!r}: expected dp or tp")
    totals = comm_totals(model)
    dispatch_bytes, combine_bytes = int(totals["bytes_dispatch"]), int(totals["bytes_combine"])
    totals = torch.tensor([seen_remote, dispatch_bytes, combine_bytes], dtype=torch.float64)
    collectives.all_reduce(totals)
    counts = torch.from_numpy(np.concatenate([local, per_layer])).double()
    collectives.all_reduce(counts)
    if dist.get_rank() != 0:
        return None
    local = counts[: len(ids)].numpy().astype(np.int64)[keep]
    per_layer = counts[len(ids):].numpy().astype(np.int64)
    total = lengths[keep] * k * num_layers
    lar_req = local / total
    p25, p50, p75 = np.percentile(lar_req, [25, 50, 75])
    elem = torch.finfo(next(model.parameters()).dtype).bits // 8
    row_bytes = int(configs.model.hidden_size) * elem
    return {
        "checkpoint": opts.load,
        "tables": tables_path,
        "method": tables.method,
        "mode": mode,
        "num_devices": d,
        "scheduled": tables.has_schedule,
        "hidden_size": int(configs.model.hidden_size),
        "num_requests": len(keep),
        "num_tokens": int(lengths[keep].sum()),
        "lar": float(local.sum() / total.sum()),
        "lar_p25": float(p25),
        "lar_p50": float(p50),
        "lar_p75": float(p75),
        "total_activations": int(total.sum()),
        "remote_activations": int(total.sum() - local.sum()),
        "lar_per_layer": (per_layer / (lengths[keep].sum() * k)).tolist(),
        "observed_remote_rows_all_tokens": int(totals[0]),
        "dispatch_bytes": int(totals[1]),
        "combine_bytes": int(totals[2]),
        "dispatch_rows": int(totals[1]) // row_bytes,
        "max_tokens": max_tokens,
        "request_ids": [prompts[i].id for i in keep],
    }
