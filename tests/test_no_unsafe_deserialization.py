"""Nothing read from the network or from a file is unpickled: a scan of every module.

Forbidden: importing pickle-like modules (pickle, cPickle, dill, cloudpickle, marshal,
shelve, jsonpickle), ``torch.load`` without ``weights_only=True``, ``numpy.load`` with
``allow_pickle=True``, ``yaml.load``/``yaml.unsafe_load`` (use ``yaml.safe_load``), and
between the NN ranks torch's collectives that pickle (``all_gather_object``,
``broadcast_object_list``, ... : use ``persia_py.dense.collectives``' JSON, bytes and tensor
exchanges) and its RPC framework (``torch.distributed.rpc`` pickles arguments).
"""

from __future__ import annotations

import ast

import pytest
from checkout import ROOT

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve",
                  "jsonpickle"}
PICKLING_COLLECTIVES = {"all_gather_object", "gather_object", "broadcast_object_list",
                        "scatter_object_list", "send_object_list", "recv_object_list",
                        "_object_to_tensor", "_tensor_to_object"}
"""torch.distributed's functions that pickle what they send or unpickle what they get."""
SCANNED = ["persia_py", "servers", "workers", "benchmarks", "examples", "scripts"]


def _sources() -> list:
    files = [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))
             if "_pb2" not in p.name]
    assert len(files) > 20
    return files


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _keyword_is(call: ast.Call, name: str, value: object) -> bool:
    return any(k.arg == name and isinstance(k.value, ast.Constant) and k.value.value is value
               for k in call.keywords)


def _is_rpc(module: str | None) -> bool:
    return (module or "").startswith("torch.distributed.rpc")


def unsafe_uses(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in UNSAFE_MODULES or _is_rpc(a.name)]
        elif isinstance(node, ast.ImportFrom) and ((node.module or "").split(".")[0]
                                                   in UNSAFE_MODULES or _is_rpc(node.module)):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom):
            found += [f"line {node.lineno}: from {node.module} import {a.name} (pickles)"
                      for a in node.names if a.name in PICKLING_COLLECTIVES
                      or (node.module == "torch.distributed" and a.name == "rpc")]
        elif isinstance(node, (ast.Attribute, ast.Name)) and (
                getattr(node, "attr", None) or getattr(node, "id", None)) in PICKLING_COLLECTIVES:
            found.append(f"line {node.lineno}: {_dotted(node)} (pickles; use persia_py.dense.collectives)")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name == "torch.load" and not _keyword_is(node, "weights_only", True):
                found.append(f"line {node.lineno}: torch.load without weights_only=True")
            elif name in ("np.load", "numpy.load") and _keyword_is(node, "allow_pickle", True):
                found.append(f"line {node.lineno}: {name}(allow_pickle=True)")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                found.append(f"line {node.lineno}: {name} (use yaml.safe_load)")
    return found


def test_the_scan_catches_each_pattern() -> None:
    bad = ("import pickle\nfrom dill import loads\nimport torch, yaml, numpy as np\n"
           "torch.load('x')\ntorch.load('x', weights_only=False)\n"
           "np.load('x', allow_pickle=True)\nyaml.load(open('x'))\n")
    assert len(unsafe_uses(bad)) == 6
    collectives = ("import torch.distributed as dist\n"
                   "dist.all_gather_object(out, 'x')\n"
                   "torch.distributed.broadcast_object_list(box, src=0)\n"
                   "gather = dist.gather_object\n"
                   "from torch.distributed import scatter_object_list, rpc\n"
                   "import torch.distributed.rpc\n"
                   "from torch.distributed.distributed_c10d import _object_to_tensor\n")
    assert len(unsafe_uses(collectives)) == 7, unsafe_uses(collectives)
    assert unsafe_uses("import torch, yaml\ntorch.load('x', weights_only=True)\n"
                       "yaml.safe_load('a: 1')\n") == []


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_deserializes_unsafely(path) -> None:
    assert unsafe_uses(path.read_text()) == [], path
