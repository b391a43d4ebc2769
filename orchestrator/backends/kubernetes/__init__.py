"""The Kubernetes backend's package. For now it holds only the profile's `kubernetes:` section (`spec.py`); the
backend itself is not registered yet (`cona.orchestrator.backends.BACKENDS`), so a kubernetes profile can be planned
with `cona plan` but not run."""
