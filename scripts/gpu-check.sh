#!/usr/bin/env bash
# The GPU check (python -m benchmarks.gpu) on a machine whose python has a CUDA build of torch but not this package:
# a bare GPU node, or a lent device machine without network. Wheels of the missing dependencies, if the directory
# .whl/ holds any (docs/benchmarks.md says how to fetch them), go to a private directory; the repository's packages
# are put on the path as cona.*; nothing is installed into the system's python. Arguments go to benchmarks.gpu
# (--out DIR, --budget-s S, --parts ...); results land in $OUT when it is set, else benchmarks/results.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
site=$(mktemp -d -t cona-site-XXXXXX)
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
fi
mkdir -p "$site/cona"  # a namespace package, as the installed one is
for pkg in orchestrator trainer protocol; do ln -sfn "$PWD/$pkg" "$site/cona/$pkg"; done
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$PY" -c "import torch; print(f'gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, devices {torch.cuda.device_count()}')"
exec "$PY" -m benchmarks.gpu "$@"
