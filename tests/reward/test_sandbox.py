"""The python tool's sandbox: each limit hit by a real child process, in each isolation this host allows.

Every test runs twice where the host has user namespaces: with them (``auto``) and without
(``off``: seccomp and blocked imports only), so the fallback is checked on hosts that have both.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from rlfleet.common.schema.reward import SandboxLimits
from rlfleet.reward import sandbox as sandbox_module
from rlfleet.reward.environments.tools import PythonTool, run_turn
from rlfleet.reward.errors import SandboxUnavailable
from rlfleet.reward.sandbox import Sandbox, namespaces_available, seccomp_available

pytestmark = pytest.mark.timeout(60)

SECRET = "s3cret-token-of-the-worker"
MODES = ["auto", "off"] if namespaces_available() else ["off"]


@pytest.fixture(params=MODES)
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    limits = SandboxLimits(cpu_s=1, wall_s=3, memory_mb=128, output_bytes=1000, namespaces=request.param)
    return Sandbox(limits)


def test_isolation_says_which_layers_are_used(sandbox: Sandbox) -> None:
    assert sandbox.isolation[-1] == "imports"
    assert ("namespaces" in sandbox.isolation) == (sandbox.limits.namespaces == "auto")
    assert ("seccomp" in sandbox.isolation) == seccomp_available()


def test_code_runs_and_its_output_comes_back(sandbox: Sandbox) -> None:
    result = sandbox.run("import math\nprint(math.factorial(10))")
    assert result.ok and result.output == "3628800\n" and result.problem() == ""


def test_an_exception_is_its_traceback_through_the_code_only(sandbox: Sandbox) -> None:
    result = sandbox.run("def f():\n    return 1 / 0\nf()")
    assert not result.ok and result.exit_code == 1 and result.problem() == "exited with status 1"
    assert 'File "<model code>", line 2, in f' in result.output and "ZeroDivisionError" in result.output
    assert "sandbox_child" not in result.output  # no frame (or path) of the server's own


def test_an_infinite_loop_is_stopped_by_the_cpu_limit(sandbox: Sandbox) -> None:
    start = time.monotonic()
    result = sandbox.run("while True:\n    pass")
    assert result.timed_out == "cpu" and time.monotonic() - start < 2.8
    assert "CPU time limit of 1 s" in result.problem()


def test_a_loop_in_native_code_is_stopped_too(sandbox: Sandbox) -> None:
    """A big-integer power never returns to the interpreter: SIGKILL at the hard limit ends it."""
    result = sandbox.run("x = 10 ** 10 ** 9")
    assert result.timed_out == "cpu", result


def test_sleeping_past_the_wall_clock_is_killed(sandbox: Sandbox) -> None:
    start = time.monotonic()
    result = sandbox.run("import time\nprint('going to sleep')\ntime.sleep(60)")
    assert result.timed_out == "wall" and 2.9 < time.monotonic() - start < 6
    assert result.output == "going to sleep\n"  # what it printed before survives
    assert "wall-clock limit of 3 s" in result.problem()


def test_a_deadline_shortens_the_wall_clock(sandbox: Sandbox) -> None:
    start = time.monotonic()
    result = sandbox.run("import time\ntime.sleep(60)", deadline=time.time() + 0.5)
    assert result.timed_out == "wall" and time.monotonic() - start < 2
    assert sandbox.run("print(1)", deadline=time.time() - 1).timed_out == "wall"  # already past: not run


def test_unbounded_allocation_is_stopped(sandbox: Sandbox) -> None:
    result = sandbox.run("chunks = []\nwhile True:\n    chunks.append(bytearray(10_000_000))")
    assert result.memory_exceeded and "memory limit of 128 MiB" in result.problem()


def test_opening_a_socket_is_refused(sandbox: Sandbox) -> None:
    code = "import socket\ns = socket.create_connection(('127.0.0.1', 4222), timeout=1)\nprint('connected')"
    result = sandbox.run(code)
    assert result.network_refused and "connected" not in result.output
    assert "network access is refused" in result.problem()
    assert sandbox.run("import urllib.request").network_refused  # anything over socket is refused too


def test_a_socket_is_refused_even_past_the_import_blocks(sandbox: Sandbox) -> None:
    """Code that removes the import blocks and loads the socket extension by hand meets the kernel's
    refusal: the seccomp filter (EACCES), or in a network namespace no route to anywhere."""
    if sandbox.isolation == ("imports",):
        pytest.skip("neither seccomp nor namespaces on this host")
    code = (
        "import sys, glob, importlib.machinery, importlib.util\n"
        "sys.meta_path.pop(0)\n"
        "path = glob.glob(sys.base_prefix + '/lib/python3*/lib-dynload/_socket*')[0]\n"
        "loader = importlib.machinery.ExtensionFileLoader('_socket', path)\n"
        "module = importlib.util.module_from_spec(importlib.util.spec_from_loader('_socket', loader))\n"
        "loader.exec_module(module)\n"
        "s = module.socket(module.AF_INET, module.SOCK_STREAM)\n"
        "s.settimeout(1)\n"
        "s.connect(('1.1.1.1', 80))\n"
        "print('connected')"
    )
    result = sandbox.run(code)
    assert not result.ok and "connected" not in result.output
    assert "PermissionError" in result.output or "OSError" in result.output, result.output


def test_the_workers_environment_is_not_readable(sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLFLEET_TEST_SECRET", SECRET)
    result = sandbox.run("import os\nprint(sorted(os.environ))\nprint(os.environ.get('RLFLEET_TEST_SECRET'))")
    assert result.ok, result
    assert SECRET not in result.output
    assert result.output.splitlines() in (
        ["[]", "None"],
        ["['LC_CTYPE']", "None"],
    )  # Python's C-locale coercion


def test_in_namespaces_no_other_process_is_visible() -> None:
    """A process started with a secret in its environment (as a worker is, with its tokens) cannot be
    found: the sandbox's /proc shows its own two processes only."""
    if not namespaces_available():
        pytest.skip("no namespaces on this host")
    holder = subprocess.Popen(["sleep", "30"], env={"RLFLEET_TEST_SECRET": SECRET})
    try:
        code = (
            "import os\n"
            "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
            "print(pids)\n"
            "for pid in pids:\n"
            "    print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        )
        result = Sandbox(SandboxLimits(namespaces="required")).run(code)
    finally:
        holder.kill()
        holder.wait()
    assert result.ok, result
    assert result.output.splitlines()[0] == "[1, 2]"  # the supervisor and the code: nothing else
    assert SECRET not in result.output


@pytest.fixture
def python_for_nobody(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Where this Python lives where uid 65534 cannot read it (a root user's home), the system's
    ``python3`` stands in for it (the sandbox's child needs the standard library only)."""
    if os.geteuid() != 0:
        pytest.skip("not root: the code runs as the worker's user")
    probes = (
        sandbox_module.nobody_can_run,
        sandbox_module._namespace_probe,
        sandbox_module.seccomp_available,
    )
    if not sandbox_module.nobody_can_run():
        system = shutil.which("python3", path="/usr/bin:/bin")
        if system is None:
            pytest.skip("uid 65534 cannot run this Python and there is no system python3")
        monkeypatch.setattr(sys, "executable", system)
        for probe in probes:
            probe.cache_clear()
    yield
    for probe in probes:
        probe.cache_clear()


def test_a_root_worker_runs_the_code_as_nobody(python_for_nobody: None) -> None:
    if not sandbox_module.nobody_can_run():
        pytest.skip("uid 65534 cannot run any Python here")
    for mode in ("auto", "off"):
        box = Sandbox(SandboxLimits(namespaces=mode))  # type: ignore[arg-type]
        assert "nobody" in box.isolation
        if mode == "auto" and sandbox_module.namespaces_available():
            assert box.isolation[0] == "namespaces" and "--user" not in (
                sandbox_module.namespaces_available() or ()
            )
        code = (
            "import os\nprint(os.getuid(), os.getgid(), os.getgroups())\nopen('written', 'w').write('x')\n"
            "try:\n    open('/etc/shadow').read()\nexcept OSError as exc:\n    print(type(exc).__name__)\n"
        )
        result = box.run(code)
        assert result.ok and result.output == "65534 65534 []\nPermissionError\n", result


def test_an_output_flood_is_cut_and_said(sandbox: Sandbox) -> None:
    result = sandbox.run("print('x' * 100_000)")
    assert result.output_truncated and len(result.output) == 1000 and result.output_bytes == 100_001
    assert "output truncated: 100001 bytes written, the first 1000 kept" in result.problem()


def test_the_working_directory_is_fresh_and_removed(sandbox: Sandbox) -> None:
    first = sandbox.run("import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd())")
    assert first.ok
    workdir = first.output.strip()
    assert not os.path.exists(workdir)
    second = sandbox.run("import os\nprint(os.listdir('.'))")
    assert second.output == "[]\n"


def test_limits_hit_become_the_python_tools_error_observation() -> None:
    tool = PythonTool(SandboxLimits(cpu_s=1, wall_s=3, namespaces="off"))
    action = (
        '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
        '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>'
    )
    turn = run_turn(action, {"python": tool}, max_calls=4)
    assert (turn.tool_calls, turn.tool_errors) == (2, 1)
    first, second = turn.text.split("\n\n")
    assert first == "[1] 42"
    assert second == "[2] tool error: python: timed out: the CPU time limit of 1 s was reached"


def test_required_namespaces_refuse_to_start_where_there_are_none(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlfleet.reward import sandbox as module

    monkeypatch.setattr(module, "_namespace_probe", lambda: (None, "unshare: Operation not permitted"))
    with pytest.raises(SandboxUnavailable, match="Operation not permitted.*namespaces: auto"):
        Sandbox(SandboxLimits(namespaces="required"))
