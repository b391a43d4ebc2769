"""The Kubernetes backend's package: the profile's `kubernetes:` section (`spec.py`), the rendering of an attempt's
objects (`render.py`, behind `cona render kubernetes`) and the backend that creates and watches them (`backend.py`,
registered as `kubernetes` in `cona.orchestrator.backends.BACKENDS`, so `cona run` runs a kubernetes profile)."""
