"""cona's Slurm job helper: the run-directory side of the batch script (stdlib only; `agent` also needs torch).

The rendered batch script (orchestrator/backends/slurm/templates/cona.sbatch.tmpl) writes this file into the run directory and
calls it as `python helper.py <command> ...`; nothing here imports cona, so a running job keeps working while the
orchestrator is upgraded. One copy of this text exists: this file; the script embeds it verbatim.

Commands:
  next    --run-dir D --submission S [--after N] [--timeout T] [--job J] [--restarts R] [--port-base B]
          Wait (bounded) until the orchestrator hands this job an attempt and print
          `ATTEMPT NNODES NPROC PORT RDZV_ID STRATEGY`; exit 3 on timeout, 4 when the run moved on to another
          job. An elastic launch record (`by_nnodes`: {node count: strategy, processes per node}) is run with the
          strategy planned for NNODES (`--nnodes`, the job's $SLURM_NNODES); exit 2 when it plans none for it.
  agent   --node-dir DIR -- <torchrun arguments>
          Run torchrun in this process, survive the step's SIGTERM/SIGUSR1 (they reach every trainer process
          directly), record the trainer's own exit code in DIR/<SLURM_NODEID>.json and exit 0 for protocol codes
          (0, 42, 43, 44) so `srun --kill-on-bad-exit` only fires on crashes.
  finish  --run-dir D --attempt N --nnodes K --submission S --srun-rc R [--signal SIG] [--job J] [--restarts R]
          [--requeue-by scontrol|none]
          [--restarts-now K]
          Combine the node records of the step started as attempt N into attempts/M/slurm-exit.json, M the attempt
          the step's processes ended as (`last`), and print the next action: `done`, `stop`, `wait`, `requeue`
          (ask Slurm to requeue the job), `requeued` (Slurm is requeuing it already: K > R) or `exit CODE`.
  last    --run-dir D --attempt N
          Print M, the attempt that the step started as attempt N ended as: the trainer's processes switch in
          place (same node count) and go on as N+1, N+2, ...; each such switch leaves an exit record
          (attempts/K/exit.json) naming `next_attempt` K+1, whose launch.json says `in_place`. N when none did.

Exit codes of the trainer (protocol/rundir.py ExitCode): 0 done, 42 switch, 43 stopped, 44 bad world, else crash.
"""

import contextlib
import glob
import hashlib
import json
import os
import signal
import socket
import stat
import sys
import tempfile
import time

DONE, SWITCH, STOPPED, BAD_WORLD = 0, 42, 43, 44
PROTOCOL = (DONE, SWITCH, STOPPED, BAD_WORLD)
PORT_RANGE = 1000


def _atomic_write_json(path, data):
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _read_json(path):
    """The JSON object in `path`, or None when missing, torn or not an object. A FIFO or a device in its place is
    no record either, said on stderr (the job's log): opened without blocking, since reading one would hang the job
    past every bound of its waits (the orchestrator, which reads the same files, refuses it in its own line)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            print(f"slurm_helper: {path} is not a regular file; read as no record", file=sys.stderr, flush=True)
            return None
        try:
            data = json.loads(f.read().decode())
        except (OSError, ValueError):
            return None
    return data if isinstance(data, dict) else None


def _args(argv, flags):
    """Parse `--name value` pairs (every flag takes a value); unknown flags are an error."""
    out = dict(flags)
    i = 0
    while i < len(argv):
        name = argv[i]
        if name == "--":
            out["--"] = argv[i + 1 :]
            break
        key = name[2:].replace("-", "_") if name.startswith("--") else None
        if key not in flags or i + 1 >= len(argv):
            raise SystemExit(f"slurm_helper: bad argument {name!r}")
        out[key] = argv[i + 1]
        i += 2
    return out


def _attempt_dir(run_dir, attempt):
    return os.path.join(run_dir, "attempts", str(attempt))


def _all_launches(run_dir):
    """{attempt: launch record} of every launch.json of the run, read once (one snapshot)."""
    found = {}
    for path in glob.glob(os.path.join(glob.escape(run_dir), "attempts", "*", "launch.json")):
        record = _read_json(path)
        try:
            found[int((record or {})["attempt"])] = record
        except (KeyError, TypeError, ValueError):
            continue
    return found


def _addressed_to(launches, submission):
    """The launch records of `launches` ({attempt: record}) addressed to `submission`."""
    return {n: record for n, record in launches.items() if record.get("submission") == submission}


def _newest_launch(launches):
    """(attempt, record) of the newest attempt of `launches` ({attempt: record}, `_all_launches`), in any job;
    (-1, {}) if none yet.

    Launch records are written before their attempt is submitted, so this is the attempt the run is on."""
    newest = max(launches, default=-1)
    return newest, launches.get(newest, {})


def rendezvous_port(base, run_dir, job, attempt, restarts):
    """base + a stable hash of (run dir, job id, attempt, restart count) modulo the range: concurrent jobs differ."""
    key = f"{os.path.abspath(run_dir)}\0{job}\0{attempt}\0{restarts}"
    span = max(1, min(PORT_RANGE, 65535 - int(base)))
    return int(base) + int(hashlib.sha256(key.encode()).hexdigest(), 16) % span


def free_port(port, base):
    """`port`, or the next port of the range that can be bound here (the batch script runs on the first node,
    which hosts the rendezvous), so an unrelated process holding the hashed port does not break the attempt."""
    base = int(base)
    span = max(1, min(PORT_RANGE, 65535 - base))
    for i in range(64):
        candidate = base + (port - base + i) % span
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", candidate))
            except OSError:
                continue
        return candidate
    return port


def _rdzv_id(run_dir, attempt, job, restarts):
    name = "".join(
        c if c.isalnum() or c in "-_." else "_" for c in os.path.basename(os.path.abspath(run_dir))
    )
    return f"{name[:40] or 'run'}-{attempt}-{job}-{restarts}"


def cmd_next(argv):
    a = _args(
        argv,
        {
            "run_dir": None,
            "submission": "",
            "after": "",
            "timeout": "300",
            "job": "0",
            "restarts": "0",
            "port_base": "29500",
            "nnodes": "1",
            "gpus_per_node": "1",
        },
    )
    run_dir, submission = a["run_dir"], a["submission"]
    after = int(a["after"]) if a["after"] != "" else None
    deadline = time.monotonic() + float(a["timeout"])

    # A manual `sbatch` of a rendered script (no submission): run the newest launched attempt once.
    if not submission:
        attempt, newest = _newest_launch(_all_launches(run_dir))
        strategy = newest.get("strategy") or {}
        if after is not None or attempt < 0 or not strategy:
            return 3
        nnodes = int(a["nnodes"])
        world = int(strategy.get("dp", 1)) * int(strategy.get("tp", 1)) * int(strategy.get("pp", 1))
        if world % nnodes:
            sys.stderr.write(f"cona: world size {world} does not split over {nnodes} nodes\n")
            return 2
        record = {
            "attempt": attempt,
            "nnodes": nnodes,
            "nproc_per_node": world // nnodes,
            "strategy": strategy,
        }
        return _print_next(a, record)

    # The nodes this job holds now ($SLURM_NNODES); None when not given or not set by Slurm (the batch script
    # defaults it to 1 outside a job): not checked then, as an attempt must not wait for a count nobody knows.
    allocated = int(a["nnodes"]) if "--nnodes" in argv and os.environ.get("SLURM_NNODES") else None
    said_short = None
    while True:
        # One snapshot for both: read apart, a launch record written in between (this job's next attempt) was
        # missing from the first and newest in the second, and the job ended as if the run went on elsewhere.
        every = _all_launches(run_dir)
        launches = _addressed_to(every, submission)
        current = _newest_launch(every)[0]  # the attempt the run is on, in whichever job
        mine = sorted(launches)
        if after is None and mine:
            newest = mine[-1]
            done = _read_json(os.path.join(_attempt_dir(run_dir, newest), "slurm-exit.json")) or {}
            if done.get("submission") == submission and not done.get("requeued"):
                after = newest  # (re)started after this attempt had ended: wait for the next hand-off
        candidates = [n for n in mine if after is None or n > after]
        if candidates:
            attempt = candidates[-1]
            if current == attempt:
                record = launches[_runnable(run_dir, launches, attempt)]
                if not _too_few_nodes(record, allocated):
                    return _print_next(a, record)
                # An elastic job (`--nodes=MIN-MAX`) that Slurm requeued can start again on fewer nodes than the
                # attempt it ran when that attempt is not its elastic start (a switch in place, a relaunch in the
                # allocation: no `by_nnodes` to choose from). Its srun would fail ("Only allocated 1 nodes asked
                # for 2") and the attempt count as a crash; wait instead: the orchestrator sees the job on fewer
                # nodes than the attempt needs and replans for them (SlurmBackend: `lost_nodes`, a shrink).
                if said_short != attempt:
                    said_short = attempt
                    sys.stderr.write(f"cona: attempt {attempt} needs {record.get('nnodes')} node(s), this job has "
                                     f"{allocated}; waiting for the orchestrator to replan\n")
            if current > attempt:
                sys.stderr.write(f"cona: the run moved on to attempt {current}; not running {attempt}\n")
                return 4
        elif mine and current > mine[-1]:
            sys.stderr.write(f"cona: attempt {current} runs in another job; this one is not needed\n")
            return 4
        if time.monotonic() >= deadline:
            return 3
        time.sleep(0.5)


def _too_few_nodes(record, allocated):
    """Whether `record` (not an elastic one: those run the strategy planned for the nodes the job got) asks for
    more nodes than the job has (`allocated`, unknown when None)."""
    if allocated is None or isinstance(record.get("by_nnodes"), dict):
        return False
    try:
        return int(record.get("nnodes") or 1) > allocated
    except (TypeError, ValueError):
        return False


def _runnable(run_dir, launches, attempt):
    """The attempt to start for the run's current `attempt`: itself, unless it was offered to the previous
    attempt's processes as an in-place switch (`in_place`) that they never made (the job was requeued first, so
    no exit record names it): then that previous attempt, whose trainer finds the switch request again."""
    while launches.get(attempt, {}).get("in_place") and attempt - 1 in launches:
        switched = _read_json(os.path.join(_attempt_dir(run_dir, attempt - 1), "exit.json")) or {}
        if switched.get("next_attempt") == attempt:
            break
        attempt -= 1
    return attempt


def _print_next(a, record):
    table = record.get("by_nnodes")
    if isinstance(table, dict):
        # An elastic launch (`sbatch --nodes=MIN-MAX`): run the orchestrator's plan for the nodes Slurm gave.
        entry = table.get(str(int(a["nnodes"])))
        if not isinstance(entry, dict):
            sys.stderr.write(f"cona: no strategy planned for {a['nnodes']} node(s) (planned: {','.join(sorted(table))})\n")
            return 2
        record = {**record, "nnodes": int(a["nnodes"]), "nproc_per_node": int(entry["nproc_per_node"]),
                  "strategy": entry["strategy"]}
    attempt = int(record["attempt"])
    port = free_port(
        rendezvous_port(a["port_base"], a["run_dir"], a["job"], attempt, a["restarts"]), a["port_base"]
    )
    rdzv_id = _rdzv_id(a["run_dir"], attempt, a["job"], a["restarts"])
    strategy = record.get("strategy") or {}
    text = ",".join(f"{k}={int(strategy[k])}" for k in ("dp", "tp", "pp", "mbs", "gbs") if k in strategy)
    print(f"{attempt} {int(record['nnodes'])} {int(record['nproc_per_node'])} {port} {rdzv_id} {text or '-'}")
    return 0


def _begin(run_dir, attempt, job, restarts, submission, nodelist, nnodes="", strategy=""):
    """Clear the node records of an earlier run of this attempt and note where it runs now."""
    adir = _attempt_dir(run_dir, attempt)
    for path in glob.glob(os.path.join(glob.escape(adir), "nodes", "*.json")):
        with contextlib.suppress(OSError):
            os.unlink(path)
    previous = os.path.join(adir, "slurm-exit.json")
    if os.path.exists(previous):
        os.replace(previous, os.path.join(adir, f"slurm-exit.{int(time.time() * 1000)}.json"))
    _atomic_write_json(
        os.path.join(adir, "slurm.json"),
        {
            "job_id": job,
            "restarts": int(restarts),
            "submission": submission,
            "nodelist": nodelist,
            "started_at": time.time(),
            "nnodes": int(nnodes) if str(nnodes).isdigit() else None,
            "strategy": _parse_strategy(strategy),
        },
    )


def _parse_strategy(text):
    """`dp=4,tp=1,...` (as `next` prints it) → {"dp": 4, ...}; None for `-` or nothing."""
    pairs = [item.partition("=") for item in str(text or "").split(",") if "=" in item]
    return {k: int(v) for k, _, v in pairs if v.isdigit()} or None


def cmd_begin(argv):
    a = _args(
        argv,
        {"run_dir": None, "attempt": None, "job": "0", "restarts": "0", "submission": "", "nodelist": "",
         "nnodes": "", "strategy": ""},
    )
    _begin(a["run_dir"], int(a["attempt"]), a["job"], a["restarts"], a["submission"], a["nodelist"], a["nnodes"],
           a["strategy"])
    return 0


def _code_of(failure_exitcode):
    code = int(failure_exitcode)
    return 128 - code if code < 0 else code  # killed by signal N → 128 + N, like a shell


def cmd_agent(argv):
    a = _args(argv, {"node_dir": None})
    torchrun_args = a.get("--") or []
    seen = []

    def note(signum, frame):  # the step's signals reach every trainer process directly; the agent stays
        seen.append(signum)

    # torchrun would turn SIGTERM into "kill the workers after 30 s" and lose their exit codes; Slurm already
    # delivers SIGTERM/SIGUSR1 to every process of the step, trainers included. PET_SIGNALS_TO_HANDLE is
    # torchrun's --signals-to-handle (torch >= 2.9); older versions install their handler unconditionally, so
    # that handler is wrapped as well.
    os.environ["PET_SIGNALS_TO_HANDLE"] = "SIGINT,SIGHUP,SIGQUIT"
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGINT,SIGHUP,SIGQUIT"
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, note)
    try:
        from torch.distributed.elastic.multiprocessing import api as elastic_api

        original = elastic_api._terminate_process_handler

        def terminate_handler(signum, frame):
            if signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
                note(signum, frame)
            else:
                original(signum, frame)

        elastic_api._terminate_process_handler = terminate_handler
    except (ImportError, AttributeError):
        pass

    code, ranks, detail, agent_error = 0, {}, "", False
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main
    except ImportError as e:
        code, detail = 1, f"cannot import torch.distributed.run: {e}"
    else:
        try:
            torchrun_main(torchrun_args)
        except ChildFailedError as e:
            # torchrun's summary of the failure (which rank, what exit code or signal), as torchrun prints it when
            # nobody catches it: it ends this node's log, where the orchestrator reads the crash's cause from.
            sys.stderr.write(f"{type(e).__module__}.{type(e).__name__}: {e}\n")
            sys.stderr.flush()
            first_rank, first = e.get_first_failure()
            code = _code_of(first.exitcode)
            ranks = {str(r): _code_of(f.exitcode) for r, f in e.failures.items()}
            detail = f"first failure: rank {first_rank}"
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # an agent error (rendezvous, store): a crash
            code, detail, agent_error = 1, f"{type(e).__name__}: {e}", True
    node = os.environ.get("SLURM_NODEID", "0")
    _atomic_write_json(
        os.path.join(a["node_dir"], f"{node}.json"),
        {
            "node": node,
            "host": os.environ.get("SLURMD_NODENAME", ""),
            "job_id": os.environ.get("SLURM_JOB_ID", ""),
            "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "code": code,
            "ranks": ranks,
            "detail": detail,
            "agent_error": agent_error,
            "signals": [signal.Signals(s).name for s in seen],
            "time": time.time(),
        },
    )
    sys.stdout.flush()
    return 0 if code in PROTOCOL else (code if 0 < code < 256 else 1)


def _chain_end(run_dir, attempt):
    """The attempt that the processes started as `attempt` ended as, following the trainer's in-place switches.

    Each switch in place leaves the trainer's exit record of attempt K naming `next_attempt` K+1, whose launch
    record (written by the orchestrator) says `in_place`. Only records of this run of the step count: an exit
    record older than the step's start (slurm.json of `attempt`) is from before a requeue."""
    started = float((_read_json(os.path.join(_attempt_dir(run_dir, attempt), "slurm.json")) or {}).get("started_at") or 0)
    current = attempt
    while True:
        record = _read_json(os.path.join(_attempt_dir(run_dir, current), "exit.json")) or {}
        following = record.get("next_attempt")
        if following != current + 1 or float(record.get("time", 0)) < started - 5:
            return current
        launch = _read_json(os.path.join(_attempt_dir(run_dir, following), "launch.json")) or {}
        if not launch.get("in_place"):
            return current
        current = following


def cmd_last(argv):
    a = _args(argv, {"run_dir": None, "attempt": None})
    print(_chain_end(a["run_dir"], int(a["attempt"])))
    return 0


def _combine(records, nnodes, srun_rc, trainer_code=None):
    """One exit code for the attempt from the per-node records (None for a node that left none).

    `trainer_code` is the code rank 0 wrote to the trainer's own exit.json during this run, if any. It settles
    one race: the agent on the first node hosts the rendezvous store and may exit (its trainers done) while
    another node's agent still polls that store and dies of it, although its trainers exit just as cleanly.
    """
    codes = [records.get(str(i), {}).get("code") for i in range(nnodes)]
    present = [c for c in codes if c is not None]
    crashes = [c for c in present if c not in PROTOCOL]
    if crashes:
        agent_errors = [r for r in records.values() if r.get("code") not in PROTOCOL and r.get("agent_error")]
        clean = [c for c in present if c in PROTOCOL]
        if (
            trainer_code in PROTOCOL
            and len(agent_errors) == len(crashes)
            and len(present) == nnodes
            and all(c == trainer_code for c in clean)
        ):
            return trainer_code, f"torchrun agent error on {len(crashes)} node(s) after the trainer exited"
        return crashes[0], "a node's trainer crashed"
    if len(present) < nnodes:
        missing = [str(i) for i, c in enumerate(codes) if c is None]
        return (srun_rc if srun_rc not in PROTOCOL else 1), f"no exit record from node(s) {','.join(missing)}"
    if len(set(present)) > 1:
        return present[0], f"nodes disagree ({','.join(map(str, present))}); node 0 decides"
    return present[0], ""


def _trainer_code(run_dir, started_as, attempt):
    """The exit code rank 0 recorded in attempts/M/exit.json (M = `attempt`, the end of the step started as
    `started_as`) during the current run of the step, or None."""
    trainer = _read_json(os.path.join(_attempt_dir(run_dir, attempt), "exit.json")) or {}
    started = (_read_json(os.path.join(_attempt_dir(run_dir, started_as), "slurm.json")) or {}).get("started_at", 0)
    code = trainer.get("exit_code")
    if isinstance(code, int) and float(trainer.get("time", 0)) >= float(started or 0) - 5:
        return code
    return None


def cmd_finish(argv):
    a = _args(
        argv,
        {
            "run_dir": None,
            "attempt": None,
            "nnodes": "1",
            "submission": "",
            "srun_rc": "0",
            "signal": "",
            "job": "0",
            "restarts": "0",
            "requeue_by": "scontrol",
            "restarts_now": "",
        },
    )
    run_dir, started_as = a["run_dir"], int(a["attempt"])
    restarts = int(a["restarts"])
    adir = _attempt_dir(run_dir, started_as)  # the step's node records lie where it was started
    attempt = _chain_end(run_dir, started_as)
    records = {}
    for path in glob.glob(os.path.join(glob.escape(adir), "nodes", "*.json")):
        record = _read_json(path)
        # A node that lost its slurmd may write late, after this attempt was started again: not ours.
        if record is None or str(record.get("job_id", a["job"])) != a["job"]:
            continue
        if int(record.get("restarts", restarts)) != restarts:
            continue
        records[str(record.get("node", os.path.basename(path)[:-5]))] = record
    code, why = _combine(records, int(a["nnodes"]), int(a["srun_rc"]), _trainer_code(run_dir, started_as, attempt))
    control = _read_json(os.path.join(run_dir, "control.json")) or {}
    requested_stop = control.get("command") == "stop"
    slurm_requeued = a["restarts_now"].isdigit() and int(a["restarts_now"]) > restarts
    if slurm_requeued:
        # Slurm itself requeued the job (node failure, preemption with PreemptMode=REQUEUE, an admin's
        # `scontrol requeue`): the attempt runs again from its last checkpoint when the job restarts.
        action, why = "requeued", (why + "; " if why else "") + "the job was requeued by Slurm"
    elif code == DONE:
        action = "done"
    elif code in (SWITCH, BAD_WORLD):
        action = "wait"
    elif code == STOPPED:
        # SIGUSR1 (the pre-timeout signal, or a preemption warning) requeues the job. So does a 43 nobody asked
        # for in control.json (under submitit the signal reaches the steps, not this shell). SIGTERM means Slurm
        # is ending the job (scancel, time limit, preemption): requeuing would undo a cancel, and a preemption
        # with PreemptMode=REQUEUE is requeued by Slurm itself. A requested stop ends the job.
        if a["signal"] == "USR1":
            action = "requeue"
        elif a["signal"] or requested_stop:
            action = "stop"
        else:
            action = "requeue"
        if action == "requeue" and a["requeue_by"] == "none":
            action = "stop"
    else:
        action = f"exit {code if 0 < code < 256 else 1}"
    _atomic_write_json(
        os.path.join(_attempt_dir(run_dir, attempt), "slurm-exit.json"),
        {
            "attempt": attempt,
            "started_as": started_as,
            "code": code,
            "detail": why,
            "action": action.split()[0],
            "requeued": action in ("requeue", "requeued"),
            "job_id": a["job"],
            "restarts": restarts,
            "submission": a["submission"],
            "srun_rc": int(a["srun_rc"]),
            "signal": a["signal"],
            "nodes": records,
            "time": time.time(),
        },
    )
    print(action)
    return 0


COMMANDS = {"next": cmd_next, "begin": cmd_begin, "agent": cmd_agent, "finish": cmd_finish, "last": cmd_last}


def main(argv):
    if not argv or argv[0] not in COMMANDS:
        sys.stderr.write(f"usage: slurm_helper.py {{{'|'.join(COMMANDS)}}} ...\n")
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
