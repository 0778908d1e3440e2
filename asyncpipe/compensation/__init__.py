"""The built-in staleness mitigations ("compensation methods"), one declaration module each
(`asyncpipe.registry.declare_method`): its settings node ``compensation.<key>``, their value checks, its memory
model, whether it fits the 2BW engine, and its builder by import path. Found by walking this package (no list).

These modules import no torch: `config`, `plan` and `report` read them in processes that never train. Each names
its update rule, a `Compensated` optimizer wrapper in the module of the same name in `asyncpipe.optim.compensation`
(where the derivation is written), which is imported only when a run builds the method.
"""
