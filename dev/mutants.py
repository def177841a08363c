"""Planner mutants: small deliberate bugs in core/ that `go test ./core/` must catch.

    python3 dev/mutants.py [--only REGEX] [--timeout SECONDS]

Each mutant is one exact text replacement in one file. The script copies what
`go test ./core/` reads (go.mod, go.sum, core/'s files, kernels/) into a
temporary directory, checks that the unmutated copy passes, then for each
mutant applies it there, builds the test binary once (go test -c) and runs it.
A mutant whose text is not found exactly once, or that does not build, is an
error: the planner has changed, and the mutant must change with it. Exit
status 1 if any mutant survives or is in error, 2 if the unmutated tests fail.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (name, file, old text, new text)
MUTANTS = [
    # The tail-split combine starts at a whole row tile's rows, not only a
    # whole K/V head's.
    ("combine-row0-drops-row-tiles", "core/plan.go",
     "p.CombineRow0 = whole/rowTiles*packed + whole%rowTiles*v.Rows",
     "p.CombineRow0 = whole/rowTiles*packed"),
    # The balanced counts ignore the appended tokens.
    ("balanced-counts-ignore-appended", "core/splits.go",
     "n = min(max(n+s.SeqlenNew, 0), s.SeqlenCache)",
     "n = min(max(n, 0), s.SeqlenCache)"),
    # The balanced counts floor a sequence's key tiles.
    ("balanced-tiles-floor", "core/splits.go",
     "tiles[b] = ceilDiv(n, p.Variant.KeysPerTile)",
     "tiles[b] = n / p.Variant.KeysPerTile"),
    # The append kernel's grid leaves out the rotated q's chunks.
    ("append-parts-ignore-rotary-q", "core/plan.go",
     "items += s.HeadsQ * chunks",
     "items += 0 * chunks"),
    # A sequence's balanced share floored.
    ("balanced-share-floor", "core/splits.go",
     "ceilDiv(p.BalanceSplits*s.Batch*t, total)",
     "p.BalanceSplits*s.Batch*t/total"),
    # A sequence's balanced count not capped at the workspace's splits.
    ("balanced-count-uncapped", "core/splits.go",
     "max(ceilDiv(p.BalanceSplits*s.Batch*t, total), 1), p.NumSplits)",
     "max(ceilDiv(p.BalanceSplits*s.Batch*t, total), 1), MaxSplits)"),
    # A requested split count clamped one past the key tiles.
    ("clamp-splits-off-by-one", "core/splits.go",
     "return max(1, min(n, MaxSplits, tiles))",
     "return max(1, min(n, MaxSplits, tiles+1))"),
    # The stage-1 grid's y and z swapped.
    ("grid-yz-swapped", "core/plan.go",
     "Grid: [3]int{splits, s.HeadsKV * rowTiles, s.Batch},",
     "Grid: [3]int{splits, s.Batch, s.HeadsKV * rowTiles},"),
    # Row tiles floored: a partial last tile of packed rows is dropped.
    ("row-tiles-floor", "core/plan.go",
     "rowTiles := ceilDiv(s.HeadsQ/s.HeadsKV*s.SeqlenQ, v.Rows)",
     "rowTiles := max(1, s.HeadsQ/s.HeadsKV*s.SeqlenQ/v.Rows)"),
    # Clusters one larger than the hardware's limit.
    ("cluster-limit-off-by-one", "core/plan.go",
     "if n < 2 || n > MaxCluster || d.Clusters == nil {",
     "if n < 2 || n > MaxCluster+1 || d.Clusters == nil {"),
    # Clusters planned where one more item than fits at once runs.
    ("cluster-capacity-off-by-one", "core/plan.go",
     "if items <= d.Clusters(v, n) && (",
     "if items <= d.Clusters(v, n)+1 && ("),
    # The rotated q not 256-byte aligned after the partials.
    ("qrot-offset-unaligned", "core/plan.go",
     "qRotOffset = ceilDiv(total, align) * align",
     "qRotOffset = total"),
    # lse_partial placed one split's row short of o_partial's end.
    ("lse-offset-overlaps", "core/plan.go",
     "lseOffset = ceilDiv(splits*rows*headDim*f32, align) * align",
     "lseOffset = ceilDiv((splits-1)*rows*headDim*f32, align) * align"),
    # A launch without clusters given the cluster launch's shared memory.
    ("plain-launch-cluster-shared-bytes", "core/plan.go",
     "SharedBytes: v.SharedBytes,",
     "SharedBytes: v.ClusterSharedBytes,"),
    # The tail split rounds the free slots up.
    ("tail-split-ceil", "core/splits.go",
     "return blocks - tail, min(maxN, resident/tail)",
     "return blocks - tail, min(maxN, ceilDiv(resident, tail))"),
    # The balanced grid one block an item short of the most splits a batch can take.
    ("balanced-grid-short", "core/plan.go",
     "p.Grid = [3]int{items * (splits + 1), 1, 1}",
     "p.Grid = [3]int{items * splits, 1, 1}"),
    # The workspace sized for every row in a tail split.
    ("tail-workspace-all-rows", "core/plan.go",
     "workspaceLayout(partials, rows-p.CombineRow0, s.HeadDim, p.QRotBytes)",
     "workspaceLayout(partials, rows, s.HeadDim, p.QRotBytes)"),
    # The append grid ignores query tokens past the new ones.
    ("append-grid-new-tokens-only", "core/plan.go",
     "p.AppendGrid = [3]int{max(s.SeqlenNew, s.SeqlenQ), s.Batch, s.appendParts()}",
     "p.AppendGrid = [3]int{s.SeqlenNew, s.Batch, s.appendParts()}"),
    # A window no longer bounds the planned keys.
    ("planned-keys-ignore-window", "core/plan.go",
     "length = min(length, s.WindowKeys)",
     "length = min(length, s.WindowKeys+s.SeqlenCache)"),
    # The plan key rounds the length down.
    ("plan-key-floor", "core/plan.go",
     "rounded := ceilDiv(s.Seqlen+s.SeqlenNew, PlanKeyQuantum) * PlanKeyQuantum",
     "rounded := (s.Seqlen + s.SeqlenNew) / PlanKeyQuantum * PlanKeyQuantum"),
    # A grid of more than one wave kept unsplit as if it filled one.
    ("busy-grid-any-waves", "core/splits.go",
     "blocks*100 >= slots*busySlotsPct && blocks <= slots",
     "blocks*100 >= slots*busySlotsPct"),
    # A plan balanced where no sequence could take more than equal lengths give it.
    ("balanced-without-gain", "core/splits.go",
     "if most <= n {",
     "if most < n {"),
    # The balanced partials' bound doubled.
    ("balanced-partials-doubled", "core/splits.go",
     "balancedPartialBytes/max(rowBytes, 1))",
     "2*balancedPartialBytes/max(rowBytes, 1))"),
    # The planned keys leave out the appended tokens.
    ("planned-keys-ignore-appended", "core/plan.go",
     "length = min(s.Seqlen+s.SeqlenNew, s.SeqlenCache)",
     "length = min(s.Seqlen, s.SeqlenCache)"),
    # The narrow combine refused the most splits it loads at once.
    ("narrow-combine-off-by-one", "core/plan.go",
     "n <= combineUnroll:",
     "n < combineUnroll:"),
    # The 16-row narrow combine refused a grid of exactly the blocks it may have.
    ("dense-combine-off-by-one", "core/plan.go",
     "dense <= min(p.Grid[0]*p.Grid[1]*p.Grid[2], p.SMs)",
     "dense < min(p.Grid[0]*p.Grid[1]*p.Grid[2], p.SMs)"),
    # The heuristic's cap ignores the fewest keys a split must hold.
    ("auto-split-cap-ignores-floor", "core/splits.go",
     "return max(1, min(MaxSplits, tiles/max(minTiles, 1)))",
     "return max(1, min(MaxSplits, tiles))"),
]

# Only the files `go test ./core/` reads.
COPY_DIRS = ["kernels", "core/testdata"]
COPY_FILES = ["go.mod", "go.sum"]


def copy_tree(dst):
    for f in COPY_FILES:
        shutil.copy2(os.path.join(ROOT, f), os.path.join(dst, f))
    os.makedirs(os.path.join(dst, "core"))
    for f in os.listdir(os.path.join(ROOT, "core")):
        if f.endswith(".go"):
            shutil.copy2(os.path.join(ROOT, "core", f), os.path.join(dst, "core", f))
    for d in COPY_DIRS:
        if os.path.isdir(os.path.join(ROOT, d)):
            shutil.copytree(os.path.join(ROOT, d), os.path.join(dst, d))


def run_tests(tree, timeout):
    """Builds and runs core's tests in tree: (passed, the names of the failed
    tests, output), or None if they do not build."""
    binary = os.path.join(tree, "core.test")
    build = subprocess.run(["go", "test", "-c", "-o", binary, "./core/"], cwd=tree,
                           capture_output=True, text=True)
    if build.returncode != 0:
        return None
    try:
        test = subprocess.run([binary, "-test.count=1"], cwd=os.path.join(tree, "core"),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, ["(timeout)"], ""
    out = test.stdout + test.stderr
    failed = sorted(set(re.findall(r"^--- FAIL: (\w+)", out, re.M)))
    if test.returncode != 0 and not failed:
        failed = ["(exit %d)" % test.returncode]
    return test.returncode == 0, failed, out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run only the mutants whose names match this regex")
    ap.add_argument("--timeout", type=float, default=120, help="seconds a test run may take")
    args = ap.parse_args()
    mutants = [m for m in MUTANTS if not args.only or re.search(args.only, m[0])]
    t0 = time.monotonic()
    bad = 0
    with tempfile.TemporaryDirectory(prefix="fd-mutants-") as tree:
        copy_tree(tree)
        base = run_tests(tree, args.timeout)
        if base is None or not base[0]:
            print("the unmutated tests %s: no mutant can be judged" % ("do not build" if base is None else
                  "fail (%s)\n%s" % (" ".join(base[1]), base[2][-4000:])), file=sys.stderr)
            return 2
        width = max(len(m[0]) for m in mutants)
        for name, path, old, new in mutants:
            target = os.path.join(tree, path)
            with open(target) as f:
                src = f.read()
            if src.count(old) != 1:
                print("%-*s  STALE: found %d times in %s" % (width, name, src.count(old), path))
                bad += 1
                continue
            with open(target, "w") as f:
                f.write(src.replace(old, new))
            try:
                result = run_tests(tree, args.timeout)
            finally:
                with open(target, "w") as f:
                    f.write(src)
            if result is None:
                print("%-*s  DOES NOT BUILD" % (width, name))
                bad += 1
                continue
            ok, failed, _ = result
            if ok:
                print("%-*s  SURVIVED" % (width, name))
                bad += 1
            else:
                print("%-*s  killed by %s" % (width, name, " ".join(failed)))
    print("%d mutants, %d survived or in error, %.0f s" % (len(mutants), bad, time.monotonic() - t0))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
