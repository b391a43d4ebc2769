"""cona's data plane: `python -m trainer` trains one strategy under torchrun and speaks the run-directory protocol.

Torch-free modules (the only ones the orchestrator imports): `job`, `strategy`, `rundir`, `heartbeat_record`,
`yamlconfig`, plus `samples_log` (the samples log and `audit_samples`), `control`, `lr` and `heartbeat`.
The rest needs torch: `model`, `data` (numpy only, but used with the model), `parallel`, `gradstats`,
`checkpoint`, `train`, `main`. See trainer/README.md for the protocol in one page.
"""
