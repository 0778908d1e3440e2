"""The built-in optimizers, one module each (`asyncpipe.registry.declare_optimizer`): the keys it adds to
``optimizer.*``, their value checks, its memory model and its builder. Found by walking this package (no list).

These modules import no torch: `config`, `plan` and `report` read them in processes that never train. A builder
imports torch, and the update rules it needs from `asyncpipe.optim`, when a run builds the optimizer.
"""
