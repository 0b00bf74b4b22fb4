"""Static SASS and ptxas figures for comparing builds of a CUDA library without a GPU (development).

    python scripts/sass_static.py loops LIB.so [KERNEL_SUBSTRING] [N]
        N loops (backward branches) of each matching kernel, those with 16-byte global loads first, smallest
        first: static size, 16-byte global loads, shared stores, shared atomics -- how the sampled pass's batch
        loop was found and sized (NOTES.md)
    python scripts/sass_static.py ptxas OLD.txt NEW.txt
        registers and spill bytes per kernel from two `nvcc -Xptxas -v` logs (build_variants.sh writes one per
        variant), marking the kernels that changed

cuobjdump is taken from $CUOBJDUMP, else PATH, else triton's bundled copy."""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys


def _cuobjdump() -> str:
    exe = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if exe:
        return exe
    hits = glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "triton", "backends", "nvidia",
                                  "bin", "cuobjdump"))
    if not hits:
        raise SystemExit("cuobjdump not found: set CUOBJDUMP")
    return hits[0]


def _functions(lib: str) -> dict[str, list[tuple[int, str]]]:
    """Kernel name -> [(address, instruction)] from `cuobjdump -sass`."""
    text = subprocess.run([_cuobjdump(), "-sass", lib], capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list[tuple[int, str]]] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and cur is not None:
            cur.append((int(m.group(1), 16), m.group(2).strip()))
    return funcs


def loops(lib: str, pattern: str = "", n: int = 6) -> None:
    for name, ins in _functions(lib).items():
        if pattern not in name:
            continue
        at = {a: i for i, (a, _) in enumerate(ins)}
        found = []
        for i, (a, t) in enumerate(ins):
            m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", t)
            if not m or int(m.group(1), 16) >= a or int(m.group(1), 16) not in at:
                continue
            j = at[int(m.group(1), 16)]
            body = [x for _, x in ins[j:i + 1]]
            found.append((i - j + 1, ins[j][0], a, sum("LDG.E.128" in x for x in body),
                          sum(x.startswith("STS") or " STS" in x for x in body), sum("ATOMS" in x for x in body)))
        print(f"{name}: {len(ins)} instructions")
        # Streaming loops first (those with 16-byte global loads), smallest first: the outer "loops" that span the
        # kernel's phases come last.
        for size, lo, hi, ldg, sts, atoms in sorted(found, key=lambda f: (f[3] == 0, f[0]))[:n]:
            print(f"  loop {lo:#07x}..{hi:#07x}: {size:6d} instructions, LDG.128 {ldg:3d}, STS {sts:3d}, ATOMS {atoms:3d}")


def _ptxas(path: str) -> dict[str, tuple[int, int, int]]:
    """Kernel -> (registers, spill store bytes, spill load bytes) from an -Xptxas -v log."""
    res: dict[str, list[int]] = {}
    cur = None
    for line in open(path):
        m = re.search(r"Compiling entry function '(\w+)' for", line)
        if m:
            cur = m.group(1)
            res[cur] = [0, 0, 0]
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            res[cur][1:] = [int(m.group(1)), int(m.group(2))]
        m = re.search(r"Used (\d+) registers", line)
        if m:
            res[cur][0] = int(m.group(1))
    return {k: tuple(v) for k, v in res.items()}


def ptxas(old: str, new: str) -> None:
    a, b = _ptxas(old), _ptxas(new)
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        mark = "" if x == y else "   <-- changed"
        print(f"{k[:70]:70s} regs/spill st/ld {x} -> {y}{mark}")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "loops":
        loops(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "", int(sys.argv[4]) if len(sys.argv) > 4 else 6)
    elif len(sys.argv) == 4 and sys.argv[1] == "ptxas":
        ptxas(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(__doc__)
