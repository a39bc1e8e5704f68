"""Ranks that start in a second: a warm parent that has torch and titanlite imported forks them.

A torchrun launch spends most of its first seconds importing: the agent imports torch, then
every worker imports torch, torch._dynamo (the first optimizer pulls it in), transformers and
titanlite, about 7-9 CPU seconds each, on every launch. Here one server process does those
imports once per notebook kernel (or pytest session) and then forks each rank of each job from
itself. A fork copies the imported modules for free (copy-on-write), so a rank goes straight to
joining its process group.

Each rank is still a real, separate process: its own PID, session, memory, process group
(gloo/NCCL via MASTER_ADDR/MASTER_PORT, as torchrun sets them) and exit status, so kills, hangs,
stragglers and per-rank memory behave as under torchrun. Nothing a job does reaches the next
one: every job's ranks are forked from the same untouched parent, never reused. The server
itself never initialises CUDA, never runs a torch op and starts no Python thread (all checked
before it answers), because a fork copies only the calling thread: a lock or device context held
by another thread would be broken in the child.

    server = ForkServer.shared()                      # started on first use, reused after
    pid = server.spawn(["-m", "titanlite", "train", "--config", "c.toml"], env, cwd, out, err)
    server.exits()                                    # {pid: status} of ranks that ended

Linux only (macOS forbids fork without exec once system frameworks are loaded): elsewhere the
launcher uses torchrun. The protocol is JSON lines on the server's stdin and stdout.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

# What every rank imports anyway (a worker of `titanlite train` or of `launch_function`), and so
# what the server imports for it. Modules only some runs need (FSDP, DCP, pipelining, torchao) are
# left to the ranks that use them, so a rank's memory holds what a torchrun worker's would.
PRELOAD = (
    "torch",
    "torch._dynamo",  # the first torch.optim constructor imports it: 2-3 s
    "torch.distributed.elastic.multiprocessing.errors",
    "transformers",
    "titanlite.train",
    "titanlite.tools.cli.commands",
    "titanlite.tools.jobs.run_function",
    "titanlite.tools.formats.corpora",
    "titanlite.tools.probe.datasheet",
    "titanlite.tools.measure.goodput",
    "titanlite.tools.formats.hf_start",
    "titanlite.tools.measure.profiling",
    "titanlite.tools.measure.stragglers",
)
PACKAGE = Path(__file__).resolve().parents[2]  # titanlite/


# ----- the server (python -m titanlite.tools.jobs.forkserver) ---------------------------------------


def serve() -> None:
    """Import PRELOAD, say whether forking is safe, then fork a rank per request until stdin ends."""
    _die_with_parent(signal.SIGTERM)
    import importlib

    from ..display.notebook import quiet_third_party

    quiet_third_party()  # as every worker does first: torchao's CPU import noise
    start = time.perf_counter()
    for name in PRELOAD:
        importlib.import_module(name)
    _send({"ready": True, "import_s": round(time.perf_counter() - start, 3), **fork_safety()})
    # A rank's end (SIGCHLD) wakes the loop through a pipe: select() itself would sleep through it.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    pending = b""
    while True:
        _reap(children)
        readable, _, _ = select.select([0, wake_r], [], [], 1.0)
        if wake_r in readable:
            os.read(wake_r, 4096)
        if 0 not in readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:  # the launcher is gone: so are we (the ranks follow, PDEATHSIG)
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                _become_rank(request)  # never returns
            children.add(pid)
            _send({"pid": pid, "id": request.get("id")})


def fork_safety() -> dict:
    """What would make a fork unsafe, read off this process: Python threads other than this one
    (a fork copies only the caller), CUDA initialised (a forked child cannot use it), torch's
    intra-op thread pool started."""
    import threading

    import torch

    return {
        "python_threads": threading.active_count(),
        "cuda_initialized": bool(torch.cuda.is_initialized()),
        "torch": torch.__version__,
    }


def _reap(children: set[int]) -> None:
    """Report every rank that has ended, in the order the kernel hands them over: the launcher
    takes the first failure reported as the job's root cause."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "status": os.waitstatus_to_exitcode(status)})


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _die_with_parent(sig: int) -> None:
    """Linux: the kernel sends `sig` to this process when its parent dies, even by SIGKILL."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _become_rank(request: dict) -> None:
    """In the forked child: become what torchrun would have started, run it, exit. Never returns."""
    code = 1
    try:
        os.setsid()  # a session of its own, as torchrun gives each worker: one signal reaches its children
        _die_with_parent(signal.SIGKILL)  # the server gone means the launcher is gone
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for fd, target in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        # Unbuffered text streams on the new files (PYTHONUNBUFFERED acts only at interpreter start).
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _fresh_process_state(request["env"])
        code = _run_main(request["argv"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 130 if isinstance(sys.exc_info()[1], KeyboardInterrupt) else 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken log: nothing left to say
                pass
        os._exit(code)


def _fresh_process_state(env: dict) -> None:
    """What a new interpreter would have that a fork does not: fresh seeds for Python's, NumPy's
    and torch's global generators (a fork would start every rank of every job from the server's
    state), and the thread count the job asked for (OpenMP read OMP_NUM_THREADS when the server
    loaded it, not now)."""
    import random

    import numpy as np
    import torch

    random.seed()
    np.random.seed()
    torch.seed()  # a non-deterministic seed, as a fresh process draws
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _run_main(argv: list[str]) -> int:
    """`python <argv>`: `-m module args...` or `script args...`, as `__main__`."""
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, str(Path(argv[0]).resolve().parent))  # as `python script.py` does
        runpy.run_path(argv[0], run_name="__main__")
    return 0


# ----- the client: what the launcher holds -----------------------------------------------------


class ForkServerError(RuntimeError):
    pass


class ForkServer:
    """A running server and the pipe to it. `shared()` is the one of this process."""

    _shared: ForkServer | None = None

    def __init__(self, timeout_s: float = 300.0):
        self.sources = _source_stamp()
        # The environment the server's libraries saw as they loaded (OpenMP, MKL and the like
        # read theirs then, once): a rank gets a server started in exactly its launcher's.
        self.environ = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "titanlite.tools.jobs.forkserver"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=str(PACKAGE.parent),
            env=self.environ,
        )
        self.exited: dict[int, int] = {}
        self._buffer = b""
        self._next_id = 0
        ready = self._receive(lambda m: "ready" in m, timeout_s)
        self.import_s = ready["import_s"]
        if ready["python_threads"] != 1 or ready["cuda_initialized"]:
            self.close()
            raise ForkServerError(f"forking from the server is not safe here: {ready}")

    @classmethod
    def shared(cls) -> ForkServer:
        """This process's server, started on first use; started again if it died, if titanlite's
        source changed since (the ranks must run the code on disk) or if the environment did."""
        server = cls._shared
        if (
            server is None
            or server.proc.poll() is not None
            or server.sources != _source_stamp()
            or server.environ != dict(os.environ)
        ):
            if server is not None:
                server.close()
            cls._shared = server = cls()
        return server

    def spawn(self, argv: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> int:
        """Fork one rank running `python <argv>` with exactly `env`; its output appended to the files."""
        self._next_id += 1
        request = {"id": self._next_id, "argv": argv, "env": env, "cwd": os.path.abspath(cwd)}
        # the server's working directory is not the launcher's: paths go over whole
        request.update(stdout=os.path.abspath(stdout), stderr=os.path.abspath(stderr))
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise ForkServerError(f"the fork server is gone ({e})") from None
        return self._receive(lambda m: m.get("id") == self._next_id, 60.0)["pid"]

    def children(self) -> list[int]:
        """The server's live children (Linux /proc): ranks still running, or not yet reaped."""
        pids = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == self.proc.pid and fields[0] != "Z":
                pids.append(int(entry.name))
        return pids

    def exits(self) -> dict[int, int]:
        """{pid: exit status (negative: killed by that signal)} of every rank that has ended."""
        self._receive(lambda m: False, 0.0)
        return dict(self.exited)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the server returns at end of input
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _receive(self, wanted, timeout_s: float) -> dict:
        """Read messages until one satisfies `wanted` (returned) or `timeout_s` passes ({})."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buffer:
                line, self._buffer = self._buffer.split(b"\n", 1)
                message = json.loads(line)
                if "exit" in message:
                    self.exited[message["exit"]] = message["status"]
                if wanted(message):
                    return message
            left = deadline - time.monotonic()
            readable, _, _ = select.select([fd], [], [], max(0.0, left))
            if not readable:
                if left <= 0:
                    if timeout_s:
                        raise ForkServerError(
                            f"the fork server did not answer in {timeout_s:.0f} s"
                        )
                    return {}
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise ForkServerError(
                    f"the fork server exited (status {self.proc.wait()}): "
                    f"run with TITANLITE_LAUNCH=torchrun to see why"
                )
            self._buffer += chunk


def _source_stamp() -> tuple:
    """The newest modification time and count of titanlite's modules: a change means a new server."""
    files = list(PACKAGE.rglob("*.py"))
    return len(files), max(f.stat().st_mtime_ns for f in files)


if __name__ == "__main__":
    serve()
