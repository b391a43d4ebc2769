"""The profile's `kubernetes:` section: how to run on Kubernetes. Owned by the backend; `cona.orchestrator.profile` only embeds it.

Imports nothing of the backend itself, so loading a profile does not load the backend.
"""

from __future__ import annotations

from typing import Literal

from cona.protocol.yamlconfig import StrictModel
from pydantic import Field


class KubernetesSpec(StrictModel):
    """How to run on Kubernetes."""

    namespace: str = "default"
    image: str = "ghcr.io/cona-project/cona:latest"
    """Container image with cona and torch installed."""
    pvc: str = "cona-runs"
    """ReadWriteMany PersistentVolumeClaim that holds the run directories."""
    mount_path: str = "/runs"
    """Where the PVC is mounted in every pod (storage.run_root should lie under it)."""
    service_account: str = "cona"
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, str | int]] = Field(default_factory=list)
    workload: Literal["indexed-job", "jobset", "pytorchjob"] = "indexed-job"
    """The training workload kind."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name requested per pod."""
