"""cpu_speed.py's jaxpage modes on two code bases side by side in one run: a git revision (the baseline) and this
working tree, in fresh processes that alternate (baseline first, then this tree, ``--rounds`` times), so that both
see the same machine load.

    python -m benchmarks.cpu_speed_revisions --baseline e37f476 [--rounds 3] [--json F] -- [cpu_speed.py options]

The baseline is exported with ``git archive`` into a temporary directory (no worktree, no checkout) and runs this
tree's cpu_speed.py. The table holds each revision's median tok/s over the rounds and the median of the paired
(same round) ratios this tree / baseline.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def measure(root: Path, options: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "benchmarks/cpu_speed.py", *options, "--repeats", "1", "--json", str(out)],
                   cwd=root, env=env, check=True)
    return {(row["streams"], row["mode"]): row["tokens_per_s"] for row in json.loads(out.read_text())["table"]}


def export(rev: str, path: Path) -> Path:
    path.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    (path / "benchmarks" / "cpu_speed.py").write_text((ROOT / "benchmarks" / "cpu_speed.py").read_text())
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", required=True, help="a git revision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("options", nargs="*", help="cpu_speed.py's options (after --), e.g. --modes jaxpage-f32")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict]] = {"baseline": [], "tree": []}
    loads = []
    with tempfile.TemporaryDirectory() as tmp:
        base = export(args.baseline, Path(tmp) / "baseline")
        for r in range(args.rounds):
            for name, root in (("baseline", base), ("tree", ROOT)):
                runs[name].append(measure(root, args.options, Path(tmp) / f"{name}-{r}.json"))
                loads.append(os.getloadavg())
    rows = []
    for key in runs["tree"][0]:
        base_s, tree_s = ([run[key] for run in runs[name]] for name in ("baseline", "tree"))
        rows.append({"streams": key[0], "mode": key[1], "baseline_tok_s": statistics.median(base_s),
                     "tree_tok_s": statistics.median(tree_s), "baseline_all": base_s, "tree_all": tree_s,
                     "ratio": statistics.median(t / b for t, b in zip(tree_s, base_s))})
    print(f"| streams | mode | {args.baseline} tok/s | this tree tok/s | ratio (paired median) |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['streams']} | {row['mode']} | {row['baseline_tok_s']:.1f} | {row['tree_tok_s']:.1f} | "
              f"{row['ratio']:.3f} |")
    print("load averages after each process:", [round(x[0], 1) for x in loads])
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": args.baseline, "options": args.options, "rows": rows,
                                               "load_averages": loads}, indent=1))


if __name__ == "__main__":
    main()
