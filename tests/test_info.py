"""``python -m torch_sparse_indexer.info``: its report agrees with the backend registry."""
import subprocess
import sys

import torch

from torch_sparse_indexer import backends, info
from torch_sparse_indexer.ops import SCHEMAS


def test_dispatch_order_is_the_registry():
    got = info.collect()
    assert list(got["ops"]) == list(SCHEMAS)
    for op, names in got["ops"].items():
        assert names == [b.name for b in backends.candidates(op)]
        assert names[-1] == "reference", f"{op}: the reference backend is the last resort"
    assert [d["index"] for d in got["devices"]] == list(range(torch.cuda.device_count()))


def test_a_registered_family_and_a_forced_backend_show():
    with backends.registry_scope():
        backends.register("topk", "cuda", lambda *a: None, priority=1000)
        backends.register("sparse_topk", "cuda", lambda *a: None, priority=1000, defer=lambda *a: "slower")
        with backends.use_backend("reference"):
            got = info.collect()
            text = info.format_info(got)
    assert got["ops"]["topk"][:2] == ["cuda", "reference"]
    assert got["families"]["cuda top-k (csrc/topk.cu)"]["status"].startswith("registered")
    assert got["forced"] == "reference" and "forced backend: reference" in text
    assert "topk" in text and "cuda > reference" in text
    assert got["defers"]["sparse_topk"] == ["cuda"] and "cuda* > reference" in text
    if not torch.cuda.is_available():
        assert got["families"]["triton"]["status"] == "not registered: no CUDA device" or \
            "not importable" in got["families"]["triton"]["status"]


def test_module_runs():
    r = subprocess.run([sys.executable, "-m", "torch_sparse_indexer.info"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    for op in SCHEMAS:
        assert f"  {op} " in r.stdout
    assert "kernel families:" in r.stdout and "torch_sparse_indexer " in r.stdout
