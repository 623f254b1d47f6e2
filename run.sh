#!/usr/bin/env bash
# The two commands of critic-adapters (see README.md). Each first runs the idempotent setup.
#   ./run.sh main   set up, then train a critic on the embedded tiny model and rollouts
#   ./run.sh test   set up, then run every test: bazel test //..., then the consumer workspace's test
# Extra arguments go to the training launcher (main) or to bazel test (test).
set -euo pipefail
cd "$(dirname "$0")"
command=${1:-}
shift || true
case "$command" in
  main)
    tools/setup.sh
    export PATH="$PWD/.venv/bin:$PATH"
    exec python -m critic_adapters.backends.fsdp.train --nproc 2 "trainer.run_dir=outputs/runs/$(date +%Y%m%d-%H%M%S)" "$@"
    ;;
  test)
    tools/setup.sh
    export PATH="$PWD/.venv/bin:$PATH"
    bazel test //... "$@"
    # A second workspace that depends on this one by label (tests/consumer_workspace/WORKSPACE).
    status=0
    (cd tests/consumer_workspace && bazel test //... --test_output=errors) || status=$?
    (cd tests/consumer_workspace && bazel shutdown) || true
    # The whole suite's cost against its budget (docs/TESTS.md): the next feature pays for its tests.
    if [ $# -eq 0 ]; then python tools/test_times.py --check || status=$?; fi
    exit $status
    ;;
  *)
    echo "usage: ./run.sh main [launcher options] | ./run.sh test [bazel options]" >&2
    exit 2
    ;;
esac
