#!/usr/bin/env python3
"""tests/memguard.py, the default test setup's wrapper, fails a test above its memory limit:
a process touching 96 MiB against limits of 48 and 512 MiB, the peak of a forked grandchild,
the TEST_MAX_RSS_MIB override, and the exit status (77 = skipped, a signal) passed on."""
import os
import signal
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GUARD = os.path.join(HERE, "memguard.py")
TOUCH = "b = b'x' * (96 << 20); import sys; sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)"
# the 96 MiB are touched by a grandchild the child waits for
FORKED = ("import os, sys\n"
          "pid = os.fork()\n"
          "if pid == 0:\n"
          "    b = b'x' * (96 << 20)\n"
          "    os._exit(0)\n"
          "os.waitpid(pid, 0)\n")

failures = []


def run(limit, code, *args, env=None):
    e = dict(os.environ)
    e.pop("TEST_MAX_RSS_MIB", None)
    if env:
        e.update(env)
    p = subprocess.run([sys.executable, GUARD, "--limit-mib", str(limit), "--", sys.executable, "-c", code] + list(args),
                       env=e, capture_output=True, text=True)
    return p.returncode, p.stderr


def expect(what, cond, detail):
    print(("ok   " if cond else "FAIL ") + what + ("" if cond else ": " + detail))
    if not cond:
        failures.append(what)


rc, err = run(48, TOUCH)
expect("96 MiB against a 48 MiB limit fails", rc == 1, "rc %d" % rc)
expect("the message names the test, its peak and the limit",
       "memguard: FAIL: test 'python" in err and "peaked at" in err and "above the limit of 48 MiB" in err, err)
peak = int(err.split("peaked at ")[1].split(" ")[0]) if "peaked at " in err else 0
expect("the peak reported is at least the 96 MiB touched", peak >= 96, "peak %d MiB" % peak)

rc, err = run(512, TOUCH)
expect("96 MiB under a 512 MiB limit passes", rc == 0, "rc %d, %s" % (rc, err))

rc, err = run(512, TOUCH, "77")
expect("a skip (77) is passed on", rc == 77, "rc %d" % rc)
rc, err = run(48, TOUCH, "77")
expect("a skipped test above the limit fails", rc == 1, "rc %d" % rc)

rc, err = run(48, FORKED)
expect("a grandchild's peak counts", rc == 1 and "above the limit" in err, "rc %d, %s" % (rc, err))

rc, err = run(48, TOUCH, env={"TEST_MAX_RSS_MIB": "512"})
expect("TEST_MAX_RSS_MIB raises a test's limit", rc == 0, "rc %d, %s" % (rc, err))

rc, err = run(512, "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
expect("a test killed by a signal is reported as killed by it", rc == -signal.SIGSEGV, "rc %d" % rc)

rc, err = run(512, "import sys; sys.exit(3)")
expect("a failing test's status is passed on", rc == 3, "rc %d" % rc)

sys.exit(1 if failures else 0)
