"""tools/gpu-check: one command that runs critic_adapters' first GPU checks on one GPU (an H200) in
about 8 minutes, installs included, and writes every result to DIR/gpu_check.json as it goes.

  tools/gpu-check --prepare          on a machine that reaches PyPI: the wheels the GPU image lacks,
                                     cp312 manylinux, into .gpu-wheels/ (git-ignored; <= 64 MiB, asserted)
  tools/gpu-check --out DIR          on the GPU machine: pip-installs .gpu-wheels/ into a temp dir (no
                                     network, --no-deps), then runs every check below, one rank
  tools/gpu-check --cpu --out DIR    the same checks on a tiny critic on CPU in about a minute, with the
                                     packages installed here (Bazel: //tests:test_gpu_check, so the
                                     script never rots); GPU-only comparisons become CPU-vs-CPU or are
                                     skipped, naming why

With the device tool (one call, after `tools/gpu-check --prepare` here; the tree and the wheels are
about 20 MiB of its 64):

  run(command='set -o pipefail; export PYTHONUNBUFFERED=1; nvidia-smi; bash tools/gpu-check --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"',
      carry=[".gpu-wheels"], timeout_s=600)

What the GPU machine has (shared/notes/gpu-readiness.md section 4; /work/.library/device/KINDS.md):
Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, huggingface_hub 1.33, tokenizers 0.23.2,
safetensors 0.8; no megatron-core, VeOmni, flash-attn, TransformerEngine or liger-kernel; no network.
So transformers 5.22.2 (the project's pin), megatron-core 0.16.1, veomni 0.1.12 and the small
dependencies the image may hold too old (regex, packaging) travel as wheels (WHEELS below); flash-attn
and TransformerEngine cannot (hundreds of MB, other ABIs), so their paths stay unrun here. NCCL takes
one rank per GPU, so every check is one rank: multi-rank behaviour stays with the CPU/gloo suite.

The checks, in priority order (gpu_check_cases.py; the limits are what "ok" means):
  0 env                    versions, the device, imports of the three backends, what
                           common.parallel.kernels.installed() finds and the kernels it picks
                           (fp32 / bf16 x packed / padded, megatron's spec, VeOmni's ops)
  1 fsdp_fp32_parity       fsdp fp32 on the GPU vs the same engine on CPU in this process: values,
                           loss, grad norm, values after one update (the reference of 2-4, 7, 9)
  2 fsdp_bf16              engine.mixed_precision=bf16 vs 1: 0 < values diff <= 0.05, loss falling over 5 updates
  3 megatron_fp32          megatron TP1 vs 1; offload/onload bit-equal; a checkpoint round trip
                           (values, then one more update, equal); the export loads with load_critic
                           on the device with the engine's values
  4 megatron_bf16          the same in bf16 (0 < diff <= 0.05 vs 1), loss falling over 5 updates
  5 offload_memory         torch.cuda allocated / reserved / free before and after an offload and an
                           onload, seconds per GiB, twice (the second reuses the pinned buffers)
  6 packed_attention       common.parallel.packed_attention vs torch's varlen_attn (through
                           common.parallel.varlen_attention) vs a per-sequence fp32 reference:
                           values max error, ms per forward+backward
  7 fsdp_cpu_offload       fsdp engine.cpu_offload=true at 1 rank equals 1's engine without it
  8 scale_bf16             a Qwen2.5-0.5B-shaped critic (bench/configs/qwen2_5_0_5b.json, random)
                           in bf16: update and values tokens/s, MFU against a bf16 matmul peak
                           measured in this run, peak memory per parameter
  9 veomni                 the VeOmni engine built, one update, vs 1
  10 vision                a tiny Qwen2-VL critic with images, fsdp fp32 and bf16 on the device vs CPU
  11 service               the critic service's door over a one-rank fsdp engine on the device: values
                           and an update (and its retry, applied once) through HTTP vs check 1's engine
Each check has a time estimate: one that no longer fits before the run's budget (--budget-s) is
skipped with reason "time"; one that overruns its cap (3 x the estimate on the GPU, 10 x with --cpu,
at least 30 s) is stopped and recorded as failed. Every
entry: status ok / failed / skipped, seconds, its numbers, the limits it was held to, and an error
with the traceback's tail. The file is rewritten (atomically) before and after every check, so a
run killed from outside keeps what finished and names the check it died in.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)  # the package critic_adapters
WHEEL_DIR = os.path.join(ROOT, ".gpu-wheels")
WHEEL_LIMIT = 64 << 20  # what travels with the tree, in all; the wheels must leave room for the tree
RESULTS = "gpu_check.json"

# name==version -> why the GPU image needs it carried.
WHEELS = {
    "transformers==5.22.2": "the project's pin (requirements/base.txt); the image has 5.17",
    "megatron-core==0.16.1": "not on the image (cp312 build; the engine never imports its extension)",
    "veomni==0.1.12": "not on the image (installed --no-deps, as tools/setup.sh does: requirements/veomni.txt)",
    "regex==2026.11.19": "transformers 5.22 checks regex>=2025.10.22 at import; the image's version is unread",
    "packaging==25.0": "veomni 0.1.12 needs packaging<26 (requirements/veomni.txt); the image's version is unread",
    # check 11, the critic service: its `serve` extra (requirements/base.txt's pins) and what they need
    "fastapi==0.115.12": "not on the image (the service's door)",
    "starlette==0.46.2": "not on the image (fastapi's)",
    "uvicorn==0.54.0": "not on the image (the service's server)",
    "pydantic==2.14.4": "not on the image (fastapi's)",
    "pydantic_core==2.50.5": "not on the image (pydantic's, cp312)",
    "annotated-types==0.8.0": "not on the image (pydantic's)",
    "typing-inspection==0.4.5": "not on the image (pydantic's)",
}
# The GPU image's packages that the carried wheels need (KINDS.md's pip list, 2026-11): a version, or
# None where the image has the package but nobody has read its version.
IMAGE = {"torch": "2.11.0", "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0",
         "numpy": "2.5.2", "pyyaml": None, "tqdm": None, "typer": None, "anyio": None, "h11": None, "click": None,
         "typing-extensions": None}
PIP_PLATFORM = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_27_x86_64",
                "--platform", "manylinux_2_24_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64"]


# --- --prepare ------------------------------------------------------------------------------------

def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _wheel_name(path: str) -> str:
    return _canonical(os.path.basename(path).split("-")[0])


def _wheel_requirements(path: str) -> list[str]:
    """The wheel's Requires-Dist lines that apply without extras."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(path) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12",
                                                          "platform_machine": "x86_64", "sys_platform": "linux"}):
                out.append(str(req))
    return out


def _requirement_sources(wheels: list[str], pins: dict[str, str]) -> list[str]:
    """For each requirement of the carried transformers, megatron-core and the service's packages: where the
    GPU run gets it.
    Raises SystemExit for one that nothing provides."""
    from packaging.requirements import Requirement

    lines, missing = [], []
    for path in wheels:
        if _wheel_name(path) not in ("transformers", "megatron-core", "fastapi", "starlette", "uvicorn", "pydantic"):
            continue  # veomni's declared dependencies are not what its engine path imports (veomni.txt)
        for text in _wheel_requirements(path):
            req = Requirement(text)
            name = _canonical(req.name)
            if name in pins:
                source = f"carried {pins[name]}" + ("" if req.specifier.contains(pins[name]) else "  NOT SATISFIED")
            elif name in IMAGE and IMAGE[name] is not None:
                ok = req.specifier.contains(IMAGE[name], prereleases=True)
                source = f"image {IMAGE[name]}" + ("" if ok else "  NOT SATISFIED")
            elif name in IMAGE:
                source = "image (version unread; the run's env check reads it)"
            else:
                source = "MISSING"
            if "NOT SATISFIED" in source or source == "MISSING":
                missing.append(f"{_wheel_name(path)} needs {text}: {source}")
            lines.append(f"  {_wheel_name(path):13s} needs {text:34s} -> {source}")
    if missing:
        raise SystemExit("gpu-check --prepare: nothing on the GPU machine provides\n  " + "\n  ".join(missing)
                         + "\n(add a pin to WHEELS in tools/gpu_check.py)")
    return lines


def prepare(wheel_dir: str) -> int:
    """Download WHEELS (cp312 manylinux, no dependencies) into wheel_dir, skipping those already
    there; check the carried packages' requirements; print and assert the total size."""
    os.makedirs(wheel_dir, exist_ok=True)
    pins = {_canonical(spec.split("==")[0]): spec.split("==")[1] for spec in WHEELS}
    have = {}
    for path in glob.glob(os.path.join(wheel_dir, "*.whl")):
        name, version = _wheel_name(path), os.path.basename(path).split("-")[1]
        if pins.get(name) != version:  # an old pin, or not ours: two versions would stop the install
            print(f"removing {os.path.basename(path)} (not in WHEELS)")
            os.remove(path)
        else:
            have[name] = path
    wanted = [spec for spec in WHEELS if _canonical(spec.split("==")[0]) not in have]
    if wanted:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   *PIP_PLATFORM, "-d", wheel_dir, *wanted]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    else:
        print(f"every wheel is in {wheel_dir} already")
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    assert sorted(_wheel_name(w) for w in wheels) == sorted(pins), (wheels, pins)
    for line in _requirement_sources(wheels, pins):
        print(line)
    total = sum(os.path.getsize(w) for w in wheels)
    for path in wheels:
        print(f"{os.path.getsize(path) / 2**20:7.2f} MiB  {os.path.basename(path)}")
    print(f"total: {total / 2**20:.2f} MiB in {len(wheels)} wheels (limit {WHEEL_LIMIT >> 20} MiB with the tree)")
    assert total <= WHEEL_LIMIT, f"the wheels are {total / 2**20:.1f} MiB, over the {WHEEL_LIMIT >> 20} MiB a run carries"
    return 0


def install_wheels(wheel_dir: str) -> dict:
    """pip-install every wheel of wheel_dir into a fresh temp dir (offline, no dependencies) and put
    it first on sys.path, before anything imports transformers."""
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if not wheels:
        return {"status": "skipped", "reason": f"no wheels in {wheel_dir} (run tools/gpu-check --prepare where "
                                               f"PyPI is reachable and carry .gpu-wheels): the image's packages are used"}
    target = tempfile.mkdtemp(prefix="gpu_check_site_")
    start = time.perf_counter()
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--disable-pip-version-check", "--target", target, *wheels]
    done = subprocess.run(command, capture_output=True, text=True)
    numbers = {"target": target, "wheels": [os.path.basename(w) for w in wheels],
               "seconds": round(time.perf_counter() - start, 1)}
    if done.returncode:
        return {"status": "failed", "numbers": numbers, "error": (done.stdout + done.stderr)[-3000:]}
    sys.path.insert(0, target)
    return {"status": "ok", "numbers": numbers}


# --- running checks -------------------------------------------------------------------------------

class _Overran(BaseException):
    """A check ran past its cap (a BaseException, so no library's `except Exception` swallows it)."""


class Results:
    """DIR/gpu_check.json: the run's header and one entry per check, rewritten after every change."""

    def __init__(self, out_dir: str, header: dict, names: list[str]):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, RESULTS)
        self.data = {**header, "checks": {name: {"status": "skipped", "reason": "not reached: the run ended first"}
                                          for name in names}}
        self.write()

    def set(self, name: str, entry: dict) -> None:
        self.data["checks"][name] = entry
        self.write()

    def write(self) -> None:
        self.data["elapsed_s"] = round(time.perf_counter() - START, 1)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(tmp, self.path)


class Numbers(dict):
    """A check's numbers, and the limits they were held to (a broken limit fails the check after
    every number is recorded)."""

    def __init__(self):
        super().__init__()
        self.limits: dict[str, str] = {}
        self.broken: list[str] = []

    def at_most(self, name: str, value: float, limit: float, *, above: float | None = None) -> float:
        """Record `value`; the check fails unless value <= limit (and value > above, if given)."""
        self[name] = value
        self.limits[name] = f"<= {limit:g}" if above is None else f"> {above:g} and <= {limit:g}"
        if not (value <= limit and (above is None or value > above)):
            self.broken.append(f"{name}={value:.4g} (want {self.limits[name]})")
        return value

    def require(self, name: str, value, why: str) -> None:
        """Record `value`; the check fails unless it is truthy."""
        self[name] = value
        self.limits[name] = why
        if not value:
            self.broken.append(f"{name}={value!r} ({why})")


START = time.perf_counter()


def _alarm(signum, frame):
    raise _Overran()


def run_check(results: Results, name: str, check, run, *, estimate_s: float, cap_s: float, budget_s: float,
              skip: type[Exception]):
    """Run check(run, numbers) unless it would not fit before the budget, then run.end_check();
    record its entry. A check that raises `skip` is skipped, its message the reason."""
    left = budget_s - (time.perf_counter() - START)
    if left < estimate_s:
        results.set(name, {"status": "skipped", "reason": "time",
                           "detail": f"{left:.0f} s left of --budget-s {budget_s:g}, it takes about {estimate_s:g} s"})
        print(f"[{name}] skipped: time", flush=True)
        return
    cap = min(left, cap_s)
    results.set(name, {"status": "failed", "error": "did not finish: the process ended inside this check "
                                                    "(a crash, or a timeout outside it)"})
    print(f"[{name}] running (about {estimate_s:g} s, stopped at {cap:.0f} s)", flush=True)
    numbers, start = Numbers(), time.perf_counter()
    entry: dict = {}
    signal.signal(signal.SIGALRM, _alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, cap)
        try:
            check(run, numbers)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        if numbers.broken:
            entry = {"status": "failed", "error": "limits broken: " + "; ".join(numbers.broken)}
        else:
            entry = {"status": "ok"}
    except skip as why:
        entry = {"status": "skipped", "reason": str(why)}
    except _Overran:
        entry = {"status": "failed", "error": f"stopped after {cap:.1f} s (its cap, or what was left of the budget; "
                                              f"it takes about {estimate_s:g} s)",
                 "traceback": traceback.format_exc()[-3000:]}
    except Exception as err:  # noqa: BLE001 - every failure is a result to record, then the next check runs
        entry = {"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000],
                 "traceback": traceback.format_exc()[-4000:]}
    finally:
        run.end_check()  # the engines the check built, closed whether it passed or not
    entry.update(seconds=round(time.perf_counter() - start, 1), numbers=dict(numbers), limits=numbers.limits)
    results.set(name, entry)
    shown = {k: v for k, v in entry.items() if k not in ("traceback", "limits")}
    print(f"[{name}] {json.dumps(shown, default=str)[:1500]}", flush=True)


def import_package() -> None:
    """This checkout as the package critic_adapters, wherever it lies (as bench/as_a_file.py does)."""
    import importlib.util

    if "critic_adapters" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location("critic_adapters", os.path.join(ROOT, "__init__.py"),
                                                  submodule_search_locations=[ROOT])
    sys.modules["critic_adapters"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules["critic_adapters"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="download the wheels the GPU run needs into --wheels")
    parser.add_argument("--cpu", action="store_true", help="the same checks on a tiny critic on CPU (CUDA hidden)")
    parser.add_argument("--out", help="write DIR/gpu_check.json (required unless --prepare)")
    parser.add_argument("--wheels", default=WHEEL_DIR, help="the wheel folder (default: .gpu-wheels in the checkout)")
    parser.add_argument("--budget-s", type=float, help="the run's time budget, installs included (default: 480 on "
                                                        "the GPU, 200 with --cpu): later checks are skipped to keep it")
    parser.add_argument("--only", help="comma-separated check numbers or names to run (the others are skipped)")
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare(args.wheels)
    if not args.out:
        parser.error("--out DIR is required (or --prepare)")
    warnings.filterwarnings("once")  # the libraries' deprecation warnings, once each, not once per step
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported: every path takes its CPU branch
    budget = args.budget_s or (200.0 if args.cpu else 480.0)
    install = {"status": "skipped", "reason": "--cpu: the installed packages are used"} if args.cpu \
        else install_wheels(args.wheels)

    import_package()
    sys.path.insert(0, HERE)
    import gpu_check_cases as cases

    header = {"mode": "cpu" if args.cpu else "gpu", "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "budget_s": budget, "argv": sys.argv[1:], "python": sys.version.split()[0]}
    names = ["wheels", *(name for name, _, _ in cases.CHECKS)]
    results = Results(args.out, header, names)
    results.set("wheels", install)
    wanted = None if not args.only else set(args.only.split(","))
    run = cases.Run(cpu=args.cpu, workdir=tempfile.mkdtemp(prefix="gpu_check_"))
    with contextlib.ExitStack() as stack:
        stack.callback(run.close)
        for number, (name, check, estimates) in enumerate(cases.CHECKS):
            if wanted is not None and str(number) not in wanted and name not in wanted:
                results.set(name, {"status": "skipped", "reason": f"--only {args.only}"})
                continue
            estimate = estimates[0 if args.cpu else 1]
            run_check(results, name, check, run, estimate_s=estimate, budget_s=budget, skip=cases.Skip,
                      cap_s=max((10.0 if args.cpu else 3.0) * estimate, 30.0))
    results.write()
    statuses = {name: entry["status"] for name, entry in results.data["checks"].items()}
    print(f"gpu-check: {results.path}: " + ", ".join(f"{n}={s}" for n, s in statuses.items()), flush=True)
    return 1 if "failed" in statuses.values() else 0


if __name__ == "__main__":
    sys.exit(main())
