"""cona's control plane: profiles, the strategy planner and cost model, statistics, policies, backends, CLI.

Torch-free (the CLI runs on a login node): it imports `cona.protocol` for the contract with the trainer and never
`cona.trainer`.
"""


def cona_version() -> str:
    """This installation's version of cona (its package metadata), or `unknown` when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cona")
    except PackageNotFoundError:
        return "unknown"
