"""A fork server for sandbox children: one clean interpreter forks each confined child.

Starting ``python -I -S`` and importing what a child needs (json, ctypes) costs ~20 ms of
CPU per sandbox run, and building the Landlock ruleset (~200 rules) and the seccomp
program another ~4 ms; a repair rollout starts ~300 such children per iteration, so on a
2-core machine the sandbox took about half of the rollout's CPU. The zygote is a
``python -I -S`` started once (empty environment, own session, no candidate code ever
runs in it); it imports the children's sources, builds the ruleset and the program once,
then for each request forks a child that, before reading anything:

1. dies with the zygote (parent-death signal; the zygote, in turn, kills its live children
   when the parent's socket closes), starts its own session and chdirs to its own fresh,
   empty working directory;
2. keeps exactly the descriptors the parent passed (stdin, stdout, ... at their target
   numbers) and closes every other one (the zygote's control socket included);
3. enters its own empty network namespace (``unshare(CLONE_NEWNET)``, or with a user
   namespace where the parent is not root; the same probe as ``unshare --net``);
4. applies the prelude's ``_apply``: resource limits (its CPU clock starts at 0 after
   the fork), no_new_privs, no capabilities, Landlock, seccomp;

and only then runs the kind's ``_main`` (the same source as a fresh interpreter runs).
So every layer of :mod:`consequence.sandbox.hardening` still applies per child, and each
child is used once. What a child inherits from the zygote is an interpreter that has
imported standard-library modules and never seen model code, tests or a nonce (those
arrive on the child's own stdin after confinement).

The parent talks to the zygote over a ``SOCK_SEQPACKET`` socket pair: a request is one
JSON message plus the descriptors (``socket.send_fds``); the zygote answers with the pid
and a pidfd (so a kill never reaches a recycled pid), and later with the exit code once
it has reaped the child. Parent side: :class:`ForkServer`, :class:`Child`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["ForkServer", "Child", "ForkServerError"]

# Runs in the zygote: ``sys.argv[1]`` = JSON {"sources": {kind: source}, "net": mode,
# "sock": fd}. Each source defines ``_prepare``, ``_apply`` and ``_main`` (the prelude's
# functions and the child's body) and runs nothing when ``__name__`` is not "__main__".
ZYGOTE = r'''
import sys, os, json, socket, signal, select, builtins, fcntl, resource
_conf = json.loads(sys.argv[1])
_kinds = {}
for _k, _src in _conf["sources"].items():
    _g = {"__name__": "__zygote__", "__builtins__": builtins}
    exec(compile(_src, "<" + _k + ">", "exec"), _g)
    _kinds[_k] = _g
del _conf["sources"]
import ctypes
_libc = ctypes.CDLL(None, use_errno=True)
_preps = {}
_live = set()  # pids of children not yet reaped
_zygote_pid = os.getpid()

def _unshare_net(mode):
    if mode == "net":
        if _libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
    elif mode == "user":
        uid, gid = os.getuid(), os.getgid()
        if _libc.unshare(0x10000000 | 0x40000000) != 0:  # CLONE_NEWUSER | CLONE_NEWNET
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER | CLONE_NEWNET)")
        for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)

def _place(fds, targets, keep):
    """dup2 each received fd onto its target number; close every other descriptor but keep."""
    base = max([*fds, *targets, *keep]) + 1  # copies above every fd involved: no dup2 clobbers one
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD, base) for fd in fds]
    for fd, t in zip(high, targets):
        os.dup2(fd, t, inheritable=True)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = 1 << 20 if soft == resource.RLIM_INFINITY or soft > 1 << 20 else max(soft, 65536)
    last = -1
    for fd in sorted(set(targets) | set(keep)) + [top]:
        if fd > last + 1:  # an empty closerange(a, a) closes EVERY descriptor on Python 3.11
            os.closerange(last + 1, fd)
        last = fd

def _child(req, fds, prep):
    try:
        _libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL: the child ends with the zygote
        if os.getppid() != _zygote_pid:  # the zygote already died before the line above
            os._exit(1)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        keep = [prep["ruleset"]] if prep is not None and "ruleset" in prep else []
        _place(fds, req["targets"], keep)
        _unshare_net(_conf["net"])
        os.chdir(req["cwd"])
        sys.argv = ["-c", req["cfg"]] + list(req["argv"])
        g = _kinds[req["kind"]]
        g["_apply"](json.loads(req["cfg"]), prep)
        g["_main"]()
    except BaseException:
        pass
    os._exit(1)

def _prep_for(kind, cfg_text):
    cfg = json.loads(cfg_text)
    key = json.dumps([cfg.get("caps"), cfg.get("landlock"), cfg.get("seccomp"), cfg.get("read")])
    if key not in _preps:
        _preps[key] = _kinds[kind]["_prepare"](cfg)
    return _preps[key]

def _send(sock, obj, fds=()):
    data = json.dumps(obj).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)

def _serve():
    sock = socket.socket(fileno=_conf["sock"])
    wr, ww = os.pipe()
    os.set_blocking(wr, False)
    os.set_blocking(ww, False)
    signal.set_wakeup_fd(ww)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    while True:
        ready = select.select([sock, wr], [], [])[0]
        if wr in ready:
            try:
                while os.read(wr, 512):
                    pass
            except BlockingIOError:
                pass
        while True:  # reap every child that ended; report its exit code
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            _live.discard(pid)
            _send(sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if sock not in ready:
            continue
        msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 16)
        if not msg:  # the parent is gone: no child may outlive it (a sleeping one never hits its CPU limit)
            for pid in _live:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            os._exit(0)
        req = json.loads(msg)
        try:
            prep = _prep_for(req["kind"], req["cfg"])
            pid = os.fork()
        except BaseException as e:
            for fd in fds:
                os.close(fd)
            _send(sock, {"id": req["id"], "error": type(e).__name__ + ": " + str(e)})
            continue
        if pid == 0:
            _child(req, fds, prep)
        _live.add(pid)
        for fd in fds:
            os.close(fd)
        try:
            pidfd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            pidfd = None
        _send(sock, {"id": req["id"], "pid": pid}, [pidfd] if pidfd is not None else [])
        if pidfd is not None:
            os.close(pidfd)

_serve()
'''


class ForkServerError(OSError):
    """The fork server could not start a child (the caller reports ``sandbox_error``)."""


class Child:
    """A child of the zygote, seen from the parent: ``pid``, ``wait``, ``returncode``, ``kill``.

    ``returncode`` follows ``subprocess``: the exit status, or ``-N`` for signal N; it is
    None until the zygote has reaped the child. Kills go through a pidfd where the kernel
    has them (Linux >= 5.3), so a recycled pid is never signalled.
    """

    def __init__(self, pid: int, pidfd: int | None):
        self.pid, self.pidfd = pid, pidfd
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int | None) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        """Block until the zygote reports the exit; raises subprocess.TimeoutExpired."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"sandbox child {self.pid}", timeout or 0.0)
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child and its process group (it leads its own session)."""
        if self._done.is_set():
            return
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass
        if not self._done.is_set():  # still unreaped: its pid (= its group) is not recycled
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class ForkServer:
    """Parent side of the zygote: started on first use, restarted if it dies.

    Args:
        sources: kind -> child source text (the prelude plus the child's body).
        net: ``"net"`` (root: a new network namespace), ``"user"`` (a user namespace with
            it), or ``""`` (no network isolation on this host).

    Thread-safe: the rollout's tool threads spawn concurrently.
    """

    def __init__(self, sources: dict[str, str], net: str):
        self.sources, self.net = dict(sources), net
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._proc: subprocess.Popen | None = None
        self._owner = -1
        self._next = 0
        self._pending: dict[int, list] = {}
        self._children: dict[int, Child] = {}
        self._ended = threading.Event()

    # ---- lifecycle -------------------------------------------------------------------
    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conf = json.dumps({"sources": self.sources, "net": self.net, "sock": child.fileno()})
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", ZYGOTE, conf],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env={},
                cwd="/",
                start_new_session=True,
                close_fds=True,
                pass_fds=(child.fileno(),),
            )
        finally:
            child.close()
        self._sock, self._owner = parent, os.getpid()
        self._pending, self._children = {}, {}
        self._ended = threading.Event()  # this zygote's socket reached EOF: it is gone
        threading.Thread(
            target=self._read,
            args=(parent, self._pending, self._children, self._ended),
            name="sandbox-zygote",
            daemon=True,
        ).start()

    def _alive(self) -> bool:
        return (
            self._sock is not None
            and self._owner == os.getpid()
            and self._proc is not None
            and not self._ended.is_set()  # poll() can lag the zygote's death; its socket's EOF does not
            and self._proc.poll() is None
        )

    def close(self) -> None:
        """Stop the zygote (children already started keep running until killed)."""
        with self._lock:
            if self._sock is not None and self._owner == os.getpid():
                self._sock.close()
                if self._proc is not None:
                    try:
                        self._proc.kill()
                        self._proc.wait(timeout=5)
                    except (OSError, subprocess.TimeoutExpired):
                        pass
            self._sock = self._proc = None

    # ---- the reader thread -----------------------------------------------------------
    def _read(self, sock: socket.socket, pending: dict, children: dict, ended: threading.Event) -> None:
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 1)
            except OSError:
                msg, fds = b"", []
            if not msg:
                break
            obj = json.loads(msg)
            if "exit" in obj:
                child = children.pop(obj["exit"], None)
                if child is not None:
                    child._exited(obj["code"])
                continue
            slot = pending.pop(obj["id"], None)
            if slot is None:
                for fd in fds:
                    os.close(fd)
                continue
            if "pid" in obj:
                child = Child(obj["pid"], fds[0] if fds else None)
                children[child.pid] = child
                slot[1] = child
            else:
                slot[1] = ForkServerError(obj.get("error", "fork server error"))
            slot[0].set()
        # The zygote is gone: nobody will reap or report; unblock every waiter (the next spawn restarts it).
        ended.set()
        for slot in list(pending.values()):
            slot[1] = ForkServerError("the sandbox fork server ended")
            slot[0].set()
        for child in list(children.values()):
            child.kill()
            child._exited(None)

    # ---- spawning --------------------------------------------------------------------
    def spawn(
        self,
        kind: str,
        cfg: str,
        cwd: str,
        fds: Sequence[int],
        targets: Sequence[int],
        argv: Sequence[str] = (),
        timeout: float = 10.0,
    ) -> Child:
        """Fork a confined child of ``kind`` (see module docstring).

        Args:
            cfg: the prelude's JSON config (:func:`hardening.child_config`).
            cwd: the child's (existing, empty) working directory.
            fds: descriptors to give it; ``targets``: the numbers they get there (e.g.
                0, 1, 2). The caller keeps and closes its own copies.
            argv: ``sys.argv[2:]`` of the child (``sys.argv[1]`` is ``cfg``).

        Raises:
            ForkServerError: the zygote cannot be started or could not fork.
        """
        if len(fds) != len(targets):
            raise ValueError(f"{len(fds)} descriptors for {len(targets)} targets")
        with self._lock:
            if not self._alive():
                try:
                    self._start()
                except OSError as e:
                    raise ForkServerError(f"cannot start the sandbox fork server: {e}") from e
            self._next += 1
            # [set when answered, the Child or a ForkServerError]: filled by the reader thread
            slot: list[Any] = [threading.Event(), None]
            rid = self._next
            self._pending[rid] = slot
            req = {"id": rid, "kind": kind, "cfg": cfg, "cwd": cwd, "targets": list(targets), "argv": list(argv)}
            sock = self._sock
            assert sock is not None  # alive, or just started
            try:
                socket.send_fds(sock, [json.dumps(req).encode()], list(fds))
            except OSError as e:
                self._pending.pop(rid, None)
                raise ForkServerError(f"sandbox fork server unreachable: {e}") from e
        if not slot[0].wait(timeout):
            raise ForkServerError(f"sandbox fork server did not answer within {timeout:g} s")
        if isinstance(slot[1], Exception):
            raise slot[1]
        return slot[1]
