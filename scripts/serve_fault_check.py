#!/usr/bin/env python
"""Stop or kill one rank of a two-rank expert-parallel server and report how fast it is seen.

    python scripts/serve_fault_check.py --load CKPT [--faults SIGSTOP,SIGKILL] [--repeats 3] [--json out.json]

For each fault and repeat: a fresh ``torchrun`` server (EP = 2, loopback), one request in flight,
the signal to rank 1; then the seconds until /health stops answering 200, until the waiting
client gets its answer, and until the launcher exits (tools/serve_bench/faults.py). Prints a
table (medians and ranges over the repeats) and writes JSON. docs/serving.md reports its output.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from megatron.common.cli import positive_float, positive_int, run_cli
    from megatron.common.files import write_json
    from tools.serve_bench.faults import FAULTS, inject

    def body():
        p = argparse.ArgumentParser(prog="serve_fault_check.py", description=__doc__.split("\n\n")[0])
        p.add_argument("--load", required=True, metavar="CKPT")
        p.add_argument("--faults", default="SIGSTOP,SIGKILL")
        p.add_argument("--repeats", type=positive_int, default=3)
        p.add_argument("--stall-timeout", type=positive_float, default=2.0)
        p.add_argument("--watchdog-timeout", type=positive_float, default=5.0)
        p.add_argument("--torchrun-shutdown-timeout", type=positive_int, default=5)
        p.add_argument("--json", metavar="PATH")
        args = p.parse_args(argv)
        faults = [f.strip() for f in args.faults.split(",") if f.strip()]
        bad = [f for f in faults if f not in FAULTS]
        if bad or not faults:
            raise ValueError(f"--faults: choose from {', '.join(FAULTS)} (got {args.faults})")
        if not os.path.isdir(args.load):
            raise ValueError(f"--load {args.load}: no such directory")
        runs = []
        with tempfile.TemporaryDirectory(prefix="serve-faults-") as work:
            for fault in faults:
                for _ in range(args.repeats):
                    r = inject(os.path.abspath(args.load), fault, work, stall_timeout=args.stall_timeout,
                               watchdog_timeout=args.watchdog_timeout,
                               torchrun_shutdown_timeout=args.torchrun_shutdown_timeout)
                    runs.append(r.as_dict())
                    print(f"{fault}: health {r.health_not_ok_s}, client {r.client_status} at {r.client_answer_s}, "
                          f"launcher exit {r.launcher_code} at {r.launcher_exit_s}", flush=True)
        rows = []
        print(f"\n{'fault':8} {'/health not 200 (s)':>22} {'client answered (s)':>22} {'launcher exit (s)':>20} "
              f"{'status':>7} {'exit':>5}")
        for fault in faults:
            mine = [r for r in runs if r["fault"] == fault]

            def span(key):
                vals = [r[key] for r in mine if r[key] is not None]
                if len(vals) < len(mine):
                    return None, "missing"
                return statistics.median(vals), f"{statistics.median(vals):.2f} [{min(vals):.2f}, {max(vals):.2f}]"

            cells = {k: span(k) for k in ("health_not_ok_s", "client_answer_s", "launcher_exit_s")}
            statuses = sorted({str(r["client_status"]) for r in mine})
            codes = sorted({str(r["launcher_code"]) for r in mine})
            rows.append({"fault": fault, **{k: v[0] for k, v in cells.items()}, "client_status": statuses,
                         "launcher_code": codes})
            print(f"{fault:8} {cells['health_not_ok_s'][1]:>22} {cells['client_answer_s'][1]:>22} "
                  f"{cells['launcher_exit_s'][1]:>20} {','.join(statuses):>7} {','.join(codes):>5}")
        if args.json:
            write_json(args.json, {"command": " ".join(["scripts/serve_fault_check.py"] + list(argv or sys.argv[1:])),
                                   "stall_timeout_s": args.stall_timeout, "watchdog_timeout_s": args.watchdog_timeout,
                                   "torchrun_shutdown_timeout_s": args.torchrun_shutdown_timeout,
                                   "summary": rows, "runs": runs})
        return 0

    return run_cli("serve_fault_check.py", body)


if __name__ == "__main__":
    sys.exit(main())
