"""The lm-eval adapter against direct computations from our model's logits, and EP=2 against EP=1.

Tolerances: scores are fp32 sums of a few dozen log-probabilities. The adapter runs requests in
right-padded batches and the references run one unpadded sequence; different batch shapes change
the GEMM blocking, and EP=2 changes the expert GEMM row blocking (tests/foundation), which moves
each log-probability by ~1e-6. ``atol=1e-4`` on the sums is far below any difference a bug in
which tokens are scored would make (one token is several nats). Greedy flags and generated text
must be identical: the tiny models have peaked distributions (conftest), so argmax never hinges
on last-bit rounding.
"""

import pytest

try:
    import lm_eval  # noqa: F401
except ImportError:
    pytest.skip('lm-eval is not importable (pip install -e ".[eval]")', allow_module_level=True)

import torch  # noqa: E402

# imported here, in the pytest process, so that the forked ranks inherit the modules instead of
# each importing megatron-core's model code again (most of a rank's start-up time)
import megatron.training.lm_eval_adapter  # noqa: E402,F401
import megatron.components.loading  # noqa: E402,F401
import moe_variants.builder  # noqa: E402,F401
import moe_variants.bigmac.layer  # noqa: E402,F401
import moe_variants.farskip  # noqa: E402,F401
from tools.spawn import run_distributed  # noqa: E402
from tests.eval.conftest import SEQ_LENGTH  # noqa: E402

ATOL = 1e-4

PAIRS = [
    ("Hello there", " friend"),
    ("", "First Citizen"),  # empty context: scored after the EOD token
    ("To be or not to be, " * 8, "that is the question"),  # longer than seq_length: left-truncated
    ("ROMEO:", " But soft, what light through yonder window breaks? " * 4),  # continuation > seq_length
    ("a", "b"),
]
DOC = "Now is the winter of our discontent made glorious summer by this sun of York. " * 6
PROMPTS = ["Hello", "ROMEO:\nWhat", "Once upon a time there was a king " * 3, "First Citizen:\nBefore we proceed"]


def _instances(kind, args_list):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def _lm(path, **kwargs):
    from megatron.training.lm_eval_adapter import MegatronCheckpointLM

    return MegatronCheckpointLM.from_checkpoint(path, **kwargs)


def _logits(lm, tokens):
    """Logits [S, V] of one unpadded sequence (the reference forward)."""
    from moe_variants.builder import causal_attention_mask

    t = torch.tensor([tokens])
    with torch.no_grad():
        out = lm.model(t, torch.arange(len(tokens))[None], causal_attention_mask(len(tokens)),
                       runtime_gather_output=True)
    return out[0, :, :lm.tokenizer.vocab_size].float()


def _direct_loglikelihood(lm, context, continuation):
    """Sum of log-softmax of the continuation tokens from one forward of context + continuation
    (the last seq_length + 1 tokens), computed without the adapter's batching code; tokenized as
    lm-eval specifies (the continuation's ids are those of the whole after the context's)."""
    tokenizer = lm.tokenizer
    stripped = context.rstrip()  # lm-eval moves a context's trailing spaces into the continuation
    context, continuation = stripped, context[len(stripped):] + continuation
    if context:
        whole = tokenizer.tokenize(context + continuation)
        ctx = tokenizer.tokenize(context)
        cont = whole[len(ctx):]
    else:
        ctx, cont = [tokenizer.eod], tokenizer.tokenize(continuation)
    tokens = (ctx + cont)[-(SEQ_LENGTH + 1):]
    n = min(len(cont), len(tokens) - 1)
    if n == 0:  # e.g. "a" + "b" tokenizes as one token: nothing of the continuation to score
        return 0.0, True
    logp = torch.log_softmax(_logits(lm, tokens[:-1]), -1)[-n:]
    target = torch.tensor(tokens[-n:])
    return float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all())


def _direct_rolling(lm, text):
    """Every token of ``[EOD] + text`` after the first scored once: chunk k predicts tokens
    (kL, (k+1)L] from the L tokens before its last prediction (full context for the last chunk)."""
    seq = [lm.tokenizer.eod] + lm.tokenizer.tokenize(text)
    total, scored, L = 0.0, 0, SEQ_LENGTH
    for a in range(0, len(seq) - 1, L):
        e = min(a + L, len(seq) - 1)  # predict seq[a+1 .. e]
        start = max(0, e - L)
        logp = torch.log_softmax(_logits(lm, seq[start:e]), -1)
        k = e - a
        total += float(logp[-k:].gather(-1, torch.tensor(seq[a + 1:e + 1])[:, None]).sum())
        scored += k
    assert scored == len(seq) - 1
    return total


def _direct_greedy(lm, prompt_text, max_new):
    """Greedy decoding by full forwards over the last seq_length tokens; stops at EOD."""
    tokens = lm.tokenizer.tokenize(prompt_text)[-SEQ_LENGTH:]
    out = []
    for _ in range(max_new):
        nxt = int(_logits(lm, tokens[-SEQ_LENGTH:])[-1].argmax())
        if nxt == lm.tokenizer.eod:
            break
        out.append(nxt)
        tokens.append(nxt)
    return lm.tokenizer.detokenize(out)


def _check_scores(rank, world_size, path, batch_size):
    lm = _lm(path, batch_size=batch_size)
    got = lm.loglikelihood(_instances("loglikelihood", PAIRS))
    want = [_direct_loglikelihood(lm, c, k) for c, k in PAIRS]
    # a continuation equal to the model's own greedy token must be reported greedy
    ctx = "Hello there"
    greedy_tok = int(_logits(lm, lm.tokenizer.tokenize(ctx))[-1].argmax())
    (_, is_greedy), = lm.loglikelihood(_instances("loglikelihood", [(ctx, lm.tokenizer.detokenize([greedy_tok]))]))
    rolling = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(DOC,), ("",), ("Short.",)]))
    want_rolling = [_direct_rolling(lm, DOC), 0.0, _direct_rolling(lm, "Short.")]
    return got, want, is_greedy, rolling, want_rolling, len(lm.tok_encode(DOC))


@pytest.mark.parametrize("variant", ["standard", "farskip", "bigmac"])
def test_loglikelihood_and_rolling_match_direct_computation(ckpt_dir, variant):
    got, want, is_greedy, rolling, want_rolling, doc_tokens = run_distributed(
        _check_scores, 1, ckpt_dir[variant], 2)[0]
    assert doc_tokens > 3 * SEQ_LENGTH  # the document spans several windows
    for (g, g_greedy), (w, w_greedy) in zip(got, want):
        assert g == pytest.approx(w, abs=ATOL)
        assert g_greedy == w_greedy
    assert got[2][0] != pytest.approx(got[0][0], abs=1.0)  # distinct requests, distinct scores
    assert is_greedy
    assert rolling == pytest.approx(want_rolling, abs=ATOL)


def _check_generation(rank, world_size, path, mode):
    lm = _lm(path, batch_size=3, generation=mode)
    # reference continuations (12 tokens) and a stop string taken from the middle of each
    full = [_direct_greedy(lm, p, 12) for p in PROMPTS]
    stops = [text[len(text) // 2:len(text) // 2 + 2] for text in full]
    plain = lm.generate_until(_instances("generate_until", [(p, {"until": [], "max_gen_toks": 12}) for p in PROMPTS]))
    stopped = lm.generate_until(_instances(
        "generate_until", [(p, {"until": [s], "max_gen_toks": 12}) for p, s in zip(PROMPTS, stops)]))
    # a prompt that nearly fills seq_length: decoding crosses it (cache -> sliding-window recompute)
    long_prompt = "Once upon a time there was a king " * 5
    crossing = lm.generate_until(_instances("generate_until", [(long_prompt, {"until": [], "max_gen_toks": 8})]))
    return lm.generation.value, full, stops, plain, stopped, crossing, _direct_greedy(lm, long_prompt, 8)


@pytest.mark.parametrize("variant,mode", [("standard", "kv_cache"), ("standard", "recompute"),
                                          ("bigmac", "auto"), ("farskip", "auto"), ("farskip", "recompute")])
def test_generate_until_matches_direct_greedy_loop(ckpt_dir, variant, mode):
    used, full, stops, plain, stopped, crossing, want_crossing = run_distributed(
        _check_generation, 1, ckpt_dir[variant], mode)[0]
    if mode == "auto":  # FarSkip decodes with the KV cache too: token-identical to the direct loop
        assert used == "kv_cache"
    assert plain == full
    assert all(full), full
    for text, stop, got in zip(full, stops, stopped):
        assert stop and stop in text
        assert got == text.split(stop)[0]
        assert stop not in got
    assert crossing == [want_crossing]


def _overlapped_decoding(rank, world_size, path, mode):
    from moe_variants.common import comm
    from moe_variants.common.moe_layer import comm_counters

    lm = _lm(path, batch_size=2, expert_model_parallel_size=2, generation=mode)
    timeline = comm.TimelineRecorder()
    for counters in comm_counters(lm.model):
        counters.timeline = timeline
    gen = lm.generate_until(_instances("generate_until", [(p, {"until": [], "max_gen_toks": n})
                                                          for p, n in zip(PROMPTS, [6, 9, 2, 7])]))
    # the schedule, not a timing: the shared expert of some layer started while its dispatch was in
    # flight (after the launch, before the completion or the wait)
    dispatches = [(e[2], e[3]) for e in timeline.events if e[1] == "comm" and e[0] == "dispatch"]
    shared = [e[2] for e in timeline.events if e[1] == "compute" and e[0].startswith("shared expert")]
    overlapped = any(start <= s <= end for s in shared for start, end in dispatches)
    return lm.generation.value, gen, overlapped


def test_farskip_overlapped_kv_decoding_at_ep2_equals_simple(ckpt_dir):
    """FarSkip's overlapped inference schedule (attention over the KV cache while the previous
    combine flies, the shared expert while the dispatch flies) gives the tokens of the blocking
    schedule and of full recompute at EP=2: same additions in the same order (exact)."""
    ckpts = ckpt_dir
    simple = run_distributed(_overlapped_decoding, 2, ckpts["farskip"], "kv_cache")
    overlapped = run_distributed(_overlapped_decoding, 2, ckpts["farskip-overlapped"], "kv_cache")
    recompute = run_distributed(_overlapped_decoding, 2, ckpts["farskip-overlapped"], "recompute")
    for rank in range(2):
        assert overlapped[rank][0] == "kv_cache" and recompute[rank][0] == "recompute"
        assert overlapped[rank][1] == simple[rank][1] == recompute[rank][1]
        assert all(overlapped[rank][1])
    assert any(o[2] for o in overlapped) and not any(s[2] for s in simple)


def _all_requests(rank, world_size, path, ep, tp, mode):
    lm = _lm(path, batch_size=2, expert_model_parallel_size=ep, tensor_model_parallel_size=tp, generation=mode)
    # 5 pairs at batch size 2 -> 3 batches: on 2 data-parallel ranks one rank runs a dummy forward
    ll = lm.loglikelihood(_instances("loglikelihood", PAIRS))
    rolling = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(DOC,), ("Short.",), (DOC[:90],)]))
    # different budgets -> ranks finish decoding at different steps
    gen = lm.generate_until(_instances("generate_until", [(p, {"until": [], "max_gen_toks": n})
                                                          for p, n in zip(PROMPTS, [3, 9, 1, 6])]))
    return ll, rolling, gen


def test_expert_parallel_two_ranks_equals_one_rank(ckpt_dir):
    one = run_distributed(_all_requests, 1, ckpt_dir["standard"], 1, 1, "auto")[0]
    two = run_distributed(_all_requests, 2, ckpt_dir["standard"], 2, 1, "auto")
    assert two[0] == two[1]  # every rank returns every result
    (ll1, roll1, gen1), (ll2, roll2, gen2) = one, two[0]
    assert [s for s, _ in ll2] == pytest.approx([s for s, _ in ll1], abs=ATOL)
    assert [g for _, g in ll2] == [g for _, g in ll1]
    assert roll2 == pytest.approx(roll1, abs=ATOL)
    assert gen2 == gen1


def test_tensor_parallel_two_ranks_equals_one_rank(ckpt_dir):
    """TP=2 (sequence parallel, vocabulary-parallel logits gathered, generation by recompute)."""
    one = run_distributed(_all_requests, 1, ckpt_dir["standard"], 1, 1, "recompute")[0]
    two = run_distributed(_all_requests, 2, ckpt_dir["standard"], 1, 2, "auto")
    (ll1, roll1, gen1), (ll2, roll2, gen2) = one, two[0]
    assert [s for s, _ in ll2] == pytest.approx([s for s, _ in ll1], abs=ATOL)
    assert roll2 == pytest.approx(roll1, abs=ATOL)
    assert gen2 == gen1


def test_pure_helpers():
    from megatron.training.lm_eval_adapter import continuation_score, greedy_stop, scoring_window

    assert scoring_window([1, 2, 3], [4, 5], 10) == ([1, 2, 3, 4, 5], 2)
    assert scoring_window([1, 2, 3], [4, 5], 3) == ([2, 3, 4, 5], 2)
    assert scoring_window([1], [2, 3, 4, 5], 2) == ([3, 4, 5], 2)  # only 2 predictable tokens
    logits = torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    score, greedy = continuation_score(logits, torch.tensor([1, 0]))
    want = float(torch.log_softmax(logits, -1)[0, 1] + torch.log_softmax(logits, -1)[1, 0])
    assert score == pytest.approx(want, abs=1e-6) and greedy
    assert not continuation_score(logits, torch.tensor([1, 2]))[1]
    # a long window sums its fp32 log-probs in fp64, as lm-eval sums a served model's: an fp32 sum of
    # these 2000 is 5e-4 off (its rounding step near -15700 is 1e-3)
    logits = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0)) * 3
    targets = torch.randint(0, 64, (2000,), generator=torch.Generator().manual_seed(1))
    per_token = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
    assert continuation_score(logits, targets)[0] == pytest.approx(sum(per_token.tolist()), abs=1e-9)
    assert abs(float(per_token.sum()) - sum(per_token.tolist())) > 1e-5  # what an fp32 sum would give
    assert greedy_stop("abc\n\ndef", ["\n\n"]) == ("abc", True)
    assert greedy_stop("abcdef", ["x", "", "cd"]) == ("ab", True)
    assert greedy_stop("abc", ["x"]) == ("abc", False)


def _mismatched_requests(rank, world_size, path):
    lm = _lm(path, expert_model_parallel_size=2)
    pairs = PAIRS if rank == 0 else PAIRS[:-1]
    try:
        lm.loglikelihood(_instances("loglikelihood", pairs))
    except RuntimeError as err:
        return str(err)
    return None


def test_ranks_with_different_requests_raise_instead_of_hanging(ckpt_dir):
    errors = run_distributed(_mismatched_requests, 2, ckpt_dir["standard"], timeout_s=120)
    assert all(e and "different requests" in e for e in errors)


def _by_length_parity(token_lists):
    return [len(t) % 2 for t in token_lists]


def _all_to_rank_one(token_lists):
    return [1] * len(token_lists)


def _scheduled_requests(rank, world_size, path, scheduler):
    lm = _lm(path, batch_size=2, expert_model_parallel_size=2, request_scheduler=scheduler)
    ll = lm.loglikelihood(_instances("loglikelihood", PAIRS))
    rolling = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(DOC,), ("Short.",), (DOC[:90],)]))
    gen = lm.generate_until(_instances("generate_until", [(p, {"until": [], "max_gen_toks": n})
                                                          for p, n in zip(PROMPTS, [3, 9, 1, 6])]))
    return (ll, rolling, gen), lm._ranks.assigned


@pytest.mark.parametrize("scheduler", [_by_length_parity, _all_to_rank_one])
def test_request_scheduler_moves_requests_between_ranks_not_scores(ckpt_dir, scheduler):
    """A request scheduler (Sem-MoE's Algorithm 2 in evaluate_lm) only decides which data-parallel
    rank runs a request: every score and generation equals the round-robin run's (a rank may get
    nothing and run lockstep dummies only)."""
    base = run_distributed(_all_requests, 2, ckpt_dir["standard"], 2, 1, "auto")[0]
    got = run_distributed(_scheduled_requests, 2, ckpt_dir["standard"], scheduler)
    (ll, roll, gen), assigned = got[0]
    assert got[1][0] == got[0][0] and got[1][1] == assigned  # every rank agrees
    assert [s for s, _ in ll] == pytest.approx([s for s, _ in base[0]], abs=ATOL)
    assert [g for _, g in ll] == [g for _, g in base[0]]
    assert roll == pytest.approx(base[1], abs=ATOL)
    assert gen == base[2]
    if scheduler is _all_to_rank_one:
        assert assigned[0] == 0 and assigned[1] > 0


def _bad_scheduler(rank, world_size, path):
    lm = _lm(path, expert_model_parallel_size=2, request_scheduler=lambda toks: [2] * len(toks))
    try:
        lm.loglikelihood(_instances("loglikelihood", PAIRS))
    except ValueError as err:
        return str(err)
    return None


def test_a_scheduler_naming_a_missing_rank_is_refused(ckpt_dir):
    errors = run_distributed(_bad_scheduler, 2, ckpt_dir["standard"], timeout_s=120)
    assert all(e and "rank in [0, 2)" in e for e in errors)
