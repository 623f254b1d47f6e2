"""tools/env-matrix: the package installed into the environments RL stacks pin, tested there.

  tools/env-matrix                      every environment below, every group: writes docs/SUPPORTED.md
  tools/env-matrix --env nemo-rl --groups wheel,fsdp-engine      one environment, some groups (CI)
  tools/env-matrix --list               the environments and groups

For each environment: a venv in the cache (outside the checkout: $CRITIC_ENV_CACHE, default
~/.cache/critic-adapters; uv's download cache is kept there too, so a second run fetches nothing),
made with uv from the named Python (pyenv's, or python3.X on PATH); the wheel built from this
checkout (`pip wheel --no-deps`) installed with the environment's extras and pins; then the groups:
  wheel   from an empty directory, against the installed wheel: the default job
          (`python -m critic_adapters.backends.fsdp.train --nproc 2`, held-out EV >= 0.9) and
          tools/env_check.py (console script, each backend's engine == load_critic, verl's entry point)
  others  pytest over this checkout's test files (they are not in the wheel) with the checkout first on
          PYTHONPATH, the environment's libraries under it; pass / fail / skip counted from JUnit XML.
The table goes to docs/SUPPORTED.md (--out) with a JSON copy beside it; exit 1 when anything failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("CRITIC_ENV_CACHE", os.path.expanduser("~/.cache/critic-adapters"))
UV_VERSION = "uv==0.13.9"


@dataclasses.dataclass(frozen=True)
class Group:
    """pytest arguments (paths relative to the checkout) and environment variables for them."""
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    timeout_s: int = 1800


GROUPS = {
    "common": Group(("common/tests",)),
    "fsdp-engine": Group(("backends/fsdp/tests/test_engine_contract.py", "backends/fsdp/tests/test_engine_parity.py",
                          "tests/conformance/test_conformance.py"), env=(("CONFORMANCE_BACKEND", "fsdp"),)),
    "fsdp-job": Group(("backends/fsdp/tests/test_training_job.py",)),
    # values against the HF critic at TP / PP / SP / DP, and parallel_state from our mesh equal to megatron-core's
    # own initialize_model_parallel (every group global this megatron-core has)
    # and training: megatron's distributed optimizer and bf16 steps against the replicated fp32 one;
    # its checkpoint's rectangles against this megatron-core's own shard placement, read back exactly
    "megatron": Group(("backends/megatron/tests/test_values_parity.py", "tests/test_sub_world.py",
                       "backends/megatron/tests/test_optimizer_and_precision.py",
                       "backends/megatron/tests/test_optimizer_state.py")),
    "veomni": Group(("backends/veomni/tests/test_values_parity.py",)),
    "ray": Group(("integrations/ray/tests/test_group.py",)),
    # the verl slot against verl installed in the environment itself (no overlay over it)
    "verl": Group(("tests/verl/test_verl_engine.py",), env=(("CRITIC_VERL_OVERLAY", "none"),)),
}
FSDP_SUBSET = ("wheel", "common", "fsdp-engine", "fsdp-job")


@dataclasses.dataclass(frozen=True)
class Environment:
    name: str
    stack: str
    python: str
    pins: tuple[str, ...]
    extras: tuple[str, ...]
    groups: tuple[str, ...]
    no_deps: tuple[str, ...] = ()
    """installed after, with --no-deps (VeOmni: its declared timm would replace torch)."""
    backends: tuple[str, ...] = ("fsdp",)
    """the engines tools/env_check.py compares with load_critic"""
    note: str = ""


ENVIRONMENTS = [
    Environment("ours", "this project's dev venv pins (requirements/)", "3.11",
                pins=("torch==2.13.0", "-c requirements/constraints.txt"),
                extras=("fsdp", "megatron", "veomni", "ray", "lora", "trl", "vision", "test"), no_deps=("veomni==0.1.12",),
                groups=(*FSDP_SUBSET, "megatron", "veomni", "ray"), backends=("fsdp", "megatron", "veomni"),
                note="the registry's torch 2.13.0 (a CUDA build, run on CPU), not the dev venv's CPU build"),
    Environment("verl-0.9.1", "verl 0.9.1 and its pins", "3.11",
                pins=("torch==2.11.0", "transformers==5.9.0", "verl==0.9.1", "tensordict==0.10.0",
                      "megatron-core==0.16.1"),
                extras=("fsdp", "megatron", "veomni", "verl", "ray", "lora", "test"), no_deps=("veomni==0.1.12",),
                groups=(*FSDP_SUBSET, "megatron", "veomni", "verl"), backends=("fsdp", "megatron", "veomni")),
    Environment("nemo-rl", "NeMo-RL main's pins", "3.13",
                pins=("torch==2.11.0", "transformers==5.8.1", "megatron-core==0.19.2"),
                extras=("fsdp", "megatron", "veomni", "lora", "test"), no_deps=("veomni==0.1.12",),
                groups=(*FSDP_SUBSET, "megatron", "veomni"), backends=("fsdp", "megatron", "veomni"),
                note="veomni 0.1.12 declares Python < 3.13; installed with --no-deps it runs"),
    Environment("openrlhf-0.11.2", "OpenRLHF 0.11.2's pins", "3.12",
                pins=("torch==2.11.0", "transformers==5.15.0", "ray==2.55.0"),
                extras=("fsdp", "ray", "lora", "test"),
                groups=(*FSDP_SUBSET, "ray"),
                note="torch is vLLM's in OpenRLHF (not pinned by it): 2.11.0 here; deepspeed not installed (unused)"),
    Environment("vllm-0.34", "vLLM 0.34's torch and transformers, on Python 3.10", "3.10",
                pins=("torch==2.14.0", "transformers==5.20.2", "megatron-core==0.16.1"),
                extras=("fsdp", "megatron", "lora", "test"),
                groups=(*FSDP_SUBSET, "megatron"), backends=("fsdp", "megatron"),
                note="vLLM 0.34 takes transformers >= 5.16.1, < 5.23; on Python 3.10 the newest served is 5.20.2 "
                     "(5.21 and later need Python >= 3.11); veomni 0.1.12 needs Python >= 3.11: not installed"),
    Environment("newest", "the newest the registries serve, on Python 3.12", "3.12",
                pins=("torch==2.14.1", "transformers==5.25.0", "kernels", "trl==1.16.0", "peft==0.21.2", "ray==2.60.0",
                      "megatron-core==0.19.2"),
                extras=("fsdp", "megatron", "ray", "lora", "test"),
                groups=(*FSDP_SUBSET, "megatron", "ray"), backends=("fsdp", "megatron"),
                note="trl 1.16 has no value-head class (trl #7020); veomni 0.1.12 needs transformers <= 5.22"),
]
# What the table cannot say, said under it (docs/SUPPORTED.md).
NOTES = """\
- pyproject.toml declares what the table shows: Python 3.10 to 3.13, torch 2.11 to 2.14, transformers 5.8
  to 5.25 (on Python 3.10 transformers goes up to 5.20.2: 5.21 and later need 3.11); the extras' ranges
  beside them (megatron-core 0.16 on Python <= 3.11, 0.19 on 3.12 and later).
- VeOmni 0.1.12 is installed with `pip install --no-deps 'veomni==0.1.12'` (its declared timm pulls a
  torchvision that replaces torch) and needs transformers <= 5.22 and packaging < 26 (the `veomni` extra);
  it declares Python 3.11 to 3.12 and runs on 3.13 here. The veomni backend refuses to build without it,
  naming that line.
- trl is optional: its value-head class is found in trl 0.27 to 1.12 (1.13 removed it; the tests that need
  trl's own files skip there, naming the trl they found).
- A checkpoint's declared dtype (`"dtype": "bfloat16"`, as verl saves critics) never sets the engine's:
  every backend builds the critic in `engine.model.dtype` on every transformers version above (before 5.12
  transformers built a critic class's backbone in the checkpoint's dtype; tests/test_saved_critics.py).
"""
VERSIONS = ("torch", "transformers", "megatron-core", "veomni", "ray", "verl", "trl", "peft")


def say(message: str) -> None:
    print(f"[env-matrix {time.strftime('%H:%M:%S')}] {message}", flush=True)


def run(command: list[str], *, timeout: int, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)


def uv() -> str:
    """uv from PATH, else installed once into the cache with pip (the registries serve it)."""
    found = shutil.which("uv")
    if found:
        return found
    tool = os.path.join(CACHE, "uv-tool")
    path = os.path.join(tool, "bin", "uv")
    if not os.path.exists(path):
        say(f"installing {UV_VERSION} into {tool}")
        subprocess.run([sys.executable, "-m", "venv", tool], check=True)
        subprocess.run([os.path.join(tool, "bin", "pip"), "install", "-q", "--disable-pip-version-check", UV_VERSION],
                       check=True)
    return path


def interpreter(version: str) -> str:
    candidates = sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python")), reverse=True)
    candidates.append(shutil.which(f"python{version}"))
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            return candidate
    raise SystemExit(f"env-matrix: no Python {version} here (looked for python{version} on PATH and in ~/.pyenv)")


def build_wheel(out: str) -> str:
    """The wheel of this checkout, built from a copy (the build writes build/ and *.egg-info)."""
    with tempfile.TemporaryDirectory() as tmp:
        source = os.path.join(tmp, "src")
        shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
            ".venv", ".overlays", "bazel-*", "outputs", "runs", "__pycache__", ".git", ".gpu-wheels"))
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--disable-pip-version-check",
                        source, "-w", out], check=True)
    (wheel,) = glob.glob(os.path.join(out, "critic_adapters-*.whl"))
    return wheel


def make_environment(spec: Environment, wheel: str) -> str:
    """The environment's venv with the wheel installed; its python's path."""
    uv_bin, env = uv(), os.path.join(CACHE, "envs", spec.name)
    python = os.path.join(env, "bin", "python")
    uv_env = dict(os.environ, UV_CACHE_DIR=os.path.join(CACHE, "uv"))
    stamp = hashlib.sha256(repr(spec).encode()).hexdigest()
    stamp_file = os.path.join(env, ".env-matrix-stamp")
    fresh = os.path.exists(python) and os.path.exists(stamp_file) and open(stamp_file).read() == stamp
    if not fresh:  # a new environment, or its declaration changed: made again from nothing
        shutil.rmtree(env, ignore_errors=True)
        subprocess.run([uv_bin, "venv", "-q", "--seed", "--python", interpreter(spec.python), env], check=True, env=uv_env)
    requirements = []  # "-c FILE": constraints from a file of this checkout
    for pin in spec.pins:
        requirements += ["-c", os.path.join(REPO, pin.split()[1])] if pin.startswith("-c ") else [pin]
    target = f"{wheel}[{','.join(spec.extras)}]"
    say(f"{spec.name}: installing {os.path.basename(wheel)}[{','.join(spec.extras)}] with {' '.join(spec.pins)}")
    result = run([uv_bin, "pip", "install", "-q", "--python", python, "--reinstall-package", "critic-adapters", target,
                  *requirements], timeout=3600, env=uv_env)
    if result.returncode != 0:
        raise RuntimeError(f"installing into {spec.name} failed:\n{result.stderr[-3000:]}")
    if spec.no_deps:
        result = run([uv_bin, "pip", "install", "-q", "--python", python, "--no-deps", *spec.no_deps], timeout=1800,
                     env=uv_env)
        if result.returncode != 0:
            raise RuntimeError(f"installing {spec.no_deps} into {spec.name} failed:\n{result.stderr[-3000:]}")
    with open(stamp_file, "w") as f:
        f.write(stamp)
    return python


def versions(python: str) -> dict[str, str]:
    code = ("import importlib.metadata as m, json, sys\nout = {'python': sys.version.split()[0]}\n"
            f"for name in {VERSIONS!r}:\n"
            "    try: out[name] = m.version(name)\n    except m.PackageNotFoundError: pass\nprint(json.dumps(out))")
    return json.loads(run([python, "-c", code], timeout=120).stdout)


def clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def wheel_group(python: str, spec: Environment) -> dict:
    """The default job and tools/env_check.py, from an empty directory, against the installed wheel."""
    with tempfile.TemporaryDirectory() as empty:
        job = run([python, "-m", "critic_adapters.backends.fsdp.train", "--nproc", "2", "trainer.run_dir=run"],
                  cwd=empty, env=clean_env(), timeout=1800)
        last = job.stdout.strip().splitlines()[-1] if job.stdout.strip() else ""
        ev = float(last.split("=", 1)[1]) if last.startswith("final explained_variance=") else None
        check = run([python, os.path.join(REPO, "tools", "env_check.py"), *spec.backends], cwd=empty, env=clean_env(),
                    timeout=1800)
    found = re.search(r"^env-check: (.*)$", check.stdout, flags=re.M)
    checks = json.loads(found.group(1)) if found else {"env_check": f"FAILED: {check.stderr[-500:]}"}
    checks.pop("package", None)
    job_ok = job.returncode == 0 and ev is not None and ev >= 0.9
    checks = {"default job": "ok" if job_ok else f"FAILED: rc={job.returncode}, EV={ev}: {job.stderr[-500:]}", **checks}
    failures = [f"{name}: {value}" for name, value in checks.items() if str(value).startswith("FAILED")]
    return {"passed": len(checks) - len(failures), "failed": len(failures), "skipped": 0, "failures": failures,
            "ev": ev, "checks": checks}


def pytest_group(python: str, name: str, group: Group, scratch: str) -> dict:
    """The group's tests from this checkout (first on PYTHONPATH) in the environment."""
    link_root = os.path.join(scratch, "src")
    if not os.path.exists(link_root):
        os.makedirs(link_root)
        os.symlink(REPO, os.path.join(link_root, "critic_adapters"))
    extra = {}
    for key, value in group.env:
        if value == "<empty>":
            value = os.path.join(scratch, f"empty-{key}")
            os.makedirs(value, exist_ok=True)
        extra[key] = value
    report = os.path.join(scratch, f"{name}.xml")
    args = [os.path.join(REPO, a) for a in group.args]
    try:
        result = run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib",
                      f"--junitxml={report}", *args], cwd=scratch, env=clean_env(PYTHONPATH=link_root, **extra),
                     timeout=group.timeout_s)
        tail = result.stdout[-1500:]
    except subprocess.TimeoutExpired:
        tail = f"timed out after {group.timeout_s} s"
    if not os.path.exists(report):
        return {"passed": 0, "failed": 1, "skipped": 0, "failures": [f"{name}: no report: {tail}"]}
    passed = failed = skipped = 0
    failures = []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        outcome = [child.tag for child in case]
        if "failure" in outcome or "error" in outcome:
            failed += 1
            failures.append(f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}")
        elif "skipped" in outcome:
            skipped += 1
        else:
            passed += 1
    return {"passed": passed, "failed": failed, "skipped": skipped, "failures": failures}


def run_environment(spec: Environment, wheel: str, groups: list[str]) -> dict:
    """The environment made and its groups run, holding its lock (another run waits: one venv each)."""
    import fcntl

    os.makedirs(os.path.join(CACHE, "envs"), exist_ok=True)
    with open(os.path.join(CACHE, "envs", f"{spec.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _run_environment(spec, wheel, groups)


def _run_environment(spec: Environment, wheel: str, groups: list[str]) -> dict:
    started = time.time()
    record = {"name": spec.name, "stack": spec.stack, "note": spec.note, "groups": {}}
    try:
        python = make_environment(spec, wheel)
    except (RuntimeError, subprocess.SubprocessError) as err:
        record["error"] = str(err)[-2000:]
        say(f"{spec.name}: {record['error']}")
        return record
    record["versions"] = versions(python)
    say(f"{spec.name}: {record['versions']}")
    with tempfile.TemporaryDirectory() as scratch:
        for name in groups:
            say(f"{spec.name}: {name} ...")
            result = wheel_group(python, spec) if name == "wheel" else pytest_group(python, name, GROUPS[name], scratch)
            record["groups"][name] = result
            say(f"{spec.name}: {name}: {result['passed']} passed, {result['failed']} failed, {result['skipped']} skipped"
                + (f" ({'; '.join(result['failures'][:5])})" if result["failures"] else ""))
    record["seconds"] = round(time.time() - started)
    return record


def write_table(records: list[dict], path: str, command: str, date: str | None = None) -> None:
    date = date or datetime.date.today().isoformat()
    lines = ["# Supported environments", "",
             f"Written by `{command}` on {date} (CPU, 2 cores, gloo): each environment is",
             "a fresh venv with the wheel built from this checkout and the extras it can hold. `wheel`: from an empty",
             "directory, against the installed wheel, the default job (`python -m critic_adapters.backends.fsdp.train",
             "--nproc 2`, held-out EV shown) and `tools/env_check.py` (the console script, each listed backend's engine",
             "equal to `load_critic`, verl's plugin entry point). The other groups are this checkout's test files run",
             "in that environment (the tests are not in the wheel). Counts are passed / failed / skipped.", "",
             "| environment | Python | torch | transformers | other | " + " | ".join(GROUPS_ORDER) + " |",
             "|---|---|---|---|---|" + "---|" * len(GROUPS_ORDER)]
    for record in records:
        v = record.get("versions", {})
        other = ", ".join(f"{k} {v[k]}" for k in VERSIONS[2:] if k in v)
        cells = []
        for name in GROUPS_ORDER:
            result = record["groups"].get(name)
            if result is None:
                cells.append("—")
                continue
            cell = f"{result['passed']} / {result['failed']} / {result['skipped']}"
            if name == "wheel" and result.get("ev") is not None:
                cell += f" (EV {result['ev']:.3f})"
            cells.append(("**" + cell + "**") if result["failed"] else cell)
        if "error" in record:
            cells = ["install failed"] + ["—"] * (len(GROUPS_ORDER) - 1)
        lines.append(f"| {record['name']} | {v.get('python', '?')} | {v.get('torch', '?')} | {v.get('transformers', '?')} "
                     f"| {other} | " + " | ".join(cells) + " |")
    lines += ["", NOTES, "Per environment:", ""]
    for record in records:
        lines.append(f"- **{record['name']}** ({record['stack']}){': ' + record['note'] if record['note'] else ''}.")
        backends = record.get("groups", {}).get("wheel", {}).get("checks", {})
        if backends:
            lines.append("  Checks: " + ", ".join(f"{k} {v}" for k, v in backends.items()) + ".")
        failures = [f for result in record.get("groups", {}).values() for f in result["failures"]]
        if "error" in record:
            lines.append(f"  Install failed: `{record['error'][-300:]}`")
        if failures:
            lines.append("  Failed: " + "; ".join(f"`{f[:200]}`" for f in failures[:12]) + ".")
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.splitext(path)[0].lower() + ".json", "w") as f:
        json.dump({"command": command, "date": date, "records": records}, f, indent=1)


GROUPS_ORDER = ("wheel", *GROUPS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/env-matrix", description=__doc__.split("\n")[0])
    parser.add_argument("--env", action="append", help="an environment's name (repeatable; default: all)")
    parser.add_argument("--groups", help="comma-separated groups (default: each environment's own)")
    parser.add_argument("--out", default=None, help="the table to write (default: docs/SUPPORTED.md for a full run, "
                                                    "none otherwise)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--update", action="store_true", help="merge this run's groups into the table's JSON copy "
                                                              "(docs/supported.json) and write the table again")
    parser.add_argument("--render", metavar="JSON", help="write --out (default docs/SUPPORTED.md) again from a "
                                                         "run's JSON copy, running nothing")
    args = parser.parse_args(argv)
    if args.list:
        for spec in ENVIRONMENTS:
            print(f"{spec.name:16} Python {spec.python}  {' '.join(spec.pins)}  groups: {','.join(spec.groups)}")
        print(f"groups: wheel, {', '.join(GROUPS)}")
        return 0
    if args.render:
        with open(args.render) as f:
            payload = json.load(f)
        if isinstance(payload, list):  # the first runs' copy: the records alone
            payload = {"records": payload, "command": "tools/env-matrix", "date": None}
        out = args.out or os.path.join(REPO, "docs", "SUPPORTED.md")
        write_table(payload["records"], out, payload["command"], payload["date"])
        say(f"wrote {out}")
        return 0
    names = {spec.name: spec for spec in ENVIRONMENTS}
    unknown = [n for n in args.env or [] if n not in names]
    groups = args.groups.split(",") if args.groups else None
    unknown += [g for g in groups or [] if g not in GROUPS_ORDER]
    if unknown:
        parser.error(f"unknown {unknown}; --list shows the environments and groups")
    chosen = [names[n] for n in args.env] if args.env else ENVIRONMENTS
    out = args.out or (os.path.join(REPO, "docs", "SUPPORTED.md") if not args.env and not groups else None)
    say(f"building the wheel of {REPO}")
    os.makedirs(CACHE, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix="wheel-") as wheels:  # this run's own: runs may overlap
        wheel = build_wheel(wheels)
        records = [run_environment(spec, wheel, [g for g in groups if g in spec.groups] if groups else list(spec.groups))
                   for spec in chosen]
    if args.update:  # the earlier full run's records, with this run's groups in place of theirs
        out = args.out or os.path.join(REPO, "docs", "SUPPORTED.md")
        with open(os.path.splitext(out)[0].lower() + ".json") as f:
            payload = json.load(f)
        if isinstance(payload, list):
            payload = {"records": payload, "command": "tools/env-matrix", "date": None}
        by_name = {r["name"]: r for r in payload["records"]}
        for record in records:
            if record["name"] in by_name and "error" not in record:
                kept = by_name[record["name"]]
                if "error" in kept:  # its install failed before: this run's record replaces it whole
                    by_name[record["name"]] = record
                    continue
                kept["groups"].update(record["groups"])
                kept["versions"] = record["versions"]
            else:
                by_name[record["name"]] = record
        command = f"{payload['command']}; then tools/env-matrix {' '.join(argv or sys.argv[1:])}"
        write_table(list(by_name.values()), out, command, datetime.date.today().isoformat())
        say(f"wrote {out}")
    elif out:
        write_table(records, out, "tools/env-matrix" + (" " + " ".join(argv or sys.argv[1:])).rstrip())
        say(f"wrote {out}")
    bad = [r["name"] for r in records if "error" in r or any(g["failed"] for g in r["groups"].values())]
    say("all passed" if not bad else f"failures in {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
