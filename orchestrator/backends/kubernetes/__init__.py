"""The Kubernetes backend's package: the profile's `kubernetes:` section (`spec.py`) and the rendering of an
attempt's objects (`render.py`, behind `cona render kubernetes`). The backend (`backend.py`) is not registered yet
(`cona.orchestrator.backends.BACKENDS`), so a kubernetes profile can be planned and rendered but not run."""
