"""Tied parameters: runtime/ties/, floor 1 of engine/runtime/.

Why a wing: one ``nn.Parameter`` used by several stages (a language model's token embedding
and its output head) is trained as one parameter on every schedule: synchronous schedules
keep bitwise-equal copies whose gradients are summed, asynchronous ones carry the owner's
value with the micro-batch (docs/ALGORITHMS.md, "Tied parameters"). The builders, the step
protocol and gradient clipping ask this wing; it imports no other room.

Files:

- ``groups``: Tied parameters found or declared, the holders' copies, and the summed gradients
  of synchronous schedules.
- ``carry``: Tied parameters on asynchronous schedules: the owner's value travels with the
  micro-batch.
"""
