"""What runs inside the sandbox (:mod:`rlfleet.reward.sandbox`): a supervisor and the model's code.

Run as a script, ``python -I -S -u sandbox_child.py SETTINGS CODE_FILE STATUS_FD``, in an empty
environment and a temporary directory, so it imports the standard library only (nothing of
rlfleet). It forks: the child sets its limits, installs the network blocks and runs the code; the
supervisor waits for it and writes one JSON line to ``STATUS_FD`` (a pipe the model's code never
holds): how the child ended and the CPU seconds it used. The supervisor exists because a death
signal does not survive ``unshare --fork`` (it exits 1), and because only a process outside the
code's reach can say truthfully that the CPU limit was hit. Inside a pid namespace the supervisor is
its init: when it exits the kernel kills whatever the code left behind.

The child, before the code runs:

- rlimits: CPU (``cpu_s``; SIGXCPU ends it with :data:`EXIT_CPU`, SIGKILL a second later), address
  space, file size, no core files, few open files;
- a seccomp filter (x86-64 and aarch64) that fails ``socket``, ``io_uring_setup``, ``ptrace``,
  ``process_vm_readv``/``writev`` and the signal-sending calls with EACCES, and every call of a
  foreign ABI (x32, i386): kernel-enforced, inherited, irrevocable;
- for a worker running as root (where nobody can run the interpreter), uid and gid 65534 (nobody)
  and no supplementary groups;
- blocked imports: the network modules (``socket``, ``ssl``, ``select``) and the ways to native
  code or new processes (``ctypes``, ``subprocess``, ``multiprocessing``) cannot be imported, and
  ``os`` loses its process functions. This layer is what turns an attempt into a clear message
  (:data:`EXIT_NETWORK`); determined code can undo it, which is why the seccomp filter and the
  namespaces sit under it.

A ``MemoryError`` the code does not catch ends it with :data:`EXIT_MEMORY`; any other uncaught
exception prints its traceback (the code's frames only) and exits 1.
"""

from __future__ import annotations

import json
import linecache
import os
import resource
import signal
import struct
import sys
import traceback
from typing import Any

EXIT_MEMORY = 90
EXIT_NETWORK = 91
EXIT_CPU = 92
EXIT_SETUP = 93
CODE_NAME = "<model code>"

NETWORK_MODULES = frozenset({"socket", "_socket", "ssl", "_ssl", "select", "selectors"})
PROCESS_MODULES = frozenset(
    {"ctypes", "_ctypes", "subprocess", "_posixsubprocess", "multiprocessing", "_multiprocessing", "pty"}
)
PROCESS_FUNCTIONS = (
    "system", "popen", "fork", "forkpty", "register_at_fork", "kill", "killpg", "pidfd_open",
    "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
    "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    "posix_spawn", "posix_spawnp",
)  # fmt: skip

# seccomp: (AUDIT_ARCH, syscall numbers refused) per machine.
SECCOMP_ARCHES = {
    # socket, ptrace, kill, tkill, tgkill, process_vm_readv/writev, io_uring_setup, pidfd_send_signal,
    # pidfd_open, pidfd_getfd
    "x86_64": (0xC000003E, (41, 101, 62, 200, 234, 310, 311, 425, 424, 434, 438)),
    "aarch64": (0xC00000B7, (198, 117, 129, 130, 131, 270, 271, 425, 424, 434, 438)),
}
X32_BIT = 0x40000000
EACCES = 13


class NetworkRefused(ImportError):
    """An import of a network module, refused: uncaught, it ends the run with :data:`EXIT_NETWORK`."""


class _BlockedImports:
    """A ``sys.meta_path`` finder that refuses the network and process modules by name."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        root = name.partition(".")[0]
        if root in NETWORK_MODULES:
            raise NetworkRefused(f"sandbox: network access is refused (import of {name!r})")
        if root in PROCESS_MODULES:
            raise ImportError(f"sandbox: native code and new processes are refused (import of {name!r})")


def seccomp_program(machine: str) -> bytes | None:
    """The BPF program of the filter for ``machine`` (``os.uname().machine``); None: not supported."""
    if machine not in SECCOMP_ARCHES:
        return None
    arch, refused = SECCOMP_ARCHES[machine]
    ld_abs, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny = 0x7FFF0000, 0x00050000 | EACCES  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EACCES
    n = len(refused)
    ops = [
        (ld_abs, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, arch),
        (ret, 0, 0, deny),  # another ABI (i386 through int 0x80): refused outright
        (ld_abs, 0, 0, 0),  # seccomp_data.nr
        (jge, n + 1, 0, X32_BIT),  # x32 numbers: to the deny below
        *[(jeq, n - i, 0, nr) for i, nr in enumerate(refused)],
        (ret, 0, 0, allow),
        (ret, 0, 0, deny),
    ]
    return b"".join(struct.pack("HBBI", code, jt, jf, k) for code, jt, jf, k in ops)


def install_seccomp() -> str:
    """Install the filter on this process (and what it starts); '' when done, else why not."""
    program = seccomp_program(os.uname().machine)
    if program is None:
        return f"no seccomp filter for {os.uname().machine}"
    import ctypes  # before the import blocks: the filter is the one use of it

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(program, len(program))
    prog = Program(len(program) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    pr_set_no_new_privs, pr_set_seccomp, seccomp_mode_filter = 38, 22, 2
    if libc.prctl(pr_set_no_new_privs, 1, 0, 0, 0) != 0:
        return f"prctl(PR_SET_NO_NEW_PRIVS) failed: errno {ctypes.get_errno()}"
    if libc.prctl(pr_set_seccomp, seccomp_mode_filter, ctypes.byref(prog), 0, 0) != 0:
        return f"prctl(PR_SET_SECCOMP) failed: errno {ctypes.get_errno()}"
    return ""


def block_imports() -> None:
    """Make the network and process modules unimportable and strip ``os`` of its process functions."""
    for name in list(sys.modules):
        if name.partition(".")[0] in NETWORK_MODULES | PROCESS_MODULES:
            del sys.modules[name]
    sys.meta_path.insert(0, _BlockedImports())  # type: ignore[arg-type]
    import posix

    for module in (os, posix):
        for name in PROCESS_FUNCTIONS:
            if hasattr(module, name):
                delattr(module, name)


def set_limits(settings: dict[str, Any]) -> None:
    cpu = int(settings["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (settings["memory_bytes"], settings["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (settings["file_bytes"], settings["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def print_traceback(exc: BaseException) -> None:
    """The traceback of ``exc`` through the model's code only (no frame of this file or the library)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == CODE_NAME]
    text = "".join(traceback.format_list(frames)) + "".join(traceback.format_exception_only(type(exc), exc))
    sys.stderr.write("Traceback (most recent call last):\n" + text)


def run_code(settings: dict[str, Any], path: str) -> None:
    """The child: limits, blocks, then the code; never returns."""
    signal.signal(signal.SIGXCPU, lambda *_: os._exit(EXIT_CPU))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past file_bytes fails (EFBIG) instead
    with open(path, encoding="utf-8") as file:
        source = file.read()
    os.unlink(path)
    set_limits(settings)
    if settings["seccomp"]:
        failed = install_seccomp()
        if failed:
            os.write(2, f"sandbox: {failed}\n".encode())
            os._exit(EXIT_SETUP)
    if settings["uid"] is not None:  # a root worker's code runs as nobody (the limits above stay: hard)
        os.setgroups([])
        os.setgid(settings["uid"])
        os.setuid(settings["uid"])
    block_imports()
    linecache.cache[CODE_NAME] = (
        len(source),
        None,
        source.splitlines(True),
        CODE_NAME,
    )  # tracebacks quote it
    try:
        exec(compile(source, CODE_NAME, "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except MemoryError:
        os.write(2, b"MemoryError: the sandbox's memory limit was reached\n")
        os._exit(EXIT_MEMORY)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, int | None):
            print(exc.code, file=sys.stderr)
        os._exit(code)
    except BaseException as exc:  # noqa: BLE001 - the code's own failure: its traceback is the output
        print_traceback(exc)
        os._exit(EXIT_NETWORK if isinstance(exc, NetworkRefused) else 1)
    os._exit(0)


def probe() -> None:
    """``sandbox_child.py --probe``: say whether the seccomp filter installs here (and refuses a socket)."""
    failed = install_seccomp()
    if not failed:
        import _socket

        try:
            _socket.socket()
            failed = "the filter did not refuse socket()"
        except OSError:
            pass
    print(json.dumps({"seccomp": not failed, "reason": failed}))


def main() -> None:
    if sys.argv[1:] == ["--probe"]:
        probe()
        return
    settings, path, status_fd = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    pid = os.fork()
    if pid == 0:
        os.close(status_fd)
        run_code(settings, path)
    _, status, usage = os.wait4(pid, 0)
    exit_code = os.waitstatus_to_exitcode(status)
    report = {"exit": exit_code, "cpu_s": usage.ru_utime + usage.ru_stime}
    os.write(status_fd, json.dumps(report).encode() + b"\n")
    os._exit(0)


if __name__ == "__main__":
    main()
