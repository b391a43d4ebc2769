"""cona's data plane: `python -m trainer` trains one strategy under torchrun and speaks the run-directory protocol.

Modules without torch (`job`, `strategy`, `rundir`, `heartbeat_record`, `yamlconfig`) are the only ones the
orchestrator imports.
"""
