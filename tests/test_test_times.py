"""tools/test_times.py reads what Bazel and the suite's accounting leave in bazel-testlogs (test.xml,
outputs.zip with test_accounting.json and launches.jsonl) into the per-target table of docs/TESTS.md,
and its --check fails a suite over its budget, naming the costliest targets."""

import json
import os
import sys
import zipfile

from critic_adapters.common.tests.helpers import run_pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import test_times  # noqa: E402  (tools/ is not a package)


def write_target(testlogs, path, seconds, cpu=None, tests=None, launches=()):
    """One target's (or shard's) directory as Bazel 4.2 leaves it; cpu None: no accounting."""
    directory = testlogs / path
    (directory / "test.outputs").mkdir(parents=True)
    (directory / "test.xml").write_text(
        '<?xml version="1.0" encoding="UTF-8"?>\n<testsuites>\n  <testsuite name="x" tests="1" failures="0" '
        f'errors="0">\n    <testcase name="x" status="run" duration="{int(seconds)}" time="{int(seconds)}">'
        '</testcase>\n  </testsuite>\n</testsuites>\n')
    if cpu is None:
        return
    with zipfile.ZipFile(directory / "test.outputs" / "outputs.zip", "w") as archive:
        archive.writestr("test_accounting.json", json.dumps({"cpu_seconds": cpu, "tests": tests or {}}))
        archive.writestr("launches.jsonl", "".join(json.dumps(line) + "\n" for line in launches) + '{"event": "st')


def start(pid, kind, started, run=None, ppid=1):
    return {"event": "start", "pid": pid, "ppid": ppid, "kind": kind, "started": started, "run": run}


def ready(pid, at):
    return {"event": "ready", "pid": pid, "what": "world", "at": at}


def suite(tmp_path):
    testlogs = tmp_path / "bazel-testlogs"
    passed = {"outcome": "passed", "seconds": 1.0}
    write_target(testlogs, "tests/test_jobs/shard_1_of_2", 100, cpu=150, tests={"a": passed, "b[x]": passed},
                 launches=[start(10, "torchrun", 0.0, run="r1"), start(11, "torchrun", 0.5, run="r1"),
                           ready(10, 4.0), ready(11, 6.0),  # a world is ready when its slowest rank is: 5.5 s
                           start(12, "torchrun", 10.0, run="r2"), ready(12, 13.0),
                           start(13, "python", 20.0), ready(13, 22.0)])
    write_target(testlogs, "tests/test_jobs/shard_2_of_2", 50, cpu=60,
                 tests={"c": {"outcome": "skipped", "seconds": 0.0}},
                 launches=[start(20, "ray", 0.0, ppid=7), start(21, "ray", 0.0, ppid=7), start(22, "ray", 1.0, ppid=8),
                           start(23, "server", 2.0), ready(23, 9.0)])
    write_target(testlogs, "common/tests/test_small", 10, cpu=8, tests={"d": passed})
    return testlogs


def test_the_table_counts_each_targets_time_items_and_launches(tmp_path):
    targets = test_times.read_targets(str(suite(tmp_path)))
    assert [t.label for t in targets] == ["//tests:test_jobs", "//common/tests:test_small"]
    jobs = targets[0]
    assert (jobs.wall_s, jobs.cpu_s, jobs.shards, jobs.passed, jobs.skipped) == (150, 210, 2, 2, 1)
    assert (jobs.launches["torchrun"], jobs.launches["torchrun ranks"], jobs.launches["python"]) == (2, 3, 1)
    assert (jobs.launches["ray"], jobs.launches["ray workers"], jobs.launches["server"]) == (2, 3, 1)
    assert abs(jobs.startup_s - (5.5 + 3.0 + 2.0 + 7.0)) < 1e-9
    table = test_times.table(targets)
    assert "| `//tests:test_jobs` (2 shards) | 150 | 210 | 3 | 2 torchrun (3 ranks), 2 Ray (3 workers), 1 server, " \
           "1 python | 18 |" in table, table
    assert "3 targets" not in table and "2 targets, 4 pytest items (1 skipped)" in table, table


def test_the_check_fails_over_budget_naming_the_costliest_targets(tmp_path):
    testlogs = suite(tmp_path)
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"cpu_seconds": 300, "launches": {"torchrun": 2, "ray": 2}}))
    assert test_times.main(["--testlogs", str(testlogs), "--check", "--budget", str(budget)]) == 0
    targets = test_times.read_targets(str(testlogs))
    problems = test_times.check(targets, {"cpu_seconds": 200, "launches": {"torchrun": 1, "ray": 2}})
    assert len(problems) == 3, problems  # CPU, torchrun, and what to do
    assert "218 CPU seconds, over its budget of 200" in problems[0] and "//tests:test_jobs 210 CPU s" in problems[0]
    assert problems[0].index("//tests:test_jobs") < problems[0].index("//common/tests:test_small")
    assert "2 torchrun launches, over its budget of 1: //tests:test_jobs 2" in problems[1], problems
    budget.write_text(json.dumps({"cpu_seconds": 200, "launches": {}}))
    assert test_times.main(["--testlogs", str(testlogs), "--check", "--budget", str(budget)]) == 1


def test_a_target_without_accounting_fails_the_check_and_the_docs_table_is_rewritten_in_place(tmp_path):
    testlogs = suite(tmp_path)
    write_target(testlogs, "tests/test_plain", 5)
    targets = test_times.read_targets(str(testlogs))
    problems = test_times.check(targets, {"cpu_seconds": 10**6, "launches": {}})
    assert problems and "1 targets wrote no test_accounting.json" in problems[0] and "//tests:test_plain" in problems[0]
    docs = tmp_path / "TESTS.md"
    docs.write_text(f"# Tests\nbefore\n{test_times.BEGIN}\nold table\n{test_times.END}\nafter\n")
    test_times.write_docs("new table", str(docs))
    assert docs.read_text() == f"# Tests\nbefore\n{test_times.BEGIN}\nnew table\n{test_times.END}\nafter\n"


if __name__ == "__main__":
    run_pytest(__file__)
