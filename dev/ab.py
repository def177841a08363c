"""Before and after: the benchmark over two or more builds, in alternating rounds.

    python3 dev/ab.py --build before=WHEEL --build after=WHEEL [--passes 3] [--out DIR] \
        -- --shapes "b=1,L=32k;b=8,L=8k" --peers none --serving-shapes "b=8,L=32k"
    python3 dev/ab.py --build before=git:HEAD~1 --build after=git:HEAD -- --shapes "b=1,L=32k"
    python3 dev/ab.py --summarize DIR

A build is a wheel, a folder holding one wheel, a folder that already holds an
installed flash_decode (a `pip install --target` folder), or git:REV, a revision of
this repository, built into a wheel under --out first (`pip wheel --no-deps
--no-build-isolation`: the build's tools, Go and CUDA, must be installed). Wheels are
installed with `pip install --no-deps --target` under --out. Each pass runs `python -m
flash_decode.bench` once per build, with the arguments after `--` (plus --out and
--no-plot), from --out so that no source tree shadows the build; passes go forwards and
backwards in turn (A B, B A, A B, ...), so that a machine warming up or slowing down
over the run weighs on every build alike. Each run's results.json is kept as
DIR/<pass>_<build>/results.json (runs already there are removed first).

The summary: for every table case and serving case, each build's median µs over its
passes and their range, the change of each build's median against the first build's,
and "plan differs" where the builds' plans (split count, stage-1 kernel) for a case are
not the same. A change smaller than the builds' own spread is noise: run more passes.
Needs a GPU for the runs, not for --summarize.
"""

import argparse
import io
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
_RUN = re.compile(r"^(\d+)_(.+)$")
# A --lengths row's four timings (bench.LENGTHS_TIMINGS) and what the summary calls them.
_LENGTHS_TIMINGS = {"us": "planned", "unbalanced_us": "unbalanced", "even_us": "even",
                    "even_unbalanced_us": "even unbalanced"}


def parse_build(text):
    """NAME=PATH as (name, path); the name is what the summary calls the build."""
    name, sep, path = text.partition("=")
    if not sep or not re.fullmatch(r"\w+", name) or not path:
        raise argparse.ArgumentTypeError(f"a build is NAME=PATH (NAME letters, digits, _), got {text!r}")
    return name, pathlib.Path(path)


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = []
    if "--" in argv:
        at = argv.index("--")
        argv, bench_args = argv[:at], argv[at + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Arguments after -- go to python -m flash_decode.bench.")
    p.add_argument("--build", type=parse_build, action="append", default=[], metavar="NAME=PATH",
                   help="a wheel, a folder with one wheel, an installed-package folder, or git:REV "
                        "(two or more)")
    p.add_argument("--passes", type=int, default=3, help="runs of each build (default 3)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("ab-runs"), help="folder for runs and summary")
    p.add_argument("--summarize", type=pathlib.Path, metavar="DIR",
                   help="only summarize the runs already in DIR (against the build that run was given first)")
    args = p.parse_args(argv)
    args.bench_args = bench_args
    if args.summarize is None:
        names = [name for name, _ in args.build]
        if len(names) < 2 or len(set(names)) != len(names):
            p.error("give two or more --build NAME=PATH, each NAME once")
        if args.passes < 1:
            p.error("--passes must be at least 1")
        if any(a in ("--out", "--no-plot") or a.startswith("--out=") for a in bench_args):
            p.error("dev/ab.py sets the bench's --out and --no-plot itself")
    return args


def order(names, passes):
    """The runs, as (pass, build name): forwards on even passes, backwards on odd ones."""
    runs = []
    for i in range(passes):
        runs += [(i, name) for name in (names if i % 2 == 0 else names[::-1])]
    return runs


def find_wheel(path):
    """The wheel a build names: the file itself, or the one .whl in a folder; None for
    a folder without wheels (an installed package is used as it is)."""
    if path.is_file():
        return path
    wheels = sorted(path.glob("*.whl"))
    if len(wheels) > 1:
        raise SystemExit(f"{path} holds {len(wheels)} wheels: name one")
    return wheels[0] if wheels else None


def build_wheel(name, rev, out):
    """A wheel of revision rev of this repository, built under out: its tree exported
    with git archive, then pip wheel."""
    src, dist = (out / f"src_{name}").resolve(), (out / f"wheel_{name}").resolve()
    for d in (src, dist):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev}: {archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.12, and 3.11.4 on
            tar.extractall(src, filter="data")
        else:
            tar.extractall(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(src),
                    "-w", str(dist)], check=True)
    return find_wheel(dist)


def site_of(name, path, out):
    """The folder to put on PYTHONPATH for a build: its wheel (built first for git:REV)
    installed under out, or the folder itself when it already holds flash_decode."""
    wheel = build_wheel(name, str(path)[4:], out) if str(path).startswith("git:") else find_wheel(path)
    if wheel is None:
        if not (path / "flash_decode").is_dir():
            raise SystemExit(f"{path}: neither a wheel nor a folder holding flash_decode")
        return path.resolve()
    site = (out / f"site_{name}").resolve()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(site),
                    str(wheel)], check=True)
    return site


def load_runs(folder):
    """{build: [results.json contents, ...]} from folder's <pass>_<build> runs, in pass order."""
    runs = {}
    found = []
    for d in folder.iterdir():
        m = _RUN.match(d.name)
        if m and (d / "results.json").is_file():
            found.append((int(m.group(1)), m.group(2), d / "results.json"))
    for _, name, path in sorted(found):
        runs.setdefault(name, []).append(json.loads(path.read_text()))
    return runs


def case_times(result):
    """{case: (µs, plan)} of one bench run: its table rows (ours_us), serving rows (us) and
    --lengths batches (each of their four timings). plan is what the row says of the plan
    (split count, kernel), or None."""
    cases = {}
    for r in result.get("rows", []):
        if r.get("ours_us") is not None:
            key = f"{r['dtype']} b={r['b']} {r['hq']}/{r['hkv']} d{r['d']} L={r['L']} sq{r['sq']}"
            cases[key] = (r["ours_us"], (r.get("num_splits"), r.get("kernel")))
    for r in (result.get("meta") or {}).get("serving") or []:
        if r.get("us") is not None:
            key = f"serving {r['case']} {r['dtype']} b={r['b']} {r['hq']}/{r['hkv']} d{r['d']} L={r['L']} sq{r['sq']}"
            cases[key] = (r["us"], None)
    for r in (result.get("meta") or {}).get("lengths") or []:
        for timing, name in _LENGTHS_TIMINGS.items():
            if r.get(timing) is not None:
                key = f"lengths b={r['b']} {r['hq']}/{r['hkv']} d{r['d']} [{r['lengths']}] {name}"
                cases[key] = (r[timing], (r.get("num_splits"),))
    return cases


def summarize(runs):
    """Per case, in first-seen order: {"case", "builds": {name: {"median", "min", "max",
    "passes"}}, "change": {name: median / first build's median - 1}, "plan_differs"}."""
    names = list(runs)
    table = {}
    for name in names:
        for result in runs[name]:
            for case, (us, plan) in case_times(result).items():
                entry = table.setdefault(case, {"times": {}, "plans": {}})
                entry["times"].setdefault(name, []).append(us)
                entry["plans"].setdefault(name, set()).add(plan)
    out = []
    for case, entry in table.items():
        builds = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "passes": len(v)}
                  for name, v in entry["times"].items()}
        first = builds.get(names[0])
        change = {name: b["median"] / first["median"] - 1 for name, b in builds.items()
                  if first and name != names[0]}
        plans = [p for p in entry["plans"].values() if p != {None}]
        out.append({"case": case, "builds": builds, "change": change,
                    "plan_differs": len({frozenset(p) for p in plans}) > 1})
    return out


def format_summary(summary, names):
    width = max([len(s["case"]) for s in summary] + [4])
    lines = [f"{'case':<{width}}  " + "  ".join(f"{n + ' µs (min-max)':>24}" for n in names)
             + "".join(f"  {n + ' vs ' + names[0]:>14}" for n in names[1:])]
    for s in summary:
        cells = []
        for n in names:
            b = s["builds"].get(n)
            cells.append(f"{b['median']:9.2f} ({b['min']:.2f}-{b['max']:.2f})" if b else "n/a")
        text = f"{s['case']:<{width}}  " + "  ".join(f"{c:>24}" for c in cells)
        text += "".join(f"  {s['change'][n] * 100:+13.1f}%" if n in s["change"] else f"  {'n/a':>14}"
                        for n in names[1:])
        lines.append(text + ("  plan differs" if s["plan_differs"] else ""))
    return "\n".join(lines)


def write_summary(folder, names=None):
    """Summarize folder's runs (of the named builds, the first one the baseline; default:
    every build, in the order the run that made them was given them, builds.json, else by
    name) into summary.json and summary.txt, and print it."""
    runs = load_runs(folder)
    given = folder / "builds.json"
    if names is None and given.is_file():
        names = json.loads(given.read_text())
    names = [n for n in (names or runs) if n in runs]
    summary = summarize({n: runs[n] for n in names})
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    text = format_summary(summary, names)
    (folder / "summary.txt").write_text(text + "\n")
    print(text)


def main(argv=None):
    args = parse_args(argv)
    if args.summarize is not None:
        write_summary(args.summarize)
        return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for d in out.iterdir():  # an earlier comparison's runs would join this one's summary
        if d.is_dir() and _RUN.match(d.name):
            shutil.rmtree(d)
    sites = {name: site_of(name, path, out) for name, path in args.build}
    names = [name for name, _ in args.build]
    (out / "builds.json").write_text(json.dumps(names))  # --summarize's baseline: the first given
    for i, name in order(names, args.passes):
        run_dir = (out / f"{i}_{name}").resolve()
        env = dict(os.environ, PYTHONPATH=str(sites[name]))
        print(f"pass {i + 1}/{args.passes}: {name}", flush=True)
        with open(out / f"{i}_{name}.log", "w") as log:
            done = subprocess.run([sys.executable, "-m", "flash_decode.bench", *args.bench_args,
                                   "--out", str(run_dir), "--no-plot"], cwd=out, env=env, stdout=log,
                                  stderr=subprocess.STDOUT)
        if done.returncode != 0:
            print(f"  the bench failed ({done.returncode}): see {out / f'{i}_{name}.log'}", flush=True)
    write_summary(out, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
