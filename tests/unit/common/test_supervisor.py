"""The shared process supervisor (kvtier.common.supervisor) on real `python -c` children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.common.supervisor import ChildExited, ChildNotReady, Supervisor, stop_all

pytestmark = pytest.mark.timeout(60)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


# A child that writes its ready file (JSON, as the servers do), then serves until SIGTERM, which it
# handles by logging a line and exiting 0.
SERVER = """
    import json, os, signal, sys, time
    def bye(*_):
        print("stopping cleanly", flush=True)
        sys.exit(0)
    signal.signal(signal.SIGTERM, bye)
    # Python keeps SIGINT ignored when it starts ignored (a suite run from a background shell job):
    # Ctrl-C's default behaviour, whatever was inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print("starting", flush=True)
    with open(sys.argv[1] + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "address": "127.0.0.1:1"}, f)
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    print("serving on 127.0.0.1:1", flush=True)
    while True:
        time.sleep(0.05)
"""


def test_start_waits_for_the_ready_file_and_reads_its_json(tmp_path: Path):
    ready = tmp_path / "srv.ready"
    with Supervisor(tmp_path) as sup:
        child = sup.start("srv", [*python(SERVER), str(ready)], ready_file=ready)
        assert child.alive and child.info == {"pid": child.pid, "address": "127.0.0.1:1"}
        assert sup.children["srv"] is child
        assert child.log == tmp_path / "srv.log"
    assert child.returncode == 0, "close() stops it with SIGTERM: its handler ran"
    assert "stopping cleanly" in child.tail()


def test_start_waits_for_a_log_line(tmp_path: Path):
    with Supervisor(tmp_path) as sup:
        child = sup.start("srv", [*python(SERVER), str(tmp_path / "r")], ready_line=r"serving on \S+")
        assert "serving on 127.0.0.1:1" in child.tail()


def test_start_waits_for_a_probe(tmp_path: Path):
    flag = tmp_path / "flag"
    calls = []

    def probe() -> bool:
        calls.append(1)
        return flag.exists()

    code = f"import pathlib, time; time.sleep(0.3); pathlib.Path({str(flag)!r}).touch(); time.sleep(60)"
    with Supervisor(tmp_path) as sup:
        sup.start("srv", python(code), probe=probe, poll_s=0.01)
        assert flag.exists() and len(calls) > 1, "probed until the child answered"


def test_a_child_that_exits_before_ready_reports_its_status_and_log_tail(tmp_path: Path):
    code = "import sys; print('cannot listen on 127.0.0.1:1: address already in use', file=sys.stderr); sys.exit(2)"
    with Supervisor(tmp_path) as sup:
        with pytest.raises(ChildExited) as info:
            sup.start("bad", python(code), ready_file=tmp_path / "bad.ready")
    assert info.value.returncode == 2 and info.value.name == "bad"
    assert "bad exited with 2 before ready" in str(info.value)
    assert "address already in use" in str(info.value), "stderr goes to the log, its tail to the error"
    assert isinstance(info.value, RuntimeError)


def test_a_child_not_ready_in_time_is_killed(tmp_path: Path):
    with Supervisor(tmp_path) as sup:
        with pytest.raises(ChildNotReady) as info:
            sup.start("slow", python("import time; time.sleep(60)"), ready_file=tmp_path / "x", timeout=0.3)
        child = sup.children["slow"]
    assert child.returncode == -signal.SIGKILL and "not ready after" in str(info.value)


def test_a_ready_file_left_from_a_previous_run_is_not_taken_for_readiness(tmp_path: Path):
    ready = tmp_path / "srv.ready"
    ready.write_text(json.dumps({"stale": True}))
    with Supervisor(tmp_path) as sup:
        child = sup.start("srv", [*python(SERVER), str(ready)], ready_file=ready)
        assert "stale" not in child.info


def test_stop_sends_sigterm_then_sigkill_after_the_grace(tmp_path: Path):
    stubborn = """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: print("ignoring SIGTERM", flush=True))
        print("up", flush=True)
        while True:
            time.sleep(0.05)
    """
    with Supervisor(tmp_path) as sup:
        child = sup.start("stubborn", python(stubborn), ready_line="up")
        sup.stop(child, grace_s=0.5)
        assert child.returncode == -signal.SIGKILL
        assert "ignoring SIGTERM" in child.tail(), "SIGTERM came first"


def test_a_paused_child_still_stops_gracefully(tmp_path: Path):
    ready = tmp_path / "srv.ready"
    with Supervisor(tmp_path) as sup:
        child = sup.start("srv", [*python(SERVER), str(ready)], ready_file=ready)
        child.pause()
        with open(f"/proc/{child.pid}/stat") as f:
            assert f.read().rpartition(")")[2].split()[0] in ("T", "t")
        child.stop(grace_s=20)
    assert child.returncode == 0, "SIGCONT after SIGTERM: it ran its handler instead of being killed"


def test_kill_with_a_chosen_signal_and_resume(tmp_path: Path):
    ready = tmp_path / "srv.ready"
    with Supervisor(tmp_path) as sup:
        child = sup.start("srv", [*python(SERVER), str(ready)], ready_file=ready)
        child.pause()
        child.resume()
        assert child.alive
        assert child.kill(signal.SIGINT) != 0  # no handler of its own: KeyboardInterrupt, it dies
        other = sup.start("srv", [*python(SERVER), str(ready)], ready_file=ready)
        assert other.kill() == -signal.SIGKILL
        child.send(signal.SIGTERM)  # already reaped: nothing is sent to a pid that may be reused


def test_restart_under_the_same_name_and_report(tmp_path: Path):
    ready = tmp_path / "srv.ready"
    with Supervisor(tmp_path) as sup:
        first = sup.start("srv", [*python(SERVER), str(ready)], ready_file=ready)
        first.kill()
        second = sup.start("srv", [*python(SERVER), str(ready)], ready_file=ready)
        assert sup.children == {"srv": second} and second.pid != first.pid
        report = sup.report()
        assert report.startswith("----- srv (rc=None) -----") and "serving on" in report
        sup.stop(second)
        assert "----- srv (rc=0) -----" in sup.report()


def test_start_retrying_outlasts_a_failure(tmp_path: Path):
    marker = tmp_path / "tried"
    # Fails the first time (as a port lingering after a kill would), serves the second.
    code = f"""
        import pathlib, sys, time
        m = pathlib.Path({str(marker)!r})
        if not m.exists():
            m.touch()
            sys.exit(2)
        print("serving", flush=True)
        time.sleep(60)
    """
    with Supervisor(tmp_path) as sup:
        child = sup.start_retrying("srv", python(code), retry_s=20, gap_s=0.01, ready_line="serving")
        assert child.alive
    with Supervisor(tmp_path) as sup:
        with pytest.raises(ChildExited):
            sup.start_retrying("never", python("raise SystemExit(3)"), retry_s=0.2, gap_s=0.01, ready_line="x")


def test_env_cwd_and_quiet_output(tmp_path: Path, capfd):
    code = "import os, time; print('env=' + os.environ['KVTIER_TEST_X'], os.getcwd(), flush=True); time.sleep(60)"
    (tmp_path / "sub").mkdir()
    with Supervisor(tmp_path) as sup:
        child = sup.start("srv", python(code), env={"KVTIER_TEST_X": "42"}, cwd=tmp_path / "sub", ready_line="env=42")
        assert child.tail() == f"env=42 {tmp_path / 'sub'}"
        quiet = sup.start("quiet", python("print('hidden', flush=True)"), log=None, quiet=True)
        quiet.popen.wait()
        assert quiet.tail() == "(no log)" and quiet.returncode == 0
    assert "hidden" not in capfd.readouterr().out


def test_children_run_in_a_session_of_their_own(tmp_path: Path):
    """A Ctrl-C at the terminal reaches the parent only; it stops its children in its own order."""
    with Supervisor(tmp_path) as sup:
        child = sup.start("srv", python("import time; print('up', flush=True); time.sleep(60)"), ready_line="up")
        assert os.getsid(child.pid) == child.pid != os.getsid(0)


def test_stop_all_stops_several_at_once(tmp_path: Path):
    ready = [tmp_path / f"s{i}.ready" for i in range(3)]
    with Supervisor(tmp_path) as sup:
        children = [sup.start(f"s{i}", [*python(SERVER), str(r)], ready_file=r) for i, r in enumerate(ready)]
        stop_all(children, grace_s=20)
        assert [c.returncode for c in children] == [0, 0, 0]


def test_an_unclosed_supervisor_stops_its_children_at_interpreter_exit(tmp_path: Path):
    """The parent exits without closing the supervisor (a crash in its own code): no child survives."""
    pid_file = tmp_path / "pid"
    parent = f"""
        import sys, pathlib
        from kvtier.common.supervisor import Supervisor
        sup = Supervisor(pathlib.Path({str(tmp_path)!r}))
        child = sup.start("orphan", [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                          ready_line="up")
        pathlib.Path({str(pid_file)!r}).write_text(str(child.pid))
        raise RuntimeError("the parent's own bug")
    """
    result = subprocess.run(python(parent), capture_output=True, text=True, timeout=50)
    assert result.returncode == 1 and "the parent's own bug" in result.stderr
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # stopped and reaped by the parent before it exited
        os.kill(pid, 0)
