"""A worker process started before its job is known: torch is imported while the fleet trains.

A morph's restart is mostly a new process importing torch, then capturing the model. A daemon
keeps one spare per slot (`python -m trainer.spare`, started in the environment its slot's workers
get): it imports torch and the engine's dependencies, says so by creating the file its `--ready`
argument names (if any: a daemon waits for it before a newly joined VM is taken into a running
job), then waits for one line on stdin, a JSON
object {"script", "args", "cwd", "env", "log"}. It then appends its output to `log`, takes `env` as
its whole environment, and runs `script` as `__main__`, as `python script args` would (sys.argv,
sys.path[0] the script's directory, the script's exit status; an uncaught exception is printed
and exits 1). stdin closed without a line means the spare is not needed: it exits 0.

Besides torch, a spare imports what `torch.export` loads on its first call (`torch._dynamo`,
AOT autograd: about 1.6 s of a 2-3 s capture on this project's CI machine), since every worker
captures its model before its first step. Given `--imports-of SCRIPT` (the job running on its
daemon), it also imports the installed packages the script imports at its top level, and the
names it takes from them (`from transformers import GPT2LMHeadModel` loads the model's modules:
about a second on this host), so that a morph's worker of a Hugging Face model does not pay for
them. Never a module the script's own directory holds (the script would then find the installed
one of the same name), nor this project's (some read the environment when imported); whatever
fails to import is left for the script to meet. The daemon hands such a spare only that script's
workers (varunad.node.spares). Whatever a spare imported, a script whose directory holds a module of
the same name (a `numpy.py` beside it) runs in a fresh interpreter the spare execs, as it would have
without the spare.

A spare imports at a lower priority (nice +10) and takes its own back when its order comes, where
it may (root, or an RLIMIT_NICE that allows it): it imports beside the epoch's running worker on
the same cores, and that worker's compute time is what the leader judges stragglers by.

Only what is read after start-up may differ between the spare's environment and the job's:
`STARTUP_KEYS` (thread counts torch reads when imported, malloc tuning glibc reads at exec, the
module path) and every `TORCH*`/`PYTORCH*` variable (torch's and dynamo's configs read theirs when
imported) must be equal, or the daemon starts a fresh process instead (`fits`). The engine's own
modules are not imported ahead: some read the environment when imported.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.machinery
import json
import os
import resource
import sys
import time
from collections.abc import Mapping

__all__ = ["AHEAD", "STARTUP_KEYS", "STARTUP_PREFIXES", "fits", "main", "script_imports"]

STARTUP_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                "PYTHONPATH", "PYTHONHASHSEED", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES", "LD_PRELOAD",
                "LD_LIBRARY_PATH")


STARTUP_PREFIXES = ("TORCH", "PYTORCH")
IMPORT_NICE = 10   # how much lower a spare's priority is while it imports
# imported ahead: torch.export's first call loads these (dynamo alone is most of it)
AHEAD = ("torch", "numpy", "zmq", "msgpack", "torch._dynamo", "torch._functorch.aot_autograd")
# never imported ahead for a script: this project's packages read the worker's environment
OWN_PACKAGES = ("trainer", "varunad", "protocol")


def fits(spare_env: Mapping[str, str], job_env: Mapping[str, str]) -> bool:
    """Whether a spare started in `spare_env` can run a worker whose environment is `job_env`."""
    keys = set(STARTUP_KEYS) | {k for k in (*spare_env, *job_env) if k.startswith(STARTUP_PREFIXES)}
    return all(spare_env.get(k) == job_env.get(k) for k in keys)


def script_imports(script: str) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names taken from it) for each absolute import the script runs when it starts: its
    top-level statements, and those inside top-level ``if``/``try``/``with`` blocks (a function's or
    a class's body runs later, if ever). Modules its own directory holds and this project's are
    left out. [] for a script that does not parse (the worker will say why)."""
    path = os.path.abspath(script)
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    here = os.path.dirname(path)
    out: list[tuple[str, tuple[str, ...]]] = []

    def visit(body) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                out.extend((a.name, ()) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append((node.module, tuple(a.name for a in node.names if a.name != "*")))
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))

    visit(tree.body)

    def wanted(module: str) -> bool:
        top = module.split(".")[0]
        return top not in OWN_PACKAGES and not _holds(here, top)
    return [(m, names) for m, names in out if wanted(m)]


def _holds(directory: str, name: str) -> bool:
    """Whether ``import name`` from a script in ``directory`` finds a module or package there. A
    plain folder of that name (a data directory) does not count: an installed package wins over it."""
    spec = importlib.machinery.PathFinder.find_spec(name, [directory])
    return spec is not None and spec.origin is not None


def _import_ahead(script: str) -> None:
    started, done = time.perf_counter(), []
    for module, names in script_imports(script):
        try:
            mod = importlib.import_module(module)
            for name in names:
                getattr(mod, name, None)   # a lazy package (transformers) loads a name's modules here
            done.append(module)
        except (Exception, SystemExit):   # the script meets it again, and says so in its own log
            continue
    # the spare's own log (the daemon's state dir, spares/slotN.log), before the worker's output
    print(f"spare {os.getpid()}: imported {len(done)} modules {script} imports ({', '.join(done)}) "
          f"in {time.perf_counter() - started:.2f}s", flush=True)


def _run(order: dict) -> None:
    log = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    script = order["script"]
    here = os.path.dirname(os.path.abspath(script))
    shadowed = _shadowed(here)
    if shadowed:
        # the script would import the installed module this spare holds instead of its own file: it
        # runs as `python script args` after all, in this process (its PID, output and exit status)
        print(f"spare: {here} holds {', '.join(shadowed)}, which this spare had imported: running "
              f"{os.path.basename(script)} in a fresh interpreter", file=sys.stderr, flush=True)
        os.execv(sys.executable, [sys.executable, script, *order["args"]])
    sys.argv = [script, *order["args"]]
    sys.path[0] = here
    import runpy

    runpy.run_path(script, run_name="__main__")


def _shadowed(directory: str) -> list[str]:
    """The top-level modules this process has imported that ``directory`` holds a module of the same
    name for: a script there that imports one expects its own."""
    tops = sorted({name.split(".")[0] for name in list(sys.modules)} - {"__main__"} - set(sys.builtin_module_names))
    return [name for name in tops if _holds(directory, name)]


def _may_return_to(nice: int) -> bool:
    """Whether this process may set its nice value back to `nice` after raising it: root may, and
    so may a process whose RLIMIT_NICE allows `nice` (systemd's LimitNICE=)."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= nice


def _set_nice(nice: int) -> None:
    # Linux applies a nice value per thread: every thread the imports started gets it back
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)


def _arguments(argv: list[str]) -> dict[str, str]:
    """``--ready FILE`` and ``--imports-of SCRIPT``, in any order (the daemon is the only caller)."""
    return {argv[i]: argv[i + 1] for i in range(0, len(argv) - 1, 2) if argv[i] in ("--ready", "--imports-of")}


def main() -> None:
    # A spare imports beside the epoch's running worker on the same cores: it does so with less
    # priority, so that the worker's measured compute (what the leader judges stragglers by) does
    # not slow down for its import. Only where the worker it becomes can get its priority back.
    start = os.getpriority(os.PRIO_PROCESS, 0)
    humble = _may_return_to(start)
    if humble:
        _set_nice(min(19, start + IMPORT_NICE))
    args = _arguments(sys.argv[1:])
    for name in AHEAD:   # the point of a spare: imported before it is needed
        importlib.import_module(name)
    if args.get("--imports-of"):
        _import_ahead(args["--imports-of"])
    if args.get("--ready"):
        with open(args["--ready"], "w", encoding="utf-8") as f:
            f.write(f"{os.getpid()}\n")
    line = sys.stdin.readline()
    if not line.strip():
        return
    if humble:
        _set_nice(start)
    devnull = os.open(os.devnull, os.O_RDONLY)   # a worker's stdin, as the daemon starts one afresh
    os.dup2(devnull, 0)
    os.close(devnull)
    _run(json.loads(line))


if __name__ == "__main__":
    main()
