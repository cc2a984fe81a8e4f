"""FCSD: the losses equal direct computations (also with the vocabulary split over TP=2), the
early-stopping logic, and the distillation job keeps its teacher frozen."""


import pytest
import torch
import torch.nn.functional as F

from distill.early_stopping import EarlyStopping
from distill.losses import hidden_state_l2, kl_divergence
from tools.spawn import run_distributed


def _direct_kl(student, teacher, mask, temperature=1.0):
    log_s = F.log_softmax(student.double() / temperature, -1)
    log_t = F.log_softmax(teacher.double() / temperature, -1)
    per_token = (log_t.exp() * (log_t - log_s)).sum(-1)
    return float((per_token * mask).sum() / mask.sum()) * temperature**2


def _logits(seed, shape=(2, 5, 16)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * 3


def test_kl_equals_direct_computation():
    """fp32 vs a float64 reference: rtol 1e-5."""
    s, t = _logits(0), _logits(1)
    mask = torch.tensor([[1, 1, 1, 0, 1], [1, 0, 1, 1, 1]], dtype=torch.float)
    for temp in (1.0, 2.0):
        got = float(kl_divergence(s, t, mask, temperature=temp, group=None))
        assert got == pytest.approx(_direct_kl(s, t, mask, temp), rel=1e-5)
    assert float(kl_divergence(t, t, mask, group=None)) == pytest.approx(0.0, abs=1e-6)


def _tp_kl(rank, world):
    from megatron.core import parallel_state

    from moe_variants.config import ParallelConfig
    from megatron.components.parallel import initialize_parallel

    initialize_parallel(ParallelConfig(tensor_model_parallel_size=2), seed=1)
    s, t = _logits(0), _logits(1)
    mask = torch.ones(2, 5)
    shard = slice(rank * 8, (rank + 1) * 8)
    s_local = s[..., shard].clone().requires_grad_(True)
    kl = kl_divergence(s_local, t[..., shard], mask)
    kl.backward()
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    return float(kl), s_local.grad


def test_kl_under_tp2_vocab_sharding():
    """Each TP rank holds half the vocabulary: the loss equals the unsharded one on both ranks and
    each rank's gradient is its slice of the unsharded gradient (fp32: atol 1e-6)."""
    s, t = _logits(0).requires_grad_(True), _logits(1)
    ref = kl_divergence(s, t, torch.ones(2, 5), group=None)
    ref.backward()
    results = run_distributed(_tp_kl, 2)
    for rank, (value, grad) in enumerate(results):
        assert value == pytest.approx(float(ref), rel=1e-5)
        torch.testing.assert_close(grad, s.grad[..., rank * 8:(rank + 1) * 8], atol=1e-6, rtol=1e-5)


def test_hidden_state_l2():
    a = [torch.ones(3, 2, 4), torch.zeros(3, 2, 4)]
    b = [torch.zeros(3, 2, 4), torch.zeros(3, 2, 4)]
    assert float(hidden_state_l2(a, b)) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        hidden_state_l2(a, b[:1])


def test_early_stopping_patience_and_delta():
    es = EarlyStopping(patience=2, min_delta=0.1)
    assert es.update(1, 10.0) == (True, False)
    assert es.update(2, 9.5) == (True, False)  # a new best, but less than 10% better: patience 1/2
    assert es.update(3, 9.6) == (False, True)  # no gain again: stop, best stays at step 2
    assert es.best_step == 2 and es.best == 9.5
    es = EarlyStopping(patience=2, min_delta=0.1)
    es.update(1, 10.0)
    assert es.update(2, 8.0) == (True, False)  # 20% better resets the patience
    assert es.update(3, float("nan")) == (False, False)
    assert es.update(4, 8.5) == (False, True)
    with pytest.raises(ValueError):
        EarlyStopping(patience=0)


def test_early_stopping_higher_is_better():
    """``mode="max"`` (accuracy proxies): a rise is an improvement, the delta is relative to the
    last significant value, and a fall never makes a new best."""
    es = EarlyStopping(patience=2, min_delta=0.1, mode="max")
    assert es.update(1, 0.50) == (True, False)
    assert es.update(2, 0.40) == (False, False)  # worse: patience 1/2
    assert es.update(3, 0.60) == (True, False)  # +20% of 0.5: resets the patience
    assert es.update(4, 0.62) == (True, False)  # a new best but < 10% of 0.6: patience 1/2
    assert es.update(5, 0.61) == (False, True)
    assert (es.best, es.best_step) == (0.62, 4)
    es = EarlyStopping(patience=1, min_delta=0.0, mode="max")
    es.update(1, 0.0)
    assert es.update(2, 0.25) == (True, False)  # from a zero reference any rise counts
    with pytest.raises(ValueError, match="mode"):
        EarlyStopping(mode="up")


def test_lm_eval_proxy_metric_and_direction():
    """The proxy's metric and direction come from the task's ``higher_is_better``."""
    from distill.fcsd import FCSDConfig, _lm_eval_proxy_metric
    from distill.scoring import LMEvalSpec

    spec = LMEvalSpec(["arc", "wiki", "gen"], manager=None, higher_is_better={
        "arc": {"acc": True, "acc_norm": True}, "wiki": {"word_perplexity": False, "bits_per_byte": False},
        "gen": {"pass@1": True}})
    cfg = lambda task, metric=None: FCSDConfig(proxy="lm-eval", proxy_task=task, proxy_metric=metric)
    assert _lm_eval_proxy_metric(cfg("arc"), spec) == ("acc_norm,none", True)
    assert _lm_eval_proxy_metric(cfg("arc", "acc"), spec) == ("acc,none", True)
    assert _lm_eval_proxy_metric(cfg("wiki"), spec) == ("word_perplexity,none", False)
    assert _lm_eval_proxy_metric(cfg("wiki", "bits_per_byte"), spec) == ("bits_per_byte,none", False)
    assert _lm_eval_proxy_metric(cfg("gen", "pass@1,create_test"), spec) == ("pass@1,create_test", True)
    with pytest.raises(ValueError, match="pass --proxy-metric"):
        _lm_eval_proxy_metric(cfg("gen"), spec)
    with pytest.raises(ValueError, match="not a metric of arc"):
        _lm_eval_proxy_metric(cfg("arc", "f1"), spec)
    with pytest.raises(ValueError, match="applies to --proxy lm-eval only"):
        FCSDConfig(proxy="heldout-kl", proxy_task="arc")


def _scores_keep_rng(rank, world, data_dir, include_path):
    import random

    import numpy as np

    from distill.scoring import lm_eval_scores, make_lm_eval_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from moe_variants.config import ParallelConfig
    from moe_variants.builder import build_model
    from megatron.components.parallel import initialize_parallel
    from megatron.components.tokenizer import DEFAULT_TOKENIZER_MODEL, build_tokenizer
    from tests.helpers import tiny_model_config

    initialize_parallel(ParallelConfig(), seed=3)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    tokenizer = build_tokenizer("HuggingFaceTokenizer", DEFAULT_TOKENIZER_MODEL)
    model = build_model(tiny_model_config(seq_length=32), ParallelConfig(), vocab_size=tokenizer.vocab_size,
                        pg_collection=pgc).eval()
    spec = make_lm_eval_spec(["local_arc_easy"], include_path=include_path, data_dir=data_dir, limit=3,
                             batch_size=4, flags=dict.fromkeys(("tasks", "include_path", "data_dir", "limit"), "--x"))

    def draw():
        return torch.rand(3).tolist(), random.random(), float(np.random.rand())

    def seed():
        torch.manual_seed(5), random.seed(5), np.random.seed(5)

    seed()
    expected = draw()
    seed()
    first = lm_eval_scores(model, tokenizer, 32, pgc, spec)
    after = draw()
    return expected, after, first, lm_eval_scores(model, tokenizer, 32, pgc, spec)


def test_lm_eval_scores_restore_rng_and_repeat(tmp_path):
    """lm-eval reseeds python, numpy and torch; ``lm_eval_scores`` hands the caller its own
    random states back (a training run's RNG must not restart at every evaluation), and scoring
    the same model twice gives the same numbers (exact: same batches, same kernels)."""
    import os

    pytest.importorskip("lm_eval")
    from tests.helpers import write_arc_easy

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    data = str(write_arc_easy(tmp_path / "data", 3))
    (expected, after, first, second), = run_distributed(
        _scores_keep_rng, 1, data, os.path.join(repo, "examples", "lm_eval_tasks"))
    assert after == expected
    assert first == second and 0.0 <= first["local_arc_easy"]["acc,none"] <= 1.0


@pytest.mark.slow
def test_step_line_leads_with_what_distillation_optimises():
    """The console step line names its columns truthfully: distillation optimises ``kd`` (plus
    ``l2`` with ``kl+l2``), so that comes first and no ``loss`` (next-token + aux, which it does
    not optimise) is shown; pretraining and ``sft`` lead with ``loss``."""
    from megatron.training.metrics import format_step_line

    base = {"step": 10, "loss": 9.0163, "lm_loss": 9.0093, "aux_loss": 0.007, "lr": 5e-4, "grad_norm": 0.054,
            "tokens_per_sec": 6023.0, "step_time_s": 0.34, "peak_rss_mb": 2090.0}
    assert format_step_line(base, 30).split(" | ")[1:4] == ["loss 9.0163", "lm 9.0093", "aux 0.0070"]
    kd = format_step_line(dict(base, kd_loss=0.0015), 30).split(" | ")
    assert kd[1:4] == ["kd 0.0015", "lm 9.0093", "aux 0.0070"]
    assert not any(part.startswith("loss ") for part in kd)
    kl_l2 = format_step_line(dict(base, kd_loss=0.0015, hidden_l2=0.25), 30).split(" | ")
    assert kl_l2[1:5] == ["kd 0.0015", "l2 0.2500", "lm 9.0093", "aux 0.0070"]


@pytest.mark.slow  # starts processes
def test_distillation_job_keeps_teacher_frozen(teacher_ckpt, student):
    """A short FCSD run (``conftest.student``): the student trains, the saved teacher is
    byte-identical, the teacher's parameters never need gradients, the best checkpoint is kept,
    early stopping reports. No --proxy-text: the proxy scores the training data's validation split."""
    import os

    from tests.distill.conftest import teacher_digest
    from tests.helpers import read_jsonl

    out, proc, before = student
    assert teacher_digest(teacher_ckpt) == before
    records = read_jsonl(out / "metrics.jsonl")
    steps = [r for r in records if "event" not in r]
    assert len(steps) == 4 and all("kd_loss" in r for r in steps)
    assert [r["step"] for r in records if r.get("event") == "valid" and "heldout_kl" in r] == [2, 4]
    best = [n for n in os.listdir(out / "best") if n.startswith("iter_")]
    assert len(best) == 1  # keep_last=1 prunes the earlier best (same lineage)
    assert "student before distillation" in proc.stdout


@pytest.mark.slow  # starts processes
def test_distillation_on_two_agents_equals_one_node(teacher_ckpt, student, tmp_path):
    """The same FCSD run on two torchrun agents (``--nnodes 2``, one rank each, EP=2 spanning them:
    ``scripts/launch_multinode.sh``) logs the one-node run's losses, gradient norms and held-out
    KL. Exact: the same 2 ranks run the same gloo collectives (tests/training/test_multinode.py)."""
    from tests.distill.conftest import fcsd_args
    from tests.helpers import read_jsonl, run_agents

    out = tmp_path / "student"
    codes = run_agents(tmp_path, "distill.fcsd", fcsd_args(teacher_ckpt, out))
    assert codes == [0, 0], "".join(open(tmp_path / f"agent{i}.log").read()[-3000:] for i in range(2))
    one_node = read_jsonl(student[0] / "metrics.jsonl")
    two_agents = read_jsonl(out / "metrics.jsonl")
    fields = ("step", "loss", "kd_loss", "grad_norm", "heldout_kl")
    pick = lambda records: [{k: r[k] for k in fields if k in r} for r in records
                            if "event" not in r or r["event"] == "valid"]
    assert pick(two_agents) == pick(one_node)
    assert len(pick(one_node)) == 6 and all("kd_loss" in r or "heldout_kl" in r for r in pick(one_node))


@pytest.mark.slow
def test_teacher_forward_has_no_trainable_parameters(teacher_ckpt):
    from tools.spawn import run_distributed

    def fn(rank, world, path):
        from moe_variants.config import ParallelConfig
        from megatron.components.loading import load_model
        from megatron.components.parallel import initialize_parallel

        initialize_parallel(ParallelConfig(expert_model_parallel_size=2), seed=1)
        teacher, configs, _, _ = load_model(path, overrides={"farskip": "none"})
        for p in teacher.parameters():
            p.requires_grad_(False)
        return type(teacher.decoder).__name__, all(not p.requires_grad for p in teacher.parameters())

    for name, frozen in run_distributed(fn, 2, str(teacher_ckpt / "teacher")):
        assert name == "TransformerBlock" and frozen


def test_bad_input(capsys, tmp_path):
    from distill.fcsd import main

    assert main(["--farskip", "all"]) == 2
    assert "--load" in capsys.readouterr().err
    assert main(["--load", str(tmp_path / "nothing"), "--farskip", "all"]) == 2
    assert "nothing" in capsys.readouterr().err


@pytest.mark.slow
def test_lm_eval_proxy_drives_early_stopping(teacher_ckpt, tmp_path):
    """``--proxy lm-eval``: the student is scored on an lm-eval task at every evaluation, in
    training, under EP=2, on ``--proxy-limit`` questions; accuracy is higher-is-better; the best
    checkpoint is kept and the teacher's files are byte-identical afterwards."""
    import hashlib
    import os

    pytest.importorskip("lm_eval")
    from tests.helpers import read_jsonl, torchrun, write_arc_easy

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    teacher = teacher_ckpt / "teacher"
    digest = lambda: hashlib.sha256(b"".join(
        p.read_bytes() for p in sorted(teacher.rglob("*")) if p.is_file())).hexdigest()
    before = digest()
    write_arc_easy(tmp_path / "data", 6)
    out = tmp_path / "student"
    proc = torchrun("distill.fcsd", [
        "--load", teacher, "--farskip", "all", "--expert-model-parallel-size", 2, "--save", out,
        "--train-iters", 4, "--eval-interval", 2, "--eval-iters", 0, "--log-interval", 1, "--micro-batch-size", 4,
        "--global-batch-size", 16, "--proxy", "lm-eval", "--proxy-task", "local_arc_easy", "--proxy-metric", "acc",
        "--proxy-limit", 4, "--proxy-include-path", os.path.join(repo, "examples", "lm_eval_tasks"),
        "--proxy-data-dir", tmp_path / "data", "--patience", 5, "--data-cache-path", teacher_ckpt / "cache",
        "--lr", 1e-3])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert digest() == before
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r.get("lm_eval_task") == "local_arc_easy"]
    assert len(evals) == 2
    for r in evals:
        assert r["lm_eval_metric"] == "acc" and r["lm_eval_mode"] == "max" and r["lm_eval_value"] in (0, .25, .5, .75, 1)
    assert evals[-1]["best"] == max(r["lm_eval_value"] for r in evals)
    assert os.path.isdir(out / "best")
    assert '"lm_eval_metric": "acc"' in proc.stdout  # the step-0 (before) score is printed


@pytest.mark.slow
def test_lm_eval_proxy_bad_input(capsys, teacher_ckpt, tmp_path):
    import os

    pytest.importorskip("lm_eval")
    from distill.fcsd import main
    from tests.helpers import write_arc_easy

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = ["--load", str(teacher_ckpt / "teacher"), "--farskip", "all", "--proxy", "lm-eval"]
    assert main(base) == 2
    assert "--proxy-task" in capsys.readouterr().err
    tasks = ["--proxy-task", "local_arc_easy", "--proxy-include-path", os.path.join(repo, "examples", "lm_eval_tasks")]
    assert main(base + tasks + ["--proxy-data-dir", str(tmp_path)]) == 2  # no eval/arc/arc_easy.jsonl there
    err = capsys.readouterr().err
    assert "no such file" in err and err.strip().count("\n") == 0
    data = str(write_arc_easy(tmp_path / "data", 2))
    assert main(base + tasks + ["--proxy-data-dir", data, "--proxy-metric", "f1"]) == 2
    assert "--proxy-metric f1: not a metric of local_arc_easy" in capsys.readouterr().err
    assert main(["--load", str(teacher_ckpt / "teacher"), "--farskip", "all", "--proxy-limit", "3"]) == 2
    assert "applies to --proxy lm-eval only" in capsys.readouterr().err
    assert not (teacher_ckpt / "teacher" / "best").exists()


def test_kd_l2_coeff_must_be_non_negative():
    from distill.fcsd import FCSDConfig

    with pytest.raises(ValueError, match="--kd-l2-coeff must be >= 0"):
        FCSDConfig(kd_loss="kl+l2", kd_l2_coeff=-0.5)
    with pytest.raises(ValueError, match="--kd-l2-coeff"):
        FCSDConfig(kd_l2_coeff=float("nan"))
    assert FCSDConfig(kd_loss="kl+l2", kd_l2_coeff=0.0).kd_l2_coeff == 0.0


def _frozen_names(rank, world):
    from distill.fcsd import _freeze_embeddings
    from moe_variants.config import ParallelConfig
    from tests.helpers import build_and_load, tiny_model_config

    model, _ = build_and_load(tiny_model_config(), ParallelConfig())
    _freeze_embeddings(model)
    return sorted(n for n, p in model.named_parameters() if not p.requires_grad), sum(
        p.requires_grad for p in model.parameters())


def test_freeze_embeddings_freezes_the_embedding_and_output_layer_only():
    from tools.spawn import run_distributed

    frozen, trainable = run_distributed(_frozen_names, 1)[0]
    assert frozen == ["embedding.word_embeddings.weight", "output_layer.weight"]
    assert trainable > 10


def _weights(rank, world, teacher, student):
    from megatron.components.loading import load_model
    from megatron.components.parallel import initialize_parallel
    from moe_variants.config import ParallelConfig

    initialize_parallel(ParallelConfig(), seed=1)
    out = []
    for path in (teacher, student):
        model, *_ = load_model(path, parallel=ParallelConfig())
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


@pytest.mark.slow
def test_kl_l2_with_frozen_embeddings_trains_the_rest(teacher_ckpt):
    """Table 2's "KL + INTER. L2" and "KL * EMBED." flags together: the hidden-state L2 is computed and
    reported every step beside the KL, the embedding and output layer come out bit-identical to the
    teacher's (exact: frozen parameters are not in the optimizer), and the decoder does change."""
    from tools.spawn import run_distributed
    from megatron.components.tokenizer import DEFAULT_CORPUS
    from tests.helpers import read_jsonl, torchrun

    out = teacher_ckpt / "student_kll2_frozen"
    proc = torchrun("distill.fcsd", [
        "--load", teacher_ckpt / "teacher", "--farskip", "all", "--expert-model-parallel-size", 2, "--save", out,
        "--kd-loss", "kl+l2", "--kd-l2-coeff", 0.5, "--freeze-embeddings", "--train-iters", 2,
        "--eval-interval", 1000, "--eval-iters", 0, "--log-interval", 1, "--micro-batch-size", 4,
        "--global-batch-size", 16, "--proxy-text", DEFAULT_CORPUS, "--proxy-max-windows", 4,
        "--data-cache-path", teacher_ckpt / "cache", "--lr", 1e-2])  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_jsonl(out / "metrics.jsonl") if "event" not in r]
    assert len(steps) == 2 and all(r["hidden_l2"] > 0 and r["kd_loss"] > 0 for r in steps)
    teacher, student = run_distributed(_weights, 1, str(teacher_ckpt / "teacher"), str(out))[0]
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert (student[name] == teacher[name]).all(), name
    changed = [n for n in teacher if n.startswith("decoder.") and not (student[n] == teacher[n]).all()]
    assert len(changed) > 5
