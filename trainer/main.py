"""`python -m cona.trainer`: one attempt of one strategy, launched by torchrun (or alone, as a world of one).

    torchrun --standalone --nproc-per-node=4 -m cona.trainer --run-dir RUN [--job JOB.yaml] [--strategy dp=2,tp=2,...]
             [--max-steps N] [--attempt N] [--set section.field=value ...]

Without --job the job is `run.yaml`'s `job:` mapping; without --strategy the strategy is the launch record's;
without --attempt the attempt is the launch record's. --max-steps is an absolute optimizer step of the run (see trainer.train).
No flag is a prefix of a torchrun flag, so they can never be mistaken for torchrun's own.

Exit codes (cona.protocol.rundir.ExitCode): 0 done, 42 switched, 43 stopped (command, signal), 44 the world
size does not fit the strategy, 2 bad input (one line on stderr saying what to fix). Stopping at --max-steps is a
normal end: the process exits 0 and the exit record says STOPPED (`cona.protocol.rundir.process_exit_status`).
torchrun itself exits 1 when a worker exits non-zero: read `attempts/<n>/exit.json` or the last heartbeat
(`event: exit`) for the code. A rank that an exception ends without an exit record writes `attempts/<n>/crash-<rank>.json`
(`cona.protocol.rundir.CrashRecord`) for the orchestrator's crash line. A collective that fails because a peer died
or hung (`cona.trainer.distributed.CommunicationError`) ends the rank at once with exit 1, that record and one line,
without a checkpoint: no collective can follow on the broken group.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import sys
from pathlib import Path
from typing import NoReturn

from cona.protocol import procstat
from cona.protocol.cliargs import OptionParser
from cona.protocol.rundir import (
    CrashRecord,
    ExitCode,
    NotRegularFile,
    RunDir,
    process_exit_status,
    restrict_umask,
)
from cona.protocol.strategy import Strategy
from cona.protocol.yamlconfig import ConfigError

FLAGS = ("--run-dir", "--job", "--strategy", "--max-steps", "--attempt", "--set", "--dump-loaded-state")


class _Parser(OptionParser):
    def fail(self, message: str) -> NoReturn:  # one line, exit CONFIG, no usage dump
        _fail(f"{message} (see python -m cona.trainer --help)")


def _fail(message: str, code: ExitCode = ExitCode.CONFIG) -> NoReturn:
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"cona trainer: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(int(code))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = _Parser(prog="python -m cona.trainer", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--run-dir", required=True, type=Path, help="the run directory (shared by all nodes)")
    parser.add_argument("--job", type=Path, help="job YAML (default: run.yaml's `job:` in the run directory)")
    parser.add_argument("--strategy", help="e.g. dp=2,tp=2,pp=1,mbs=2,gbs=16 (default: the launch record's)")
    parser.add_argument("--max-steps", type=int, help="stop (after a checkpoint) at this absolute optimizer step")
    parser.add_argument("--attempt", type=int, help="attempt number (default: the launch record's); names heartbeat files")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a job field")
    parser.add_argument("--dump-loaded-state", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def load_inputs(args: argparse.Namespace):
    """Job, strategy, attempt and the run's identity (run.yaml's `created`; None for a job given by hand) from the
    flags and the run directory; raises ConfigError."""
    from cona.protocol.job import job_from_dict, load_job
    from cona.protocol.yamlconfig import apply_overrides, load_yaml

    run_dir = RunDir(args.run_dir)
    run_created = None
    if args.job is not None:
        job = load_job(args.job, args.set)
    else:
        if not run_dir.run_yaml.exists():
            raise ConfigError(f"{run_dir.run_yaml}: not found; pass --job JOB.yaml or create the run with `cona run`")
        data = load_yaml(run_dir.run_yaml, run_file=True)
        if not isinstance(data.get("job"), dict):
            raise ConfigError(f"{run_dir.run_yaml}: has no `job:` mapping; pass --job JOB.yaml")
        job = job_from_dict(apply_overrides(data["job"], list(args.set)), source=f"{run_dir.run_yaml} job")
        created = data.get("created")
        if isinstance(created, (int, float)) and not isinstance(created, bool):
            run_created = float(created)
    # A launched attempt finds its number on the command line and its strategy in its launch record; by hand, both
    # may be given (or the newest launch record is taken).
    launch = run_dir.read_launch(args.attempt) if args.attempt is not None else run_dir.latest_launch()
    attempt = args.attempt if args.attempt is not None else (launch.attempt if launch else 0)
    try:
        strategy = Strategy.parse(args.strategy) if args.strategy else (launch.strategy if launch else None)
    except ValueError as e:
        raise ConfigError(f"--strategy: {e}") from None
    if strategy is None:
        raise ConfigError(
            f"no --strategy given and {run_dir.launch_file(attempt)} has no launch record; pass --strategy dp=..,mbs=..,gbs=.."
        )
    if args.max_steps is not None and args.max_steps < 0:
        raise ConfigError(f"--max-steps {args.max_steps}: must be >= 0")
    return run_dir, job, strategy, attempt, run_created


def write_refusal(run_dir: RunDir, attempt: int, error: ConfigError | NotRegularFile) -> None:
    """The exit record of an attempt that refused its input (exit CONFIG, the error's line as the reason), with
    `fix`: where the fix lies (`cona.protocol.inputs.InputRefused.fix`: `job`, `files` or `either`). A run's job is
    fixed once it exists, so the orchestrator advises a new run for a job field and a resume for the files."""
    import time

    from cona.protocol.inputs import fix_of
    from cona.protocol.rundir import ExitRecord

    record = ExitRecord(exit_code=int(ExitCode.CONFIG), name=ExitCode.CONFIG.name, reason=str(error), step=None,
                        time=time.time(), fix=fix_of(error))  # fmt: skip
    run_dir.write_exit(attempt, record)


def _die_with_torchrun() -> None:
    """Have the kernel SIGKILL this worker when torchrun, its parent, dies.

    A torchrun killed outright (SIGKILL, the OOM killer) leaves its workers running, and they train on — an
    in-place switch even goes on as the next attempt — while the orchestrator, which saw the attempt end, launches
    the next one: two attempts at once, writing the same files (found by `python -m tests.faults`). Linux only, and
    only under torchrun: a trainer run by hand has nobody to die with."""
    if not sys.platform.startswith("linux") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    import ctypes
    import signal

    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent:  # torchrun died before the request took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    import time

    _die_with_torchrun()

    startup: dict[str, float | None] = {"process_start": procstat.wall_start_time(), "main_start": time.time()}
    restrict_umask()  # launched by hand or by Slurm, not only under `cona run`
    args = parse_args(argv)
    try:
        run_dir, job, strategy, attempt, run_created = load_inputs(args)
    except (ConfigError, NotRegularFile) as e:  # NotRegularFile: a FIFO in the run directory
        _fail(str(e))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))

    from cona.trainer.train import write_exit

    try:
        previous = run_dir.read_exit(attempt) if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 else None
    except NotRegularFile as e:
        _fail(str(e))
    if previous is not None and previous.exit_code in (ExitCode.DONE, ExitCode.SWITCH, ExitCode.STOPPED):
        # torchrun (--max-restarts) restarted the workers because a protocol exit is non-zero: exit the same way
        # instead of training on under a strategy the orchestrator is replacing.
        code = ExitCode(previous.exit_code)
        if rank == 0:
            print(f"cona trainer: attempt {attempt} already exited {code.name} ({previous.reason})", file=sys.stderr)
        return process_exit_status(code, reason=previous.reason)

    # Validate everything that needs no process group first, so bad input never hangs a collective.
    from cona.trainer.data import Batcher, load_corpus
    from cona.trainer.distributed import LayoutError, check_layout

    try:
        check_layout(job, strategy, world_size=world_size)
        corpus = load_corpus(job)
        Batcher(job, corpus)
        if job.model.init_from is not None and not run_dir.complete_checkpoints():
            from cona.protocol.inputs import check_init_from
            from cona.trainer.hf import check_directory

            check_init_from(job)  # a directory with a config.json: what `cona run` checks before the run exists
            try:
                check_directory(job.model, job.model.init_from)
            except ValueError as e:
                raise ConfigError(f"model.init_from: {e}") from None
    except LayoutError as e:
        code = ExitCode.BAD_WORLD if e.bad_world else ExitCode.CONFIG
        if rank == 0 and run_dir.root.is_dir():
            write_exit(run_dir, attempt, code=code, reason=str(e), step=None)
        _fail(str(e), code)
    except (ConfigError, NotRegularFile) as e:
        if rank == 0 and run_dir.root.is_dir():
            write_refusal(run_dir, attempt, e)
        _fail(str(e))

    import torch.distributed as dist
    from cona.trainer.checkpoint import CheckpointSaveError
    from cona.trainer.control import ControlState
    from cona.trainer.distributed import communication_error, init_distributed
    from cona.trainer.train import Trainer, TrainingDiverged

    env = init_distributed()
    startup["dist_ready"] = time.time()
    trainer = None
    control = ControlState()  # the signals' state of these processes, handed from attempt to attempt
    try:
        make_trainer = functools.partial(Trainer, job=job, run_dir=run_dir, env=env, corpus=corpus, max_steps=args.max_steps,
                                         run_created=run_created)  # fmt: skip
        trainer = make_trainer(strategy=strategy, attempt=attempt, dump_loaded_state=args.dump_loaded_state, startup=startup,
                               control=control)  # fmt: skip
        code = trainer.run()
        while code == ExitCode.SWITCH and trainer.next_strategy is not None:
            # An in-place switch: the process group, imports and data stay; the model, optimizer and meshes are
            # rebuilt for the new strategy and resume from the checkpoint just written, as a relaunch would.
            strategy, attempt = trainer.next_strategy, attempt + 1
            groups, control, written = trainer.model.own_process_groups(), trainer.control, trainer.saved
            del trainer
            gc.collect()
            for group in groups:  # every rank destroys the same groups in the same order
                dist.destroy_process_group(group)
            now = time.time()
            startup = {"process_start": None, "main_start": now, "dist_ready": now, "in_place": True}
            trainer = make_trainer(strategy=strategy, attempt=attempt, startup=startup, control=control, written=written)
            code = trainer.run()
        status = process_exit_status(code, reason=trainer.exit_reason)
    except (ConfigError, NotRegularFile) as e:
        if env.rank == 0:
            write_refusal(run_dir, attempt, e)
        _fail(str(e))
    except CheckpointSaveError as e:  # the storage, not the input: exit 1 (relaunched), and say why in one line
        control.ending = True  # every rank raised it together: a peer that exits first has not died of it
        if env.rank == 0:
            with contextlib.suppress(OSError):  # the run directory may sit on the full disk too
                write_exit(run_dir, attempt, code=1, reason=str(e), step=None)
            print(f"cona trainer: error: {e}", file=sys.stderr, flush=True)
        status = 1
    except TrainingDiverged as e:  # a crash, not bad input: exit 1, but say why in one line
        control.ending = True  # every rank raised it together: a peer that exits first has not died of it
        if env.rank == 0:  # every rank has the same all-reduced loss, so one says it
            write_exit(run_dir, attempt, code=1, reason=str(e), step=None)
            print(f"cona trainer: error: training diverged: {e}", file=sys.stderr, flush=True)
        status = 1
    except Exception as e:
        broken = communication_error(e)
        if broken is None:
            # Unexplained: this rank's own record of what ended it, for the orchestrator's crash line (`rank 3:
            # ValueError: …`); torchrun's summary names only an exit code. The traceback follows in the log.
            with contextlib.suppress(OSError):
                run_dir.write_crash(attempt, CrashRecord.of(env.rank, e))
            raise
        # A peer died or hung in a collective: no save, no exit record (nothing collective can follow on a broken
        # group), only this rank's crash record and one line; a crash (exit 1), relaunched from the last complete
        # checkpoint. The SIGTERM watcher leaves the rank to end so: it is on its way out, its record being written.
        control.ending = True
        with contextlib.suppress(OSError):
            run_dir.write_crash(attempt, CrashRecord.of(env.rank, broken))
        print(f"cona trainer: error: rank {env.rank}: {broken}", file=sys.stderr, flush=True)
        status = 1
    finally:
        # FSDP2's state and the DTensors of a trainer sit in reference cycles that hold the process groups. Left to
        # the interpreter's teardown, the groups are destroyed there, and a rank can abort after a clean exit record
        # ("terminate called without an active exception", exit -6), which torchrun reports as a crash of the whole
        # attempt. Collect them while the interpreter is whole, as an in-place switch does.
        trainer = None
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return status
