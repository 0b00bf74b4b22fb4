"""Benchmark CLI: ``python benchmarks/bench.py --suite NAME [--suite NAME ...] [--out DIR] [--quick]``.

A suite is a module ``benchmarks/suite_<NAME>.py`` exposing ``run(args) -> list[dict]`` (rows built with
``common.record``) and optionally ``plot(rows, out_dir)`` and ``COLUMNS`` (the columns printed). Results go to
``DIR/<suite>.csv`` (and PNGs where the suite plots). Runs on a CUDA GPU; DeepGEMM rows appear when
``deep_gemm`` is importable.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import common  # noqa: E402


def available_suites() -> list[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return sorted(f[len("suite_"):-3] for f in os.listdir(here) if f.startswith("suite_") and f.endswith(".py"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--suite", action="append", help=f"one of {available_suites()}")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes (smoke run)")
    args = ap.parse_args(argv)
    for name in args.suite or available_suites():
        mod = importlib.import_module(f"suite_{name}")
        rows = mod.run(args)
        if not rows:  # skipped here, or a rank other than 0 of a multi-process suite
            continue
        common.write_csv(rows, os.path.join(args.out, f"{name}.csv"))
        if hasattr(mod, "plot"):
            try:
                mod.plot(rows, args.out)
            except Exception as e:  # plotting is a convenience; the CSV is the record
                print(f"[{name}] plot failed: {e}")
        print(f"\n== suite {name} ==")
        common.print_table(rows, getattr(mod, "COLUMNS", list(rows[0].keys()) if rows else []))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
