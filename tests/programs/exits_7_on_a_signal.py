"""A script for `zenflow launch` that handles one signal: on it, it writes the signal's number to
MARKER and exits with status 7. It prints `ready` once the handler is in place, then sleeps.

    python tests/programs/exits_7_on_a_signal.py MARKER SIGNUM
"""
import signal
import sys
import time

marker, signum = sys.argv[1], int(sys.argv[2])


def handled(number, frame):
    with open(marker, "w") as f:
        f.write(str(number))
    sys.exit(7)


signal.signal(signum, handled)
print("ready", flush=True)
time.sleep(60)
