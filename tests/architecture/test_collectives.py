"""Every torch.distributed collective of the project goes through ``megatron.common.collectives``.

A collective on a host tensor over the NCCL default group raises on a GPU cluster; the helper puts
tensors on the group's device. The AST check below finds any other use (a call, a reference such as
``getattr(dist, "all_reduce")``, or an import of a collective by name) in the project's packages and
scripts. Barriers count too: the helper passes the current device to NCCL. The checker is tested on
snippets first, so a broken checker cannot pass silently. The helpers themselves run on 2 gloo ranks.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from tools.spawn import run_distributed

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ["megatron/common", "moe_variants", "megatron/components", "megatron/training", "megatron/inference",
            "megatron/compat", "distill", "tools", "netsim", "scripts"]
HELPER = ROOT / "megatron" / "common" / "collectives.py"

COLLECTIVES = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_object", "all_gather_into_tensor",
    "_all_gather_base", "all_gather_coalesced", "broadcast", "broadcast_object_list", "all_to_all",
    "all_to_all_single", "reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "gather", "gather_object", "scatter", "scatter_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "send_object_list", "recv_object_list", "barrier", "monitored_barrier",
}
DIST_MODULES = {"torch.distributed", "torch.distributed.nn", "torch.distributed.nn.functional",
                "torch.distributed.distributed_c10d"}


def direct_collectives(source: str) -> list[tuple[int, str]]:
    """(line, what) for each direct use of a torch.distributed collective in ``source``."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # local name -> dotted module (torch.distributed...) or "torch"
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" or a.name.startswith("torch."):
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases["torch"] = "torch"
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if node.module in DIST_MODULES and a.name in COLLECTIVES:
                    found.append((node.lineno, f"from {node.module} import {a.name}"))
                elif full in DIST_MODULES or (node.module == "torch" and a.name == "distributed"):
                    aliases[a.asname or a.name] = full

    def dotted(expr) -> str | None:
        if isinstance(expr, ast.Name):
            return aliases.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = dotted(expr.value)
            return None if base is None else f"{base}.{expr.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and dotted(node.value) in DIST_MODULES:
            found.append((node.lineno, f"{dotted(node.value)}.{node.attr}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and dotted(node.args[0]) in DIST_MODULES
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in COLLECTIVES):
            found.append((node.lineno, f"getattr({dotted(node.args[0])}, {node.args[1].value!r})"))
    return sorted(set(found))


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\ndist.all_reduce(t)",
    "import torch.distributed as d\nd.barrier()",
    "import torch\ntorch.distributed.broadcast_object_list(x, src=0)",
    "from torch import distributed\ndistributed.all_gather(a, b)",
    "from torch import distributed as D\nf = D.all_to_all_single",
    "from torch.distributed import all_gather_object",
    "from torch.distributed.nn.functional import all_reduce",
    "import torch.distributed as dist\nfn = getattr(dist, 'reduce_scatter_tensor')",
    "def f():\n    import torch.distributed as dist\n    dist.gather_object(o, l, dst=0)",
])
def test_checker_finds_direct_collectives(source):
    assert direct_collectives(source), source


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\ndist.get_rank(); dist.get_world_size(g); dist.ReduceOp.MAX",
    "from megatron.common import collectives\ncollectives.all_reduce(t)",
    "import torch\ntorch.cuda.synchronize(); x.all_reduce()",
])
def test_checker_allows_the_rest(source):
    assert direct_collectives(source) == []


def test_project_calls_collectives_only_through_the_helper():
    offenders = []
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert HELPER in files and len(files) > 100
    for path in files:
        if path == HELPER:
            continue
        for line, what in direct_collectives(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not offenders, "use megatron.common.collectives instead:\n" + "\n".join(offenders)


def _helpers(rank, world):
    import torch.distributed as dist

    from megatron.common import collectives

    out = {"device": str(collectives.group_device())}
    t = torch.tensor([float(rank + 1), 10.0 * (rank + 1)])
    same = collectives.all_reduce(t)
    out["sum"] = t.tolist()
    out["in_place"] = same is t
    m = torch.tensor([rank], dtype=torch.int64)
    collectives.all_reduce(m, op=dist.ReduceOp.MAX)
    out["max"] = int(m)
    parts = [torch.empty(2) for _ in range(world)]
    collectives.all_gather(parts, torch.full((2,), float(rank)))
    out["gathered"] = [p.tolist() for p in parts]
    out["cat"] = collectives.all_gather_cat(torch.tensor([[rank]]), dim=1).tolist()
    full = torch.empty(2 * world)
    collectives.all_gather_into_tensor(full, torch.full((2,), float(rank)))
    out["into"] = full.tolist()
    piece = torch.empty(2)
    collectives.reduce_scatter_tensor(piece, torch.arange(2.0 * world) * (rank + 1))
    out["scattered"] = piece.tolist()
    b = torch.tensor([float(rank)])
    collectives.broadcast(b, src=1)
    out["broadcast"] = float(b)
    recv = torch.empty(world)
    collectives.all_to_all_single(recv, torch.full((world,), float(rank)))
    out["a2a"] = recv.tolist()
    out["objects"] = collectives.all_gather_object([None] * world, {"rank": rank})
    out["box"] = collectives.broadcast_object_list([f"from {rank}"], src=0)
    out["gather"] = collectives.gather_object(rank * 2, [None] * world if rank == 0 else None, dst=0)
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    y = collectives.all_reduce_autograd(x * 3)
    y.sum().backward()
    out["autograd"] = (float(y), float(x.grad))
    collectives.barrier()
    return out


def test_helpers_on_two_gloo_ranks():
    """Exact values (small integers in fp32). The differentiable all-reduce's backward all-reduces
    the gradient: d(sum over ranks of 3x)/dx summed over both ranks' losses is 3 * 2."""
    r0, r1 = run_distributed(_helpers, 2)
    for r in (r0, r1):
        assert r["device"] == "cpu" and r["in_place"]
        assert r["sum"] == [3.0, 30.0] and r["max"] == 1
        assert r["gathered"] == [[0.0, 0.0], [1.0, 1.0]] and r["cat"] == [[0, 1]]
        assert r["into"] == [0.0, 0.0, 1.0, 1.0]
        assert r["broadcast"] == 1.0
        assert r["a2a"] == [0.0, 1.0]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}] and r["box"] == ["from 0"]
        assert r["autograd"] == (9.0, 6.0)
    # sum of arange(4) * (rank + 1) over ranks = 3 * arange(4); rank r keeps elements [2r, 2r+2)
    assert r0["scattered"] == [0.0, 3.0] and r1["scattered"] == [6.0, 9.0]
    assert r0["gather"] == [0, 2] and r1["gather"] is None


def test_group_device_follows_the_backend(monkeypatch):
    import torch.distributed as dist

    from megatron.common import collectives

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for backend, want in [("nccl", torch.device("cuda", 3)), ("gloo", torch.device("cpu")),
                          ("cpu:gloo,cuda:nccl", None)]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collectives.group_device() == want


def test_async_refuses_a_copy(monkeypatch):
    """An asynchronous collective cannot copy its result back after the wait: a tensor off the
    group's device is an error, not a silent wrong answer."""
    import torch.distributed as dist

    from megatron.common import collectives

    monkeypatch.setattr(collectives, "group_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: pytest.fail("must not launch"))
    with pytest.raises(ValueError, match="async_op"):
        collectives.all_to_all_single(torch.empty(2), torch.empty(2), async_op=True)
