#!/usr/bin/env bash
# Idempotent setup of everything critic-adapters needs on a fresh Debian machine:
#   1. system packages: Debian's offline Bazel (bazel-bootstrap + bazel-rules-java), python3-venv,
#      a C compiler (gcc, libc6-dev: the bf16-moment AdamW kernel);
#   2. .venv/ with torch (first, so nothing pulls a CUDA build), the pinned packages (ray for the
#      Ray integration among them), and this checkout itself as the package `critic_adapters`
#      (editable: pip install -e .);
#   3. the side trl versions for the trl matrix test, in .overlays/ (never in the venv);
#   4. verl 0.9.1 with transformers 5.10.4 for the verl engine tests, in .overlays/verl-0.9.1;
#   5. areal 1.0.4's files (no dependencies) for the AReaL protocol tests, in .overlays/areal-1.0.4.
# Re-running does nothing when nothing changed (a stamp records what .venv was built from).
#
# Environment:
#   TORCH_SPEC   torch requirement to install (default torch==2.13.0; on a GPU machine e.g.
#                "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
#   PYTHON       interpreter for the venv (default python3; 3.10+)
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[setup] $*"; }
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PYTHON=${PYTHON:-python3}

# --- 1. system packages ------------------------------------------------------------------------
missing=()
command -v bazel >/dev/null 2>&1 || missing+=(bazel-bootstrap)
[ -f /usr/share/bazel/rules/java/java/defs.bzl ] || missing+=(bazel-rules-java)
"$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1 || missing+=(python3-venv)
# a C compiler and libc headers: common/engine/adamw_bf16.c (the bf16-moment AdamW kernel) builds on first use
command -v cc >/dev/null 2>&1 || missing+=(gcc)
[ -f /usr/include/pthread.h ] || missing+=(libc6-dev)
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- 2. the virtualenv --------------------------------------------------------------------------
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $("$PYTHON" --version)"
  "$PYTHON" -m venv .venv
fi
stamp=$( (echo "$TORCH_SPEC"; .venv/bin/python --version; pwd; cat requirements/base.txt requirements/veomni.txt requirements/ray.txt requirements/constraints.txt pyproject.toml) | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/.setup-stamp 2>/dev/null)" != "$stamp" ]; then
  log "installing $TORCH_SPEC"
  # shellcheck disable=SC2086  # TORCH_SPEC may carry pip options (--index-url ...)
  .venv/bin/pip install -q --disable-pip-version-check $TORCH_SPEC 2>&1 | grep -v "^WARNING: Location" || true
  log "installing pinned packages (requirements/base.txt)"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements/base.txt -c requirements/constraints.txt \
    2>&1 | grep -v "^WARNING: Location" || true
  log "installing veomni without its declared dependencies (requirements/veomni.txt says why)"
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -r requirements/veomni.txt -c requirements/constraints.txt \
    2>&1 | grep -v "^WARNING: Location" || true
  log "installing ray for the Ray integration (requirements/ray.txt)"
  .venv/bin/pip install -q --disable-pip-version-check -r requirements/ray.txt -c requirements/constraints.txt \
    2>&1 | grep -v "^WARNING: Location" || true
  log "installing this checkout as the package critic_adapters (editable)"
  # setuptools comes with torch's requirements; no build isolation, so nothing more is downloaded.
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . \
    2>&1 | grep -v "^WARNING: Location" || true
  (cd / && "$OLDPWD/.venv/bin/python" -c "import critic_adapters.common.valuehead") \
    || { log "critic_adapters does not import from the venv: the editable install above failed"; exit 1; }
  # stdout dropped: VeOmni prints a banner when imported (errors still go to stderr).
  .venv/bin/python -c "import torch, transformers, trl, safetensors, omegaconf, pyarrow, runfiles, psutil, veomni, ray" \
    >/dev/null || { log "the venv is incomplete: an install above failed"; exit 1; }
  echo "$stamp" > .venv/.setup-stamp
else
  log ".venv is up to date"
fi

# --- 3. side trl versions (for the trl matrix test) --------------------------------------------
grep -v '^#' requirements/trl-overlays.txt | while read -r version; do
  [ -n "$version" ] || continue
  target=.overlays/trl-$version
  if [ ! -f "$target/.complete" ]; then
    log "installing trl $version into $target (overlay, not in the venv)"
    rm -rf "$target"
    .venv/bin/pip install -q --disable-pip-version-check --no-deps --target "$target" "trl==$version" \
      2>&1 | grep -v "^WARNING: Location" || true
    [ -f "$target/trl/__init__.py" ] || { log "trl $version did not install"; exit 1; }
    touch "$target/.complete"
  fi
done
# --- 4. the verl environment (for tests/verl), an overlay over the venv ------------------------------
target=.overlays/verl-0.9.1
verl_stamp=$(sha256sum requirements/verl-overlay.txt | cut -d' ' -f1)
if [ "$(cat "$target/.complete" 2>/dev/null)" != "$verl_stamp" ]; then
  log "installing verl 0.9.1 and transformers 5.10.4 into $target (overlay, not in the venv)"
  rm -rf "$target"
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target "$target" -r requirements/verl-overlay.txt \
    2>&1 | grep -v "^WARNING: Location" || true
  # verl's wheel also installs top-level `tests` and `scripts` packages: removed, so they shadow nothing.
  rm -rf "$target/tests" "$target/scripts" "$target/bin"
  PYTHONPATH="$PWD/$target" .venv/bin/python -c "import verl, tensordict, transformers; assert transformers.__version__ == '5.10.4'" \
    >/dev/null 2>&1 || { log "the verl overlay does not import"; exit 1; }
  echo "$verl_stamp" > "$target/.complete"
fi
# --- 5. AReaL's own client code (for serve/tests/test_areal.py): its files only ------------------------
# areal pins torch < 2.11 and transformers <= 5.3, so it is never installed as a package: the tests load
# the few modules its critic client runs (serve/tests/areal_client.py) from these files.
target=.overlays/areal-1.0.4
if [ ! -f "$target/.complete" ]; then
  log "fetching areal 1.0.4's files into $target (no dependencies, never imported as a package)"
  rm -rf "$target"
  .venv/bin/pip install -q --disable-pip-version-check --no-deps --target "$target" areal==1.0.4 \
    2>&1 | grep -v "^WARNING: Location" || true
  [ -f "$target/areal/infra/rpc/serialization.py" ] || { log "areal 1.0.4 did not download"; exit 1; }
  touch "$target/.complete"
fi
log "ready: .venv ($(.venv/bin/python -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")'))"
