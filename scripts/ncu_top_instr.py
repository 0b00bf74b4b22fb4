"""The hottest SASS instructions of a kernel from an Nsight Compute source page (development):
    ncu -i REPORT --page source --csv --print-source sass > k.csv; python scripts/ncu_top_instr.py k.csv [N]
Prints the N instructions with the most warp-state samples, each with its index, SASS text, executions and its
two largest stall reasons, so that once-per-row phases (barriers, shuffles, atomics) can be told apart."""
import csv
import sys


def main(path: str, n: int = 60) -> None:
    rows = list(csv.reader(open(path)))
    hdr, data = rows[1], rows[2:]
    ia, isamp = hdr.index("Instructions Executed"), hdr.index("Warp Stall Sampling (All Samples)")
    isrc = hdr.index("Source")
    cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    ts = sum(int(r[isamp] or 0) for r in data) or 1
    top = sorted(range(len(data)), key=lambda i: -int(data[i][isamp] or 0))[:n]
    for i in sorted(top):
        r = data[i]
        s = int(r[isamp] or 0)
        st = sorted(((int(r[c] or 0), hdr[c][6:]) for c in cols), reverse=True)[:2]
        print(f"{i:6d} {100 * s / ts:5.1f}% x{int(r[ia] or 0):8d}  {r[isrc][:60]:60s} " + ", ".join(f"{k} {v}" for v, k in st))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 60)
