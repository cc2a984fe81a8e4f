"""Layer 0: what every part of the project shares and nothing MoE-specific.

``cli`` (user errors, the one ``main`` runner, argparse types), ``files`` (atomic writes),
``process`` (exit codes, ending a process, machine identity), ``collectives`` (torch.distributed
on the group's device), ``watchdog`` (heartbeats and deadlines) and ``events`` (points in a loop
that tools subscribe to). It imports nothing of the project; everything may import it. ``cli``,
``files``, ``process``, ``watchdog`` and ``events`` are standard-library only, so
the torch-free cost model (``netsim``) uses them; importing this package imports none of its modules.
"""
