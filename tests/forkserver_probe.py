"""A child for tests/test_forkserver.py, started as ``python -m forkserver_probe ACTION [ARG]``."""

import json
import os
import sys
import time

action, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "")
if action == "report":  # what a fresh `python -m` process would see, then exit ARG
    print(json.dumps({"cwd": os.getcwd(), "probe": os.environ.get("PROBE"), "argv": sys.argv[1:],
                      "path0": sys.path[0], "stdin": sys.stdin.read(), "pid": os.getpid()}))
    print("a line on stderr", file=sys.stderr)
    sys.exit(int(arg))
if action == "import":  # whether module ARG imports (and the import path it was looked for on)
    try:
        __import__(arg)
        imported = True
    except ImportError:
        imported = False
    print(json.dumps({"imported": imported, "path": sys.path}))
if action == "write":  # into the passed descriptor number ARG
    os.write(int(arg), b"through the passed descriptor")
if action == "signal":  # die of signal ARG
    os.kill(os.getpid(), int(arg))
    time.sleep(10)
if action == "sleep":
    print(os.getpid(), flush=True)
    time.sleep(float(arg))
if action == "raise":
    raise ValueError("an uncaught error")
if action == "exit-text":
    sys.exit("a message for sys.exit")
