"""cona's control plane: profiles, the strategy planner and cost model, statistics, policies, backends, CLI.

Torch-free (the CLI runs on a login node): it imports `cona.protocol` for the contract with the trainer and never
`cona.trainer`.
"""
