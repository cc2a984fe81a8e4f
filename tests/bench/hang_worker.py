"""A benchmark worker that never finishes (launcher timeout test): it starts a grandchild
``sleep`` in its own process group, writes the grandchild's PID next to the spec, then blocks."""

import os
import subprocess
import sys
import time

if __name__ == "__main__":
    spec_path = sys.argv[1]
    child = subprocess.Popen(["sleep", "600"])
    with open(os.path.join(os.path.dirname(spec_path), f"hang{os.environ['RANK']}.pid"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}\n")
    while True:
        time.sleep(1)
