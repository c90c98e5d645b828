"""Kernel-level confinement for sandbox children: rlimits, Landlock, seccomp, no capabilities.

Every sandbox child (``sandbox.RUNNER``, ``judge.CANDIDATE`` and ``judge.JUDGE``) starts
with :data:`PRELUDE`, which confines the process BEFORE any candidate or test code is read:

1. resource limits: CPU, address space, file size, open files, processes, core dumps;
2. ``no_new_privs`` and an empty capability set (bounding, ambient, effective,
   permitted, inheritable), so a sandbox started by root is no longer privileged;
3. Landlock (Linux >= 5.13): reads only beneath the Python standard library (without
   ``site-packages`` / ``dist-packages``, so installed packages and their data, e.g.
   HumanEval's hidden tests, are unreadable) and the system's shared-library folders;
   no writes anywhere (its own empty working directory is readable only); with ABI >= 4 no TCP
   bind/connect; with ABI >= 6 no signals to, and no abstract Unix sockets of,
   processes outside the sandbox (the trainer, the judge);
4. seccomp: process creation, every call that reaches another process (ptrace, memory,
   priorities, rlimits), namespaces, mounts, kernel modules, socket creation (a named
   Unix socket is reachable through Landlock and the network namespace), and the
   file-metadata calls Landlock does not cover (chmod, chown, utime, xattrs) fail with EPERM.

Which layers this host supports is probed once (:func:`available_layers`); a layer that
was probed as working and then fails in a child aborts that child before it reads any
code, so the parent reports ``sandbox_error`` instead of running with less isolation.
Sources: landlock(7), seccomp(2), capabilities(7), Linux UAPI headers
``linux/landlock.h``, ``linux/filter.h``, ``linux/seccomp.h``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import sysconfig
import tempfile

__all__ = ["PRELUDE", "available_layers", "child_config", "read_allowlist", "layers_report"]

# The prelude is source text because it runs inside ``python -I -S -c`` before anything
# else; it imports only the standard library and keeps no state the candidate needs.
PRELUDE = r'''
import sys, os, json, resource, builtins

def _harden(cfg):
    _apply(cfg, _prepare(cfg))

def _prepare(cfg):
    """What does not depend on the process: the Landlock ruleset (an fd) and the seccomp
    program. A fork server builds it once; each child then only applies it (_apply)."""
    if not (cfg.get("caps") or cfg.get("landlock") or cfg.get("seccomp")):
        return None
    import ctypes, errno, stat
    libc = ctypes.CDLL(None, use_errno=True)
    L = ctypes.c_long
    sc = libc.syscall
    sc.restype = ctypes.c_long
    arch = os.uname().machine
    # Denied syscalls. Processes: fork vfork clone clone3 execve execveat. Other processes:
    # ptrace process_vm_readv/writev kcmp pidfd_getfd process_madvise move_pages
    # migrate_pages setpriority sched_setscheduler sched_setparam sched_setaffinity
    # ioprio_set prlimit64 (all would reach same-uid processes such as the trainer).
    # Namespaces, mounts, kernel: unshare setns mount umount2 pivot_root chroot reboot
    # kexec_load init_module finit_module delete_module bpf perf_event_open userfaultfd
    # keyctl add_key request_key io_uring_setup mount_setattr open_tree move_mount fsopen
    # fsmount. File metadata, which Landlock does not cover: chmod fchmod fchmodat
    # fchmodat2 chown fchown lchown fchownat utime utimes utimensat futimesat and the
    # xattr setters/removers (incl. setxattrat/removexattrat). Sockets: socket socketpair
    # (Landlock does not cover connect() to a named Unix socket, and the network namespace
    # does not hide the file system's: the hostile corpus reached a Unix socket the
    # trainer listened on, as it would reach /run/docker.sock; no child needs a socket).
    new = (435, 425, 442, 428, 429, 430, 432, 438, 440, 452, 463, 466)
    nr = {"x86_64": {"capset": 126, "audit": 0xC000003E, "deny": new + (
              57, 58, 56, 59, 322, 101, 310, 311, 312, 279, 256, 141, 144, 142, 203, 251, 302,
              272, 308, 165, 166, 155, 161, 169, 246, 175, 313, 176, 321, 298, 323, 250, 248,
              249, 90, 91, 268, 92, 93, 94, 260, 132, 235, 280, 261, 188, 189, 190, 197, 198,
              199, 41, 53)},
          "aarch64": {"capset": 91, "audit": 0xC00000B7, "deny": new + (
              220, 221, 281, 117, 270, 271, 272, 239, 238, 140, 119, 118, 122, 30, 261, 97,
              268, 40, 39, 41, 51, 142, 104, 105, 273, 106, 280, 241, 282, 219, 217, 218, 52,
              53, 54, 55, 88, 5, 6, 7, 14, 15, 16, 198, 199)}}.get(arch)

    def fail(what):
        e = ctypes.get_errno()
        raise OSError(e, what + ": " + os.strerror(e))

    prep = {"libc": libc, "sc": sc, "L": L, "fail": fail, "arch": arch, "nr": nr, "errno": errno}
    if cfg.get("landlock"):
        abi = sc(L(444), None, L(0), L(1))  # landlock_create_ruleset(NULL, 0, VERSION)
        if abi < 1:
            fail("landlock")
        fs = (1 << (13 if abi < 2 else 14 if abi < 3 else 15 if abi < 5 else 16)) - 1
        attr = (ctypes.c_uint64 * 3)(fs, 3 if abi >= 4 else 0, 3 if abi >= 6 else 0)
        rfd = sc(L(444), ctypes.byref(attr), L(24 if abi >= 6 else 16 if abi >= 4 else 8), L(0))
        if rfd < 0:
            fail("landlock_create_ruleset")

        class Beneath(ctypes.Structure):
            _pack_ = 1
            _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]

        file_r, dir_r = 4, 4 | 8  # READ_FILE, READ_DIR
        # No write right anywhere, and not even the working directory is readable (it is
        # empty): RLIMIT_FSIZE caps each file, not how many there are, and a candidate
        # creating 64 KiB files for its 2 s wrote 3 GB to the host's disk (hostile corpus,
        # "fill_the_disk"). The ruleset does not depend on the process, so a fork server
        # builds it once for all its children.
        for path in cfg["read"]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # listed paths that vanished are simply not allowed
            is_dir = stat.S_ISDIR(os.fstat(fd).st_mode)
            rule = Beneath(dir_r if is_dir else file_r, fd)
            ok = sc(L(445), L(rfd), L(1), ctypes.byref(rule), L(0))  # PATH_BENEATH
            os.close(fd)
            if ok != 0:
                fail("landlock_add_rule " + path)
        prep["ruleset"] = rfd
    if cfg.get("seccomp"):
        if nr is None:
            raise OSError("seccomp: unsupported architecture " + arch)

        class Ins(ctypes.Structure):
            _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8),
                        ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]

        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Ins))]

        deny = list(nr["deny"])
        head = [(0x20, 0, 0, 4), (0x15, 1, 0, nr["audit"]), (0x06, 0, 0, 0x80000000),
                (0x20, 0, 0, 0)]  # load arch; kill a foreign arch; load syscall number
        checks = ([(0x35, None, 0, 0x40000000)] if arch == "x86_64" else [])  # x32 ABI
        checks += [(0x15, None, 0, n) for n in deny]
        n = len(head) + len(checks) + 2
        prog = list(head)
        for code, _, jf, k in checks:  # jump to the final EPERM return on a match
            prog.append((code, n - 1 - len(prog) - 1, jf, k))
        prog += [(0x06, 0, 0, 0x7FFF0000), (0x06, 0, 0, 0x00050000 | errno.EPERM)]
        arr = (Ins * len(prog))(*[Ins(*i) for i in prog])
        prep["seccomp"] = (arr, Prog(len(prog), arr))  # the array must outlive the struct
    return prep

def _apply(cfg, prep):
    """Confine THIS process: resource limits, then (with ``prep`` from _prepare)
    no_new_privs, no capabilities, Landlock, seccomp, in that order."""
    for _n, _v in (("RLIMIT_CPU", (cfg["cpu"], cfg["cpu"] + 1)), ("RLIMIT_AS", (cfg["as"], cfg["as"])),
                   ("RLIMIT_FSIZE", (cfg["fsize"], cfg["fsize"])), ("RLIMIT_NOFILE", (16, 16)),
                   ("RLIMIT_NPROC", (0, 0)), ("RLIMIT_CORE", (0, 0))):
        try:
            resource.setrlimit(getattr(resource, _n), _v)
        except (ValueError, OSError, AttributeError):
            pass
    if prep is None:
        return
    import ctypes
    libc, sc, L, fail, nr = prep["libc"], prep["sc"], prep["L"], prep["fail"], prep["nr"]
    if libc.prctl(L(38), L(1), L(0), L(0), L(0)) != 0:  # PR_SET_NO_NEW_PRIVS
        fail("no_new_privs")
    if cfg.get("caps"):
        if nr is None:
            raise OSError("capabilities: unsupported architecture " + prep["arch"])
        for cap in range(64):  # PR_CAPBSET_DROP until the kernel says the cap does not exist
            if libc.prctl(L(24), L(cap), L(0), L(0), L(0)) != 0:
                if ctypes.get_errno() == prep["errno"].EINVAL:
                    break
                fail("capbset_drop")
        libc.prctl(L(47), L(4), L(0), L(0), L(0))  # PR_CAP_AMBIENT_CLEAR_ALL
        hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()
        if sc(L(nr["capset"]), ctypes.byref(hdr), ctypes.byref(data)) != 0:
            fail("capset")
    if "ruleset" in prep:
        if sc(L(446), L(prep["ruleset"]), L(0)) != 0:  # landlock_restrict_self
            fail("landlock_restrict_self")
        os.close(prep.pop("ruleset"))
    if "seccomp" in prep:
        if libc.prctl(L(22), L(2), ctypes.byref(prep["seccomp"][1]), L(0), L(0)) != 0:  # SECCOMP_MODE_FILTER
            fail("seccomp")
'''

_PROBE = (
    PRELUDE
    + r"""
cfg = json.loads(sys.argv[1])
try:
    _harden(cfg)
except OSError as e:
    print(json.dumps({"error": str(e)})); raise SystemExit(0)
seen = {}
try:
    open(cfg["secret"]).read(); seen["read_outside"] = True
except OSError:
    seen["read_outside"] = False
try:
    os.chown(cfg["secret"], 1, 1); seen["chown"] = True  # needs CAP_CHOWN
except OSError:
    seen["chown"] = False
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    seen["fork"] = True
except OSError:
    seen["fork"] = False
try:
    os.kill(os.getppid(), 0); seen["signal_parent"] = True
except OSError:
    seen["signal_parent"] = False
import math, hashlib, random, typing, collections, itertools, re, fractions
seen["stdlib"] = hashlib.md5(b"x").hexdigest()[:4] == "9dd4"
print(json.dumps(seen))
"""
)


def _has_python_tree(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return True
    return any(n.startswith("python") or n in ("site-packages", "dist-packages") for n in names)


@functools.lru_cache(maxsize=1)
def read_allowlist() -> tuple[str, ...]:
    """Paths a sandbox child may read (Landlock rules), computed once.

    The standard library's entries except ``site-packages`` / ``dist-packages`` (a rule
    covers everything beneath it, so the folder itself cannot be allowed when packages
    live inside it), the shared-library folders (``LIBDIR``, ``/usr/lib/<multiarch>``,
    ``/lib64``, ...; where such a folder holds a Python tree, only its ``*.so*`` files),
    and ``/etc/ld.so.cache``.
    """
    out: list[str] = []
    for key in ("stdlib", "platstdlib"):
        root = os.path.realpath(sysconfig.get_path(key))
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            if name not in ("site-packages", "dist-packages"):
                out.append(os.path.join(root, name))
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    libdirs = [sysconfig.get_config_var("LIBDIR") or "", f"/usr/lib/{arch}", f"/lib/{arch}", "/lib64", "/usr/lib64"]
    for d in dict.fromkeys(os.path.realpath(d) for d in libdirs if d and os.path.isdir(d)):
        if _has_python_tree(d):
            out += [os.path.join(d, n) for n in sorted(os.listdir(d)) if ".so" in n]
        else:
            out.append(d)
    if os.path.exists("/etc/ld.so.cache"):
        out.append("/etc/ld.so.cache")
    return tuple(dict.fromkeys(out))


def child_config(cpu_s: int, memory_mb: int, fsize_bytes: int, layers: dict[str, bool] | None = None) -> str:
    """JSON argument for :data:`PRELUDE`'s ``_harden``: limits plus the layers to apply.

    ``layers`` defaults to :func:`available_layers` (each key ``caps``, ``landlock``,
    ``seccomp`` -> bool).
    """
    layers = available_layers() if layers is None else layers
    cfg: dict[str, object] = {
        "cpu": int(cpu_s),
        "as": int(memory_mb) << 20,
        "fsize": int(fsize_bytes),
        **{k: bool(layers.get(k)) for k in ("caps", "landlock", "seccomp")},
    }
    if cfg["landlock"]:
        cfg["read"] = list(read_allowlist())
    return json.dumps(cfg)


def _probe(layers: dict[str, bool]) -> dict:
    with tempfile.TemporaryDirectory(prefix="sbx-probe-") as d:
        secret = os.path.join(d, "secret")
        with open(secret, "w") as f:
            f.write("x")
        cwd = os.path.join(d, "cwd")
        os.mkdir(cwd)
        cfg = json.loads(child_config(10, 1024, 1 << 20, layers))
        cfg["secret"] = secret
        try:
            out = subprocess.run(
                [sys.executable, "-I", "-S", "-c", _PROBE, json.dumps(cfg)],
                capture_output=True,
                timeout=30,
                cwd=cwd,
                env={},
            )
            return json.loads(out.stdout.decode().strip().splitlines()[-1])
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
            return {"error": f"probe failed: {type(e).__name__}"}


@functools.lru_cache(maxsize=1)
def available_layers() -> dict[str, bool]:
    """Which confinement layers work on this host, probed once per process (~0.2 s).

    Each layer is probed alone and must show its effect: ``landlock`` (a file outside
    the allowlist is unreadable), ``seccomp`` (fork fails), ``caps`` (chown of a file
    to another user fails, which root could do with CAP_CHOWN); all three
    together must still import the standard library. ``CONSEQUENCE_SANDBOX_LAYERS``
    (comma-separated subset, or ``none``) restricts the set, e.g. to debug a host.
    """
    wanted = os.environ.get("CONSEQUENCE_SANDBOX_LAYERS")
    names = ("caps", "landlock", "seccomp")
    allow = set(names) if wanted is None else {w.strip() for w in wanted.split(",")}
    ok: dict[str, bool] = {}
    for name in names:
        if name not in allow:
            ok[name] = False
            continue
        seen = _probe({name: True})
        ok[name] = (
            "error" not in seen
            and {
                "caps": seen.get("chown") is False,
                "landlock": seen.get("read_outside") is False,
                "seccomp": seen.get("fork") is False,
            }[name]
            and seen.get("stdlib") is True
        )
    if any(ok.values()) and _probe(ok).get("stdlib") is not True:
        ok = dict.fromkeys(names, False)  # together they break the interpreter: use none
    return ok


def layers_report() -> str:
    """One line naming the active confinement layers (for the run manifest)."""
    ok = available_layers()
    parts = {
        "caps": "no capabilities + no_new_privs",
        "landlock": "Landlock (reads: stdlib + shared libs only; no writes)",
        "seccomp": "seccomp (no fork/exec/ptrace/namespaces/sockets/chmod/chown/utime)",
    }
    on = [parts[k] for k in parts if ok.get(k)]
    return ", ".join(on) if on else "none (no Landlock, seccomp or capability drop on this host)"
