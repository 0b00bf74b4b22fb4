"""Hot regions of a kernel's SASS from an Nsight Compute source page (development):
    ncu -i REPORT --page source --csv --print-source sass > k.csv; python scripts/ncu_hot.py k.csv [N]
Prints the executed instructions and warp-state samples of each run of consecutive executed instructions (the
loops and phases of the kernel), the N largest by samples, the whole kernel's stall reasons, and the samples
between consecutive block barriers (``BAR.SYNC``) or exits holding at least 0.5% of them: in a kernel whose
phases end at barriers, where the warps' time goes phase by phase.
    ncu -i REPORT --page details --csv > d.csv; python scripts/ncu_hot.py --details d.csv
prints the headline metrics of a details page instead (duration, throughputs, issue slots, warps, occupancy,
registers, shared memory, hit rates, IPC)."""
import csv
import re
import sys

_DETAILS = re.compile("Duration|Throughput|Issue Slots|Eligible|Active Warps|Occupancy|Registers|Hit Rate|Ipc|Shared")


def details(path: str, n: int = 40) -> None:
    rows = [r for r in list(csv.reader(open(path)))[1:] if len(r) > 14 and _DETAILS.search(r[12])]
    for r in rows[:n]:
        print(r[12], r[13], r[14])


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
    print("  between barriers:")
    start, c_acc, s_acc = 0, 0, 0
    for i, r in enumerate(data):
        c_acc, s_acc = c_acc + int(r[ia] or 0), s_acc + int(r[isamp] or 0)
        if "BAR.SYNC" in r[1] or "EXIT" in r[1] or i == len(data) - 1:
            if s_acc >= 0.005 * ts:
                print(f"    SASS {start:6d}-{i:6d}: {c_acc:11d} instr, {s_acc:6d} samples ({100 * s_acc / ts:4.1f}%)"
                      f" to {r[1].strip()[:24]}")
            start, c_acc, s_acc = i + 1, 0, 0


if __name__ == "__main__":
    if sys.argv[1] == "--details":
        details(sys.argv[2])
    else:
        main(sys.argv[1], *(int(a) for a in sys.argv[2:3]))
