"""A preloaded interpreter for one-process arms (`launcher.preload`): torch imported once per
sweep, each arm a fork of it.

Every arm's process imports torch, dynamo and inductor before its first line of training:
about 2.4 s of a warm arm's 10-11 s on an H100 VM (docs/benchmarks/time-to-decision-gpu.md),
paid again by every arm of every pair. The server imports them once, then forks one child per
arm; the child takes the arm's command line, environment, working directory and standard
streams and runs the trainer's `-m module` or script as `python` would. CUDA is never
initialised in the server (a driver initialised before a fork fails in the child), so each
child makes its own context, as a fresh process does.

This file is run by path and imports nothing of moe_perf: the server holds no moe_perf
module, and each arm imports its own worktree's. Stdlib only.

    python forkserver.py serve SOCKET RUNNER_PID MODULE...
    python forkserver.py run SOCKET SERVER_PID INFO_JSON -- ARGV...

`serve` imports the modules, then listens on SOCKET (which appears once they are imported),
one arm at a time, and exits when RUNNER_PID, its parent, is gone (removing the socket's
directory, which that runner would have removed). `run` is the arm's launch:
it hands its argv, environment, cwd and streams to the server, forwards the signals it gets to
the child, and exits as the child did. Where the server cannot serve the arm (gone, an
interpreter option, or a directory early on the arm's path that holds its own copy of a
preloaded package), `run` says why on stderr and execs the plain `python ARGV` itself. Either
way INFO_JSON records what happened.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
MAX_MESSAGE = 1 << 20  # an arm's argv and environment
READY_TIMEOUT_S = 300.0  # how long an arm waits for the server's imports
REQUEST_TIMEOUT_S = 30.0  # how long the server waits for a connected launch's request
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip


def _send(conn: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


class _Lines:
    """Newline-ended JSON messages from a stream socket (the first may carry file descriptors)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn, self.buffer, self.fds = conn, b"", []

    def next(self, with_fds: int = 0) -> dict | None:
        while b"\n" not in self.buffer:
            if with_fds:
                data, fds, _, _ = socket.recv_fds(self.conn, MAX_MESSAGE, with_fds)
                self.fds += fds
            else:
                data = self.conn.recv(MAX_MESSAGE)
            if not data:
                return None
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)


# ---- the server -------------------------------------------------------------------------------


class Server:
    def __init__(self, path: str, parent: int, modules: list[str]) -> None:
        self.path, self.parent, self.modules = path, parent, modules
        # a fresh `python -m X` has its cwd first, the runner's PYTHONPATH next, then the rest
        self.own_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        t0 = time.perf_counter()
        # torch.cuda.is_available() asks the driver for its device count, which poisons every
        # later fork for CUDA (inductor's import asks); through NVML it does not
        own_check = os.environ.get(NVML_CHECK)
        os.environ[NVML_CHECK] = "1"
        try:
            for name in modules:
                importlib.import_module(name)
        finally:
            if own_check is None:
                del os.environ[NVML_CHECK]
            else:
                os.environ[NVML_CHECK] = own_check
        self.import_s = round(time.perf_counter() - t0, 3)
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            raise SystemExit("forkserver: importing the modules initialised CUDA; a fork of this "
                             "process could not use the GPU")  # fmt: skip
        self.preloaded = sorted({name.split(".")[0] for name in sys.modules} - {"__main__"})
        self.base_path = [p for p in sys.path if p not in self.own_pythonpath]
        # the imports' objects out of every collection's reach, the children's included: a
        # child's full collection would walk them all and write to each page they lie on,
        # which the kernel then copies (dynamo's trace in step 1 ran 0.3 s slower in a fork)
        gc.collect()
        gc.freeze()
        sys.stdout.flush()
        sys.stderr.flush()

    def serve(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staging = f"{self.path}.{os.getpid()}"
        listener.bind(staging)
        listener.listen(16)
        os.rename(staging, self.path)  # the socket appears once the imports are done
        listener.settimeout(1.0)
        while self._parent_alive():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(REQUEST_TIMEOUT_S)  # a launch that connects and says nothing
            with conn:
                try:
                    self._serve_one(conn, listener)
                except OSError:  # the launch went away mid-exchange; its child is gone too
                    continue

    def _parent_alive(self) -> bool:
        return os.getppid() == self.parent

    def _serve_one(self, conn: socket.socket, listener: socket.socket) -> None:
        lines = _Lines(conn)
        request = lines.next(with_fds=3)
        fds = lines.fds
        try:
            if request is None or len(fds) != 3:
                return
            why = self._cannot_serve(request)
            if why:
                _send(conn, {"refused": why})
                return
            conn.settimeout(None)
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _run_child(request, fds, self.base_path)  # never returns
        finally:
            for fd in fds:
                os.close(fd)
        try:
            _send(conn, {"pid": pid, "server_pid": os.getpid(), "import_s": self.import_s,
                         "modules": self.modules})  # fmt: skip
        finally:
            code = self._wait(pid, conn)  # at once when the launch is already gone
        _send(conn, {"exit": code})

    def _cannot_serve(self, request: dict) -> str | None:
        """Why a fresh `python ARGV` with this environment would not import what this process
        imported: a directory ahead of the installed packages that holds its own copy."""
        for directory in _leading_path(request, self.base_path):
            if directory in self.own_pythonpath:  # where this process found its modules too
                continue
            for name in self.preloaded:
                for candidate in (name, f"{name}.py"):
                    if os.path.exists(os.path.join(directory, candidate)):
                        path = os.path.join(directory, candidate)
                        return f"{path} would be imported instead of the preloaded {name}"
        return None

    def _wait(self, pid: int, conn: socket.socket) -> int:
        """The child's exit status (negative: the signal that ended it); the child is killed
        when its launch goes (the connection closes) or the runner does."""
        pidfd = os.pidfd_open(pid)
        with selectors.DefaultSelector() as selector:
            selector.register(pidfd, selectors.EVENT_READ)
            selector.register(conn, selectors.EVENT_READ)
            while True:
                ready = [key.fileobj for key, _ in selector.select(timeout=1.0)]
                if pidfd in ready:
                    break
                gone = conn in ready and not conn.recv(1, socket.MSG_PEEK)
                if gone or not self._parent_alive():
                    os.kill(pid, signal.SIGKILL)
                    break
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)


def _leading_path(request: dict, base_path: list[str]) -> list[str]:
    """The directories a fresh interpreter would search before the installed packages: the
    script's directory or the cwd (`-m`), then the arm's PYTHONPATH."""
    argv, cwd = request["argv"], request["cwd"]
    first = cwd if argv[0] == "-m" else os.path.dirname(os.path.join(cwd, argv[0]))
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    return [d for d in [first, *extra] if d and d not in base_path]


def _run_child(request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the fork: become `python ARGV` with the arm's streams, environment and cwd."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = [*_leading_path(request, base_path), *base_path]
        argv = request["argv"]
        import runpy

        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter reports an uncaught exception
        traceback.print_exc()
        code = 1
    finally:
        # what the interpreter does on its way out: non-daemon threads joined, atexit run
        try:
            threading._shutdown()
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str, parent: int, modules: list[str]) -> None:
    sys.path.pop(0)  # this file's directory: nothing here may shadow what the arms import
    server = Server(path, parent, modules)
    print(f"forkserver {os.getpid()}: {', '.join(modules)} imported in {server.import_s} s",
          flush=True)  # fmt: skip
    server.serve()
    _remove_directory(path)


def _remove_directory(path: str) -> None:
    """The runner is gone, so nobody stops this server or removes its directory (the runner's
    temporary one, holding the socket and this server's log): it goes now, if nothing else is
    in it."""
    directory = os.path.dirname(path)
    for name in (path, os.path.join(directory, "server.log")):
        try:
            os.unlink(name)
        except OSError:
            pass
    try:
        os.rmdir(directory)
    except OSError:
        pass


# ---- an arm's launch ------------------------------------------------------------------------


def _write_info(path: str, info: dict) -> None:
    try:
        with open(path, "w", encoding="utf-8") as out:
            json.dump(info, out, indent=1)
    except OSError:
        pass  # the arm directory is the runner's; a launch never fails for its note


def _plain(argv: list[str], info_path: str, why: str) -> None:
    print(f"[moe_perf] launched without the preloaded interpreter: {why}", file=sys.stderr,
          flush=True)  # fmt: skip
    _write_info(info_path, {"preloaded": False, "why": why})
    os.execv(sys.executable, [sys.executable, *argv])


def _running(pid: int) -> bool:
    """Alive and not a zombie (a server that failed its imports waits for the runner's reaping)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _connect(path: str, server_pid: int) -> socket.socket:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not os.path.exists(path):
        if not _running(server_pid):
            raise ConnectionError(f"the preloaded interpreter (pid {server_pid}) is gone")
        if time.monotonic() > deadline:
            raise ConnectionError(f"the preloaded interpreter (pid {server_pid}) was not ready "
                                  f"after {READY_TIMEOUT_S:g} s")  # fmt: skip
        time.sleep(0.01)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    return conn


def run(path: str, server_pid: int, info_path: str, argv: list[str]) -> None:
    if not argv or argv[0] != "-m" and argv[0].startswith("-") or argv == ["-m"]:
        _plain(argv, info_path, f"interpreter options in {' '.join(argv[:2])}")
    t0 = time.perf_counter()
    try:
        conn = _connect(path, server_pid)
        lines = _Lines(conn)
        _send(conn, {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}, [0, 1, 2])
        reply = lines.next()
    except OSError as err:
        _plain(argv, info_path, str(err))
    if reply is None:
        _plain(argv, info_path, f"the preloaded interpreter (pid {server_pid}) hung up")
    if "refused" in reply:
        _plain(argv, info_path, reply["refused"])
    child = reply["pid"]
    _write_info(info_path, {"preloaded": True, "pid": child, "server_pid": reply["server_pid"],
                            "modules": reply["modules"], "server_import_s": reply["import_s"],
                            "wait_s": round(time.perf_counter() - t0, 3)})  # fmt: skip

    def forward(signum, frame) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    done = lines.next()
    if done is None:  # the server died under the arm: its child must not outlive the launch
        forward(signal.SIGKILL, None)
        print(f"[moe_perf] the preloaded interpreter (pid {server_pid}) died during the arm",
              file=sys.stderr, flush=True)  # fmt: skip
        os._exit(1)
    code = done["exit"]
    if code < 0:  # ended by a signal: end the same way, so the launcher sees what happened
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def main(args: list[str]) -> None:
    if len(args) >= 3 and args[0] == "serve":
        serve(args[1], int(args[2]), args[3:])
    elif len(args) >= 5 and args[0] == "run" and args[4] == "--":
        run(args[1], int(args[2]), args[3], args[5:])
    else:
        sys.exit(
            "usage: forkserver.py serve SOCKET RUNNER_PID MODULE... | "
            "run SOCKET SERVER_PID INFO_JSON -- ARGV..."
        )


if __name__ == "__main__":
    main(sys.argv[1:])
