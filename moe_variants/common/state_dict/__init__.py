"""Checkpoint layouts apart from the model: one adapter module per layout.

A model module holds its parameters as it computes with them; an adapter here maps them to and from
the layout a checkpoint stores (torchtitan's ``StateDictAdapter`` beside its models is the model
for this split). ``grouped_experts``: ``GroupedExperts``' stacked parameters under
``SequentialMLP``'s per-expert keys, in ``state_dict()`` and in megatron-core's dist-checkpointing.
"""
