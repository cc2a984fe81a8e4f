"""What ``--load`` and the data do when they are wrong, and when the code is: an empty ``--load``
other than ``--save`` is an error unless ``--allow-empty-load``; a ``ValueError`` from inside the
checkpoint load or the dataset build (megatron-core, torch: a bug, not bad input) keeps its
traceback instead of becoming a one-line "error:" (bad ``--split`` and ``--data-path`` values are
``UserError``s of their own: ``tests/data/test_datasets.py``); a prune that fails after a save is a
warning. Whole pretraining runs in forked ranks (``run_distributed``, the tiny model of
``SMALL_PRETRAIN_ARGS``: about a minute for the file, so the slow tier); exact strings."""

from __future__ import annotations

import pytest

from tests.training.test_reliability import SHORT, _error_lines, _iters, run_main

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("load_errors_cache"))


def test_an_empty_load_other_than_save_is_an_error_unless_asked(tmp_path, cache):
    """An existing but empty --load that is not --save (a mistyped fine-tune source) trains nothing
    and names the flag that starts from scratch; with it, the run starts from scratch, said once."""
    empty = tmp_path / "empty"
    empty.mkdir()
    args = SHORT + ["--train-iters", 1, "--save", tmp_path / "out", "--load", empty, "--data-cache-path", cache]
    code, out, err = run_main(args)
    assert code == 2 and _error_lines(err) == [
        f"pretrain_gpt: error: --load {empty} holds no checkpoint (a mistyped path?): pass --allow-empty-load "
        "to start from scratch when it is empty"], err
    assert "iter " not in out and not _iters(tmp_path / "out")  # nothing trained, nothing saved
    code, out, err = run_main(args + ["--allow-empty-load"])
    assert code == 0, err
    assert out.count("starting from scratch") == 1 and f"no checkpoint in {empty}; starting from scratch" in out
    assert _iters(tmp_path / "out") == ["iter_0000001"]


def _value_error(*args, **kwargs):
    raise ValueError("a shape bug deep inside")


def test_a_value_error_inside_the_checkpoint_load_keeps_its_traceback(tmp_path, cache, monkeypatch):
    save = tmp_path / "a"
    assert run_main(SHORT + ["--train-iters", 1, "--save", save, "--data-cache-path", cache])[0] == 0
    import megatron.components.checkpointing.load as load

    monkeypatch.setattr(load, "load_model_state", _value_error)  # inherited by the forked rank
    from tools.spawn import DistributedTestError

    with pytest.raises(DistributedTestError) as err:
        run_main(SHORT + ["--train-iters", 2, "--load", save, "--data-cache-path", cache])
    assert "Traceback" in str(err.value) and "ValueError: a shape bug deep inside" in str(err.value)


def test_a_value_error_inside_the_dataset_build_keeps_its_traceback(tmp_path, cache, monkeypatch):
    import megatron.training.data as data

    class Builder:
        def __init__(self, *args, **kwargs):
            pass

        build = _value_error

    monkeypatch.setattr(data, "_builder_class", lambda: Builder)
    from tools.spawn import DistributedTestError

    with pytest.raises(DistributedTestError) as err:
        run_main(SHORT + ["--train-iters", 1, "--data-cache-path", cache])
    assert "Traceback" in str(err.value) and "ValueError: a shape bug deep inside" in str(err.value)


def _denied(save_dir, keep_last, lineage, keep=None):
    raise PermissionError(13, "Permission denied", str(save_dir))


def test_a_failed_prune_after_a_save_warns_and_training_goes_on(tmp_path, cache, monkeypatch):
    """Pruning (--keep-last-checkpoints) runs after the checkpoint is published: its failure
    (injected: the directory refuses the rename) is a warning naming the saved checkpoint, the run
    goes on and saves again, and nothing is deleted."""
    import megatron.components.checkpointing.writer as writer

    monkeypatch.setattr(writer, "prune", _denied)  # inherited by the forked rank
    save = tmp_path / "run"
    code, out, err = run_main(SHORT + ["--train-iters", 3, "--save", save, "--save-interval", 1,
                                       "--keep-last-checkpoints", 1, "--data-cache-path", cache])
    assert code == 0 and not _error_lines(err), err
    assert _iters(save) == ["iter_0000001", "iter_0000002", "iter_0000003"]
    assert (f"checkpoint {save / 'iter_0000002'} saved, but pruning the older ones (--keep-last-checkpoints 1) "
            f"failed: Permission denied ({save}); they stay on disk") in err, err
