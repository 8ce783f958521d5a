"""tp_runtime/signal_watch.py: a signal's action runs on the watch thread, so it may take a lock the
main thread holds when the signal lands, and runs while the main thread is blocked in a system
call. Each case runs in a process of its own: the wakeup fd and the handlers are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

from tp_runtime.signal_watch import STACK_DUMP_SIGNAL

CHILD_TIMEOUT_S = 60.0  # a deadlock is a timeout


def run_child(body: str) -> str:
    script = "import os, signal, threading, time\nfrom tp_runtime.signal_watch import SignalWatch\n" + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_an_action_takes_a_lock_the_main_thread_holds_when_the_signal_lands() -> None:
    # A Python handler doing the same runs in the main thread inside the `with lock:` below and
    # deadlocks (the frontend's Event.set while its main thread waited on that Event).
    out = run_child("""
        watch = SignalWatch()
        lock = threading.Lock()
        done = threading.Event()
        def action():
            with lock:
                done.set()
        watch.on(signal.SIGUSR1, action)
        with lock:
            os.kill(os.getpid(), signal.SIGUSR1)
            spins = 0
            for _ in range(200_000):  # bytecodes run with the signal pending: a Python handler would run here
                spins += 1
            held_through = not done.is_set()
        print(held_through, done.wait(10))
    """)
    assert out == "True True"


def test_an_action_runs_while_the_main_thread_is_blocked_in_a_system_call() -> None:
    out = run_child("""
        watch = SignalWatch()
        read_end, write_end = os.pipe()
        watch.on(signal.SIGUSR1, lambda: os.write(write_end, b"x"))
        threading.Timer(0.2, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        print(os.read(read_end, 1).decode())  # returns only once the action has written
    """)
    assert out == "x"


def test_actions_are_replaced_and_a_failing_one_does_not_end_the_watch() -> None:
    out = run_child("""
        watch = SignalWatch()
        seen = []
        ran = threading.Semaphore(0)
        def failing():
            ran.release()
            raise RuntimeError("this action fails")
        watch.on(signal.SIGUSR1, failing)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ran.acquire(timeout=10)
        watch.on(signal.SIGUSR1, lambda: (seen.append("usr1"), ran.release()))
        watch.on(signal.SIGUSR2, lambda: (seen.append("usr2"), ran.release()))
        os.kill(os.getpid(), signal.SIGUSR1)
        assert ran.acquire(timeout=10)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert ran.acquire(timeout=10)
        print(",".join(seen))
    """)
    assert out == "usr1,usr2"


def test_sigusr1_writes_every_threads_stack_even_from_a_deadlocked_process() -> None:
    script = textwrap.dedent("""
        import os, sys, threading
        from tp_runtime.signal_watch import dump_stacks_on_signal
        dump_stacks_on_signal()
        lock = threading.Lock()
        def stuck_forever():
            lock.acquire()
            lock.acquire()
        threading.Thread(target=stuck_forever, name="stuck", daemon=True).start()
        print("ready", flush=True)
        threading.Event().wait()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        child.send_signal(STACK_DUMP_SIGNAL)
        assert child.stderr is not None
        deadline = threading.Timer(CHILD_TIMEOUT_S, child.kill)  # no dump: stderr ends, the loop with it
        deadline.start()
        dump = []
        for line in child.stderr:
            dump.append(line)
            if "stuck_forever" in line:
                break
        deadline.cancel()
        assert "most recent call first" in "".join(dump) and "stuck_forever" in dump[-1], dump
    finally:
        child.kill()
        child.wait()
