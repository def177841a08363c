"""Reads dev/trace's per-block dump (TRACE_DUMP): which stage-1 blocks end late, and why not.

    TRACE_DUMP=/tmp/d.tsv ./trace "lengths tensor, b=8"
    python3 dev/trace/dump.py /tmp/d.tsv [--scenario PART] [--maps N] [--slack US]

For each scenario, over its calls after the first two, the stage-1 blocks that
streamed (a first tile landed) are split at each call's median end into a
later and an earlier half, and the two halves' mean entry, first tile, loop
and end are printed side by side (µs from the call's first release from the
PDL wait): a gap in the loops means the halves streamed at different speeds,
a gap in the first tiles that they started apart. With --maps, N calls are
drawn by block index and by SM: S ends more than --slack µs after the median,
s after it, f before it, and . is an SM that held no block that streamed.
The dump may be gzipped.
"""

import argparse
import collections
import gzip
import statistics

# Columns after scenario, call, kind, block (trace.cu, TRACE_DUMP): ns from the call's first release.
ENTER, GO, COPIES, ISSUED, TILE0, LOOP_DONE, WRITTEN, EXIT = range(8)


def read(path):
    """scenario -> call -> [(block, stamps, sm)] of the stage-1 blocks."""
    opener = gzip.open if path.endswith(".gz") else open
    out = collections.defaultdict(lambda: collections.defaultdict(list))
    with opener(path, "rt") as f:
        for line in f:
            name, call, kind, block, *rest = line.rstrip("\n").split("\t")
            if kind == "s1":
                out[name][int(call)].append((int(block), [int(x) for x in rest[:8]], int(rest[8])))
    return out


def halves(calls):
    """Mean entry, first tile, loop and end (µs) of each call's later and earlier halves."""
    late, early = collections.defaultdict(list), collections.defaultdict(list)
    for call, blocks in calls.items():
        if call < 2:
            continue
        streamed = [t for _, t, _ in blocks if t[TILE0]]
        median = statistics.median(t[EXIT] for t in streamed)
        for t in streamed:
            half = late if t[EXIT] > median else early
            half["enter"].append(t[ENTER] / 1e3)
            half["first tile"].append(t[TILE0] / 1e3)
            half["loop"].append((t[LOOP_DONE] - t[TILE0]) / 1e3)
            half["end"].append(t[EXIT] / 1e3)
    return {k: (statistics.mean(late[k]), statistics.mean(early[k])) for k in late}


def maps(blocks, slack_ns):
    """A call's blocks by index and its SMs, each drawn as S, s, f (or .)."""
    streamed = sorted((b, t, sm) for b, t, sm in blocks if t[TILE0])
    median = statistics.median(t[EXIT] for _, t, _ in streamed)
    mark = {b: "S" if t[EXIT] > median + slack_ns else "s" if t[EXIT] > median else "f" for b, t, _ in streamed}
    on_sm = {sm: mark[b] for b, _, sm in streamed}
    sms = max(sm for _, _, sm in blocks) + 1
    return "".join(mark[b] for b, _, _ in streamed), "".join(on_sm.get(s, ".") for s in range(sms))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--scenario", default="", help="only scenarios whose name contains this")
    ap.add_argument("--maps", type=int, default=0, help="draw this many calls by block and by SM")
    ap.add_argument("--slack", type=float, default=3.0, help="µs past the median end that draws S")
    args = ap.parse_args()
    for name, calls in read(args.dump).items():
        if args.scenario not in name:
            continue
        print(name)
        for k, (late, early) in halves(calls).items():
            print(f"  {k:10s} later half {late:8.2f}  earlier half {early:8.2f}")
        for call in sorted(calls)[2:2 + args.maps]:
            by_block, by_sm = maps(calls[call], args.slack * 1e3)
            print(f"  call {call:2d} by block {by_block}\n          by SM    {by_sm}")


if __name__ == "__main__":
    main()
