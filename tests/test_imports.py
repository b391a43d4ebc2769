"""The import rules that keep the two planes apart (docs/architecture.md, "Import rules").

- `cona.protocol` imports neither torch nor `cona.trainer` nor `cona.orchestrator`;
- `cona.trainer` never imports `cona.orchestrator`, and `cona.orchestrator` never imports `cona.trainer`;
- the control plane starts without torch: `cona plan` and `cona status` run on a login node.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, PROFILES, REPO


def imported_modules(folder: str) -> dict[str, set[str]]:
    """Every module each file of `folder` imports, at any depth (functions included), by absolute name."""
    found: dict[str, set[str]] = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        if "templates" in path.parts:  # job-side helpers, run by a bare interpreter on the cluster
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path} imports {name}"
        for path, names in imported_modules(folder).items()
        for name in sorted(names)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_the_protocol_imports_neither_plane_nor_torch():
    assert offenders("protocol", ("torch", "numpy", "cona.trainer", "cona.orchestrator")) == []


def test_the_trainer_never_imports_the_orchestrator():
    assert offenders("trainer", ("cona.orchestrator",)) == []


def test_the_orchestrator_never_imports_the_trainer_or_torch():
    assert offenders("orchestrator", ("cona.trainer", "torch")) == []


def test_no_module_uses_the_old_top_level_names():
    # `orchestrator` and `trainer` are other projects' names on PyPI; everything lives under `cona.`.
    for folder in ("orchestrator", "trainer", "protocol", "tests", "benchmarks"):
        assert offenders(folder, ("orchestrator", "trainer", "protocol")) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--profile", str(PROFILES / "a100-4x8.yaml"), "--job", str(EXAMPLES / "gpt3-1.3b.yaml"), "--top", "3"],
        ["status", "/nonexistent/run"],
    ],
    ids=["plan", "status"],
)
def test_the_control_plane_starts_without_torch(argv):
    code = (
        "import sys\n"
        "from cona.orchestrator.cli import main\n"
        f"sys.argv = ['cona', *{argv!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('torch loaded' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=Path("/"), capture_output=True, text=True, timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "no torch", out.stderr[-2000:]


def test_a_backend_owns_its_profile_section_and_loading_a_profile_loads_no_backend():
    code = (
        "import sys\n"
        "from cona.orchestrator.profile import load_profile\n"
        f"p = load_profile({str(PROFILES / 'local-slurm.yaml')!r})\n"
        "assert type(p.slurm).__module__ == 'cona.orchestrator.backends.slurm.spec', type(p.slurm).__module__\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('cona.orchestrator.backends') and not m.endswith('.spec'))\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=Path("/"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # Only the (import-free) package modules on the way to the spec modules.
    assert out.stdout.strip() == str(
        ["cona.orchestrator.backends", "cona.orchestrator.backends.kubernetes", "cona.orchestrator.backends.slurm"]
    )
