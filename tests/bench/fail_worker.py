"""A benchmark worker whose rank 1 fails at once (launcher failure test); rank 0 blocks."""

import os
import sys
import time

if __name__ == "__main__":
    if os.environ["RANK"] == "1":
        print("fail_worker: simulated failure on rank 1", file=sys.stderr)
        sys.exit(3)
    while True:
        time.sleep(1)
