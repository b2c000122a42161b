"""Ctrl-C at a terminal (``training.stop``): each press is told apart from a copy of the same press
(torchrun forwards the terminal's SIGINT to workers that already got it), the second press says the
save goes on, the third ends the process at once (exit 130) saying what is lost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from megatron_ext.exit_codes import INTERRUPTED_EXIT_CODE

SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from megatron_ext.training.stop import StopPolicy
    stop = StopPolicy(handle_signals=True, duration_minutes=None, interval=None)
    with stop.signals_handled():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # the same press, forwarded
        time.sleep(0.2)
        print("reason", stop.reason_to_stop(1, __import__("torch").device("cpu")), flush=True)
        time.sleep(1.2)
        os.kill(os.getpid(), signal.SIGINT)  # the loop's closing save runs in the block
        time.sleep(0.2)
        print("received", stop.received, flush=True)
        time.sleep(1.2)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    print("not reached", flush=True)
""")

AFTER = textwrap.dedent("""
    import os, signal, time
    from megatron_ext.training.stop import StopPolicy
    stop = StopPolicy(handle_signals=True, duration_minutes=None, interval=None)
    with stop.signals_handled():
        os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # the checkpoint is complete: the exit goes on
    time.sleep(0.2)
    print("exited normally", flush=True)
""")


def test_three_ctrl_c_presses_stop_then_reassure_then_abort():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == INTERRUPTED_EXIT_CODE, run.stderr
    assert "reason signal SIGINT" in run.stdout
    assert "received ['SIGINT', 'SIGINT', 'SIGINT']" in run.stdout
    assert "not reached" not in run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 3, run.stderr  # one line per press, none for the forwarded copy
    assert lines[0].startswith("Ctrl-C: finishing the step in flight, then saving a checkpoint")
    assert lines[1].startswith("Ctrl-C again: still finishing the step and its checkpoint")
    assert lines[2].startswith("Ctrl-C a third time: stopped at once; the checkpoint being written")
    assert "Traceback" not in run.stderr


def test_ctrl_c_after_the_closing_save_does_not_turn_the_exit_into_a_kill():
    run = subprocess.run([sys.executable, "-c", AFTER], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "exited normally" in run.stdout, run.stderr


def test_a_tool_interrupted_by_ctrl_c_says_so_in_one_line(capsys):
    """Every tool's entry point: Ctrl-C is one line and exit 130, not a traceback."""
    from megatron_ext.cli.entry import entry_point

    @entry_point("some_tool.py")
    def main(argv=None) -> int:
        raise KeyboardInterrupt

    assert main([]) == INTERRUPTED_EXIT_CODE
    err = capsys.readouterr().err
    assert err.splitlines() == ["some_tool.py: interrupted (Ctrl-C); outputs finished before it are kept, none is "
                                "half-written"]


READY = textwrap.dedent("""
    import os
    from megatron_ext.training.stop import StopPolicy
    stop = StopPolicy(handle_signals=HANDLE, duration_minutes=None, interval=None)
    marker = os.environ["MEGATRON_EXT_EXIT_STATUS_FILE"] + ".stop-handlers"
    print("before", os.path.exists(marker), flush=True)
    with stop.signals_handled():
        print("inside", os.path.exists(marker), flush=True)
""")


def test_rank_0_says_when_its_stop_handlers_are_installed(tmp_path):
    """``slurm.sbatch`` passes its batch shell's signals on only once this file exists
    (``exit_codes.STOP_HANDLERS_SUFFIX``): rank 0 creates it as the handlers are installed, other
    ranks and a run without the handlers (``training.exit_signal_handler: false``) never do."""
    from megatron_ext.exit_codes import EXIT_STATUS_ENV, STOP_HANDLERS_SUFFIX

    status = tmp_path / ".exit-status-7"
    for handle, rank, created in [(True, "0", True), (True, "1", False), (False, "0", False)]:
        env = {**os.environ, EXIT_STATUS_ENV: str(status), "RANK": rank}
        run = subprocess.run([sys.executable, "-c", READY.replace("HANDLE", str(handle))], env=env,
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.split() == ["before", "False", "inside", str(created)], (handle, rank, run.stdout)
        assert (tmp_path / (status.name + STOP_HANDLERS_SUFFIX)).exists() == created
        (tmp_path / (status.name + STOP_HANDLERS_SUFFIX)).unlink(missing_ok=True)
