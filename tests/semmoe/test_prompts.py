"""tools/semmoe/prompts.py (scripts/semmoe_prompts.py): the domain prompt sets, the cap, the mix
and the one-line errors."""

import json

import pytest

from tools.semmoe import prompts


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def eval_dir(tmp_path):
    d = tmp_path / "eval"
    _write(d / "mbpp" / "mbpp.jsonl", [{"text": f"Write f{i}.", "code": f"def f{i}():\n\treturn {i}", "task_id": 10 + i,
                                        "test_list": ["assert f()"]} for i in range(10)])  # fmt: skip
    _write(d / "boolq" / "boolq.jsonl", [{"query": f"Passage: p{i}\nQuestion: q{i}?", "choices": ["no", "yes"],
                                          "gold": 1} for i in range(10)])  # fmt: skip
    _write(d / "lambada" / "lambada_test.jsonl", [{"text": f"story {i} ends"} for i in range(10)])
    for part in ("easy", "challenge"):
        _write(d / "arc" / f"arc_{part}.jsonl", [{"query": f"Question: {part} {i}?", "choices": ["a", "b", "c", "d"],
                                                  "gold": 2} for i in range(5)])  # fmt: skip
    return d


def test_domain_builders(eval_dir):
    mbpp = prompts.mbpp_prompts(str(eval_dir))
    assert mbpp[0] == {"id": "mbpp:10", "text": "Write f0.\ndef f0():\n\treturn 0"}
    assert prompts.boolq_prompts(str(eval_dir))[3] == {"id": "boolq:3", "text": "Passage: p3\nQuestion: q3?"}
    assert prompts.lambada_prompts(str(eval_dir))[9]["text"] == "story 9 ends"
    arc = prompts.arc_prompts(str(eval_dir))
    assert [r["id"] for r in arc[4:6]] == ["arc:easy:4", "arc:challenge:0"]
    assert arc[0]["text"] == "Question: easy 0?\nA. a\nB. b\nC. c\nD. d\nAnswer:"  # no answer given


def test_cap_mix_and_manifest(eval_dir, tmp_path):
    out = tmp_path / "out"
    rc = prompts.main(["--eval-dir", str(eval_dir), "--data-dir", str(tmp_path / "none"), "--out-dir", str(out),
                       "--datasets", "mbpp,lambada", "--max-requests", "5", "--mix", "mix"])  # fmt: skip
    assert rc == 0
    lines = {p: [json.loads(x) for x in (out / f"{p}.jsonl").read_text().splitlines()]
             for p in ("mbpp_all", "mbpp_profile", "mbpp_eval", "mix_profile", "mix_eval")}  # fmt: skip
    assert len(lines["mbpp_all"]) == 5 and len(lines["mbpp_profile"]) == 1 and len(lines["mbpp_eval"]) == 4
    ids = [r["id"] for r in lines["mbpp_all"]]
    assert ids == sorted(ids, key=lambda i: int(i.split(":")[1]))  # file order kept
    assert [r["id"].split(":")[0] for r in lines["mix_eval"]] == ["mbpp"] * 4 + ["lambada"] * 4
    manifest = json.loads((out / "prompts_manifest.json").read_text())
    assert manifest["max_requests"] == 5 and manifest["files"]["mix_all.jsonl"]["requests"] == 10


def test_errors_are_one_line(eval_dir, tmp_path, capsys):
    args = ["--eval-dir", str(eval_dir), "--out-dir", str(tmp_path / "o")]
    assert prompts.main(args + ["--datasets", "mbpp", "--mix", "mbpp"]) == 2
    assert "--mix mbpp: the name of a dataset" in capsys.readouterr().err
    assert prompts.main(["--eval-dir", str(tmp_path / "no"), "--out-dir", str(tmp_path / "o"), "--datasets", "arc"]) == 2
    assert "--eval-dir" in capsys.readouterr().err
    _write(eval_dir / "lambada" / "lambada_test.jsonl", [{"txt": "no text field"}])
    assert prompts.main(args + ["--datasets", "lambada"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("semmoe_prompts.py: error: lambada: a record is malformed") and err.count("\n") == 1
