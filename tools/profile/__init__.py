"""Profilers whose output feeds netsim's serving model and the overlap analysis:

* ``serving_compute``  the compute of served engine steps per variant (``python -m netsim predict``);
* ``netsim_compute``   netsim's per-layer compute table measured on a GPU;
* ``replay_steps``     a served run's all-to-alls beside netsim's replay, step by step;
* ``overlap_windows``  where each all-to-all of a served prefill step finds its window;
* ``speed_probe``      how fast the machine itself is over time (fixed workloads at intervals);
* ``profile_spread``   how far apart profiles of the same checkpoints are (a method's stability).

Each is a command: ``python -m tools.profile.<name>`` (``scripts/`` keeps the documented names)."""
