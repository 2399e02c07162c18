#!/usr/bin/env python3
"""Run a test and fail it when its peak resident memory passes a limit.

    memguard.py --limit-mib N [--name NAME] -- COMMAND [ARGS...]

The default test setup (meson.build) puts this in front of every test. The peak is the child's
ru_maxrss from wait4(): the largest resident set of the test process or of any process it waited
for (forked ranks, harness peers). Resident memory, not address space: CUDA, ASan and the emulator
map far more than they touch, so RLIMIT_AS would fail them for nothing. The test's own exit status
is passed on (77 = skipped, a signal as that signal); over the limit the test fails, whatever it
returned, with a line naming the test and its peak. A test that needs more says so in its env:
TEST_MAX_RSS_MIB=N.
"""
import os
import signal
import sys


def main(argv):
    limit = None
    name = None
    i = 1
    while i < len(argv) and argv[i] != "--":
        if argv[i] == "--limit-mib" and i + 1 < len(argv):
            limit = int(argv[i + 1])
            i += 2
        elif argv[i] == "--name" and i + 1 < len(argv):
            name = argv[i + 1]
            i += 2
        else:
            break
    if i < len(argv) and argv[i] == "--":
        i += 1
    cmd = argv[i:]
    if limit is None or not cmd:
        sys.stderr.write("usage: memguard.py --limit-mib N [--name NAME] -- COMMAND [ARGS...]\n")
        return 2
    env_limit = os.environ.get("TEST_MAX_RSS_MIB")
    if env_limit:
        try:
            limit = int(env_limit)
        except ValueError:
            sys.stderr.write("memguard: TEST_MAX_RSS_MIB=%r: expected a whole number of MiB\n" % env_limit)
            return 2
    if name is None:
        # meson does not tell a wrapper the test's name; the command says which one it is
        name = " ".join([os.path.basename(cmd[0])] + cmd[1:])
        if len(name) > 200:
            name = name[:197] + "..."

    try:
        pid = os.fork()
    except OSError as e:
        sys.stderr.write("memguard: fork: %s\n" % e)
        return 2
    if pid == 0:
        try:
            os.execvp(cmd[0], cmd)
        except OSError as e:
            sys.stderr.write("memguard: cannot run %s: %s\n" % (cmd[0], e))
        os._exit(127)

    # meson ends a test that runs past its timeout with a signal to its process group, which
    # reaches the test itself; pass on the ones sent to us alone
    def forward(sig, _frame):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    while True:
        try:
            _, status, ru = os.wait4(pid, 0)
            break
        except InterruptedError:
            continue
    peak_mib = ru.ru_maxrss / 1024.0  # Linux reports KiB

    if peak_mib > limit:
        sys.stdout.flush()
        msg = ("memguard: FAIL: test '%s' peaked at %.0f MiB resident, above the limit of %d MiB "
               "(tests/memguard.py; a test that needs more sets TEST_MAX_RSS_MIB in its env)\n"
               % (name, peak_mib, limit))
        sys.stderr.write(msg)
        sys.stderr.flush()
        return 1
    if os.environ.get("MEMGUARD_VERBOSE") == "1":
        sys.stderr.write("memguard: test '%s' peaked at %.0f MiB resident (limit %d MiB)\n"
                         % (name, peak_mib, limit))
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        return 128 + sig
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
