"""The one place that talks to the Kubernetes API: loading the client's configuration and turning API errors into
one line that names the object and what to do. The backend, the Lease, `cona submit` and the status mirror all
call through `KubeApi.call`.

The `kubernetes` client is imported inside the functions, so loading a profile stays light, and the configuration
is loaded on the first call, so `cona render kubernetes` needs no cluster.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from cona.orchestrator.backends.base import BackendError

REQUEST_TIMEOUT_S = 30
"""Per API call (connect and read), so that a poll never blocks for long."""
RBAC = "manifests/rbac.yaml"
FORBIDDEN: Any = object()
"""What `KubeApi.call(..., forbidden_ok=True)` returns for a 403: a read the caller can do without."""


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def api_message(exc: Any) -> str:
    """The API server's own message of an ApiException (its Status body), with the invalid fields' causes."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        return one_line(exc.reason or "")
    if not isinstance(body, dict):
        return one_line(exc.reason or "")
    causes = (body.get("details") or {}).get("causes") or []
    fields = [f"{c.get('field')}: {c.get('message')}" for c in causes if isinstance(c, dict) and c.get("field")]
    return one_line("; ".join(fields) or body.get("message") or exc.reason or "")


def default_client() -> Any:
    """An ApiClient from the in-cluster service account (KUBERNETES_SERVICE_HOST set) or the kubeconfig
    (`KUBECONFIG`, else `~/.kube/config`)."""
    from kubernetes import client, config

    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:
            config.load_kube_config()
    except (config.ConfigException, OSError, TypeError, ValueError) as e:
        raise BackendError(f"kubernetes: cannot load the API configuration: {one_line(str(e)).rstrip('.')}; point KUBECONFIG "
                           "(default ~/.kube/config) at the cluster's kubeconfig") from None  # fmt: skip
    configuration = client.Configuration.get_default_copy()
    if not configuration.verify_ssl:
        # The kubeconfig asks for it (`insecure-skip-tls-verify: true`, common on a test cluster), as kubectl
        # honours it without a word: urllib3 would print a multi-line InsecureRequestWarning on every request,
        # before the one line an error is.
        import urllib3

        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    return client.ApiClient()


def context_namespace() -> str | None:
    """The namespace of the kubeconfig's current context (what kubectl uses without -n), or the pod's own."""
    path = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
    if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(path):
        with open(path) as f:
            return f.read().strip() or None
    try:
        from kubernetes import config

        _, current = config.list_kube_config_contexts()
    except Exception:  # no kubeconfig, or an unreadable one: the caller falls back to its default
        return None
    return (current or {}).get("context", {}).get("namespace")


class KubeApi:
    """The API client of one namespace, with every call's errors as a one-line `BackendError`."""

    def __init__(self, namespace: str, api_client: Any | None = None) -> None:
        self.namespace = namespace
        self._api_client = api_client

    @property
    def api_client(self) -> Any:
        """The API client given, else the default one, loaded on first use."""
        if self._api_client is None:
            self._api_client = default_client()
        return self._api_client

    def core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client)

    def batch(self) -> Any:
        from kubernetes import client

        return client.BatchV1Api(self.api_client)

    def coordination(self) -> Any:
        from kubernetes import client

        return client.CoordinationV1Api(self.api_client)

    def call(self, verb: str, resource: str, name: str, fn: Callable[..., Any], *args: Any,
             missing_ok: bool = False, conflict_ok: bool = False, forbidden_ok: bool = False,
             not_found_hint: str | None = None, **kwargs: Any) -> Any:  # fmt: skip
        """`fn(*args, **kwargs)`; an API error as one-line BackendError naming `verb`, `resource` and `name`.
        With `missing_ok`, a 404 returns None; with `conflict_ok`, a 409 returns None; with `forbidden_ok`, a 403
        returns `FORBIDDEN`. `not_found_hint` is the first thing to check on a 404 (e.g. whether a CRD is
        installed)."""
        from kubernetes.client.exceptions import ApiException
        from pydantic import ValidationError
        from urllib3.exceptions import HTTPError

        what = f"kubernetes: {verb} {resource} {name!r} in namespace {self.namespace!r}"
        try:
            return fn(*args, _request_timeout=REQUEST_TIMEOUT_S, **kwargs)
        except ApiException as e:
            status = e.status or 0
            if (status == 404 and missing_ok) or (status == 409 and conflict_ok):
                return None
            if status == 403 and forbidden_ok:
                return FORBIDDEN
            message = api_message(e)
            if status == 401:
                hint = "the credentials were rejected (401); renew them in the kubeconfig or the service account token"
            elif status == 403:
                hint = f"you (or the service account) lack {verb} on {resource}; apply {RBAC} and bind its Role"
            elif status == 404:
                first = f"{not_found_hint}, and does" if not_found_hint else "does"
                hint = f"not found (404): {message}; {first} namespace {self.namespace!r} exist (apply manifests/)?"
            elif status == 409:
                hint = f"already exists (409); delete it (kubectl -n {self.namespace} delete {resource} {name}) first"
            elif status == 422:
                hint = f"rejected as invalid (422): {message}; check the profile's kubernetes: section"
            else:
                hint = f"failed ({status} {one_line(e.reason or '')}): {message}"
            raise BackendError(f"{what}: {hint}") from None
        except ValidationError as e:
            # The client checks request bodies against the API's types before sending them.
            error = e.errors()[0]
            where = ".".join(str(part) for part in error.get("loc", ())[1:])
            raise BackendError(
                f"{what}: the Kubernetes client refused the object before sending it ({where}: {error.get('msg')}); "
                "this is a bug in cona's rendering, please report it"
            ) from None
        except HTTPError as e:
            host = getattr(self.api_client.configuration, "host", "?")
            raise BackendError(
                f"{what}: cannot reach the API server at {host} ({type(e).__name__}); check the kubeconfig or the "
                "network"
            ) from None
