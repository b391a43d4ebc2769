"""cona's contract between the control plane and the data plane, imported by both and importing neither.

`cona.orchestrator` (planning, the scheduler loop, backends; runs on a login node or in a small pod) and
`cona.trainer` (`python -m cona.trainer` under torchrun) meet only here: the job spec (`job`), the strategy
(`strategy`) and what can run (`feasibility`), the run directory's layout and records (`rundir`, `heartbeat_record`, `samples_log`), process identities from /proc (`procstat`), the learning-rate
rule over samples (`lr`) and YAML loading with one-line errors (`yamlconfig`). Torch-free: `tests/test_imports.py`
guards that, and that neither side imports the other.
"""
