"""Hot regions of a kernel's SASS from an Nsight Compute source page (development):
    ncu -i REPORT --page source --csv --print-source sass > k.csv; python scripts/ncu_hot.py k.csv [N]
Prints the executed instructions and warp-state samples of each run of consecutive executed instructions (the
loops and phases of the kernel), the N largest by samples, and the whole kernel's stall reasons."""
import csv
import sys


def main(path: str, n: int = 14) -> None:
    rows = list(csv.reader(open(path)))
    hdr, data = rows[1], rows[2:]
    ia, isamp = hdr.index("Instructions Executed"), hdr.index("Warp Stall Sampling (All Samples)")
    regions, cur = [], None
    for i, r in enumerate(data):
        c, s = int(r[ia] or 0), int(r[isamp] or 0)
        if c == 0:
            continue
        if cur and i == cur[1] + 1:
            cur[1], cur[2], cur[3] = i, cur[2] + c, cur[3] + s
        else:
            cur = [i, i, c, s]
            regions.append(cur)
    ti, ts = sum(r[2] for r in regions), sum(r[3] for r in regions)
    print(f"{ti} instructions executed (warp level), {ts} samples")
    for a, b, c, s in sorted(regions, key=lambda r: -r[3])[:n]:
        print(f"  SASS {a:6d}-{b:6d}: {c:11d} instr ({100 * c / ti:4.1f}%), {s:6d} samples ({100 * s / ts:4.1f}%)")
    cols = [i for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    tot = {hdr[i][6:]: sum(int(r[i] or 0) for r in data) for i in cols}
    st = sum(tot.values()) or 1
    print("  stalls: " + ", ".join(f"{k} {100 * v / st:.0f}%" for k, v in sorted(tot.items(), key=lambda x: -x[1])[:8]))


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
