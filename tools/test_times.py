"""What the test suite costs, per Bazel target, from the last `bazel test //...`: wall seconds (Bazel's
test.xml), CPU seconds and pytest items (common.tests.helpers.run_pytest's test_accounting.json),
and the processes each target started (common.parallel.launch_log's launches.jsonl): torchrun
worlds, Ray clusters, critic servers, other interpreters, and their seconds until ready.

  python tools/test_times.py                 the table, on stdout
  python tools/test_times.py --write-docs    ... and into docs/TESTS.md (between its markers)
  python tools/test_times.py --check         fail (exit 1) when the suite is over its budget
                                             (tools/test_budget.json), naming the slowest targets

The budget is in CPU seconds, not wall seconds: a busy machine (CI runs NeMo-RL's environment beside
the suite) stretches wall time, not the work done; and in launches, which do not vary at all.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import os
import sys
import xml.etree.ElementTree as ElementTree
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET = os.path.join(ROOT, "tools", "test_budget.json")
DOCS = os.path.join(ROOT, "docs", "TESTS.md")
BEGIN, END = "<!-- test-times: begin (tools/test_times.py --write-docs) -->", "<!-- test-times: end -->"
KINDS = ("torchrun", "ray", "server", "python")


@dataclasses.dataclass
class Target:
    label: str
    wall_s: float = 0.0
    cpu_s: float = 0.0
    shards: int = 0
    passed: int = 0
    skipped: int = 0
    failed: int = 0
    accounted: bool = True
    launches: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    startup_s: float = 0.0  # seconds until ready: each torchrun world's slowest rank, each other process

    @property
    def items(self) -> int:
        return self.passed + self.skipped + self.failed


def _shard_dirs(testlogs: str):
    for xml in sorted(glob.glob(os.path.join(testlogs, "**", "test.xml"), recursive=True)):
        directory = os.path.dirname(xml)
        relative = os.path.relpath(directory, testlogs)
        parts = relative.split(os.sep)
        if parts[-1].startswith("shard_") and "_of_" in parts[-1]:
            parts = parts[:-1]
        yield "//" + "/".join(parts[:-1]) + ":" + parts[-1], directory


def _read_outputs(directory: str) -> dict[str, str]:
    """test.outputs: outputs.zip (Bazel's default) or the files themselves."""
    outputs = os.path.join(directory, "test.outputs")
    found = {}
    archive = os.path.join(outputs, "outputs.zip")
    if os.path.exists(archive):
        with zipfile.ZipFile(archive) as zipped:
            for name in zipped.namelist():
                found[os.path.basename(name)] = zipped.read(name).decode(errors="replace")
    for name in ("test_accounting.json", "launches.jsonl"):
        path = os.path.join(outputs, name)
        if os.path.exists(path):
            with open(path) as file:
                found[name] = file.read()
    return found


def _add_launches(target: Target, text: str) -> None:
    starts, ready = {}, {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a killed process
        if record.get("event") == "start":
            starts[record["pid"]] = record
        elif record.get("event") == "ready":
            ready.setdefault(record["pid"], record["at"])
    worlds = collections.defaultdict(list)
    ray_clusters = set()
    for pid, start in starts.items():
        until_ready = (ready[pid] - start["started"]) if pid in ready and start.get("started") else None
        if start["kind"] == "torchrun":
            worlds[start["run"]].append(until_ready or 0.0)
        elif start["kind"] == "ray":
            ray_clusters.add(start["ppid"])  # a Ray worker's parent is its cluster's raylet
            target.launches["ray workers"] += 1
        else:
            target.launches[start["kind"]] += 1
            target.startup_s += until_ready or 0.0
    target.launches["torchrun"] += len(worlds)
    target.launches["torchrun ranks"] += sum(len(ranks) for ranks in worlds.values())
    target.startup_s += sum(max(ranks) for ranks in worlds.values())
    target.launches["ray"] += len(ray_clusters)


def read_targets(testlogs: str) -> list[Target]:
    targets: dict[str, Target] = {}
    for label, directory in _shard_dirs(testlogs):
        target = targets.setdefault(label, Target(label))
        target.shards += 1
        for case in ElementTree.parse(os.path.join(directory, "test.xml")).iter("testcase"):
            target.wall_s += float(case.get("time") or 0)
        outputs = _read_outputs(directory)
        if "test_accounting.json" not in outputs:
            target.accounted = False
            continue
        accounting = json.loads(outputs["test_accounting.json"])
        target.cpu_s += accounting["cpu_seconds"]
        for test in accounting["tests"].values():
            setattr(target, test["outcome"], getattr(target, test["outcome"]) + 1)
        _add_launches(target, outputs.get("launches.jsonl", ""))
    return sorted(targets.values(), key=lambda t: -t.wall_s)


@dataclasses.dataclass
class Totals:
    targets: int
    wall_s: float
    cpu_s: float
    items: int
    skipped: int
    launches: collections.Counter
    startup_s: float
    unaccounted: list


def totals(targets: list[Target]) -> Totals:
    launches = collections.Counter()
    for target in targets:
        launches.update(target.launches)
    return Totals(len(targets), sum(t.wall_s for t in targets), sum(t.cpu_s for t in targets),
                  sum(t.items for t in targets), sum(t.skipped for t in targets), launches,
                  sum(t.startup_s for t in targets), [t.label for t in targets if not t.accounted])


def _launch_cell(counter: collections.Counter) -> str:
    parts = []
    if counter["torchrun"]:
        parts.append(f"{counter['torchrun']} torchrun ({counter['torchrun ranks']} ranks)")
    if counter["ray"]:
        parts.append(f"{counter['ray']} Ray ({counter['ray workers']} workers)")
    if counter["server"]:
        parts.append(f"{counter['server']} server")
    if counter["python"]:
        parts.append(f"{counter['python']} python")
    return ", ".join(parts) or "-"


def table(targets: list[Target]) -> str:
    total = totals(targets)
    lines = [
        f"{total.targets} targets, {total.items} pytest items ({total.skipped} skipped): "
        f"{total.wall_s:.0f} s of test time summed over targets and shards (two run at once), "
        f"{total.cpu_s:.0f} CPU seconds; launches: {_launch_cell(total.launches)}; "
        f"{total.startup_s:.0f} s of them spent starting up (until each process had joined its world or was serving).",
        "",
        "| target | wall s | CPU s | items | launches | start-up s |",
        "|---|---:|---:|---:|---|---:|",
    ]
    for target in targets:
        shards = f" ({target.shards} shards)" if target.shards > 1 else ""
        cpu = f"{target.cpu_s:.0f}" if target.accounted else "?"
        lines.append(f"| `{target.label}`{shards} | {target.wall_s:.0f} | {cpu} | {target.items} | "
                     f"{_launch_cell(target.launches)} | {target.startup_s:.0f} |")
    return "\n".join(lines)


def write_docs(text: str, docs: str = DOCS) -> None:
    with open(docs) as file:
        content = file.read()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"{docs} has no {BEGIN} ... {END} markers to write the table between")
    head, _, rest = content.partition(BEGIN)
    _, _, tail = rest.partition(END)
    with open(docs + ".tmp", "w") as file:
        file.write(head + BEGIN + "\n" + text + "\n" + END + tail)
    os.replace(docs + ".tmp", docs)


def check(targets: list[Target], budget: dict) -> list[str]:
    """The budget's breaches, each a sentence naming what to look at (empty: within budget)."""
    total = totals(targets)
    slowest = ", ".join(f"{t.label} {t.cpu_s:.0f} CPU s / {t.wall_s:.0f} s ({_launch_cell(t.launches)})"
                        for t in sorted(targets, key=lambda t: -t.cpu_s)[:8])
    problems = []
    if total.unaccounted:
        problems.append(f"{len(total.unaccounted)} targets wrote no test_accounting.json (not run through "
                        f"common.tests.helpers.run_pytest?): {', '.join(total.unaccounted[:8])}")
    if total.cpu_s > budget["cpu_seconds"]:
        problems.append(f"the suite took {total.cpu_s:.0f} CPU seconds, over its budget of {budget['cpu_seconds']}; "
                        f"the costliest targets: {slowest}")
    for kind, most in budget["launches"].items():
        if total.launches[kind] > most:
            heaviest = ", ".join(f"{t.label} {t.launches[kind]}"
                                 for t in sorted(targets, key=lambda t: -t.launches[kind])[:6] if t.launches[kind])
            problems.append(f"the suite made {total.launches[kind]} {kind} launches, over its budget of {most}: "
                            f"{heaviest}")
    if problems:
        problems.append("Make the new tests cheaper (docs/TESTS.md: share a world, a smaller model, fewer "
                        f"launches) or, if the cost is worth it, raise the budget in {os.path.relpath(BUDGET, ROOT)} "
                        "and say why in the commit.")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--testlogs", default=os.path.join(ROOT, "bazel-testlogs"),
                        help="Bazel's test logs (default: this workspace's bazel-testlogs)")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/TESTS.md")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when over {os.path.relpath(BUDGET, ROOT)}")
    parser.add_argument("--budget", default=BUDGET, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not os.path.isdir(args.testlogs):
        print(f"test_times: no test logs at {args.testlogs}: run `bazel test //...` first", file=sys.stderr)
        return 2
    targets = read_targets(args.testlogs)
    if not targets:
        print(f"test_times: {args.testlogs} holds no test.xml: run `bazel test //...` first", file=sys.stderr)
        return 2
    text = table(targets)
    if args.check:
        with open(args.budget) as file:
            budget = json.load(file)
        total = totals(targets)
        problems = check(targets, budget)
        print(f"test budget: {total.cpu_s:.0f} of {budget['cpu_seconds']} CPU seconds, "
              f"launches {_launch_cell(total.launches)} ({total.wall_s:.0f} s of test time summed, "
              f"{total.items} pytest items)")
        for problem in problems:
            print(f"test budget: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.write_docs:
        write_docs(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
