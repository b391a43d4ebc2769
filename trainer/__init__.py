"""cona's data plane: `python -m cona.trainer` trains one strategy under torchrun and speaks the run-directory protocol.

The contract it shares with the orchestrator (job spec, strategy, run-directory records, LR rule) lives in
`cona.protocol`; this package never imports `cona.orchestrator`. `control` and `heartbeat` are torch-free; `model`,
`data` (numpy only, but used with the model), `distributed`, `pipeline`, `tp`, `fsdp`, `optim`, `parallel`,
`gradstats`, `checkpoint`, `train` and `main` need torch.
See trainer/README.md for the protocol in one page.
"""
