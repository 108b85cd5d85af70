"""Tied parameters: runtime/ties/, floor 1 of engine/runtime/.

Why a wing: one ``nn.Parameter`` used by several stages (a language model's token embedding
and its head) is trained as one parameter on every schedule (docs/ALGORITHMS.md, "Tied
parameters"). The builders, the step protocol and clipping ask it; it imports no other room.

Files:

- ``groups``: Ties found or declared, the holders' copies and their summed gradients.
- ``carry``: Asynchronous schedules: the owner's value travels with the micro-batch.
"""
