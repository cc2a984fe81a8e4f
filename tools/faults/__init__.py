"""Fault injection: what a training job or a server does when a rank is stopped, killed, stuck
or crashing, end to end under torchrun. ``python -m tools.faults <command>``:

* ``training``  kill -9 of a rank or the launcher during a save, SIGTERM, corrupt and crafted
                checkpoints, a reused save directory, and ranks that stop, hold the GIL, spin,
                segfault, abort or raise under ``torchrun --max-restarts`` (``training.py``)
* ``serving``   a fault in rank 1 of a two-rank server while a request is in flight: how fast
                ``/health``, the waiting client and the launcher see it (``serving.py``)
* ``serving-cases``  the serving end-to-end cases as one table of flag sets (front end process or
                torchrun; fixed port or 0; EP, TP, MLA) and faults (kill -9, SIGSTOP, segfault,
                exception; rank 0 or 1; a rank hung at start), each checked against what a user
                expects (``serving_cases.py``)
* ``chaos``     random faults of every kind during one long training run, against a fault-free
                run of the same steps (``chaos.py``)
* ``serving-chaos``  random faults (kill -9, SIGSTOP, segfault, an exception in a forward) in random
                ranks of a server under client load, against a fault-free run of the same load
                (``serving_chaos.py``)

Signals come from outside (``launch.py`` finds a rank's process); the faults only a rank can
cause itself (``inject.py``) are taken by ranks started as ``torchrun ... -m tools.faults.rank
{pretrain_gpt,serve} ARGS`` (``rank.py``), which subscribes an injector to the loop's
``STEP_END`` event: nothing of it ships in ``megatron``.
"""
