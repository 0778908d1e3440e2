"""The simulator engine (`engine=simulate`): `loop.Trainer`, driven by the run lifecycle (`asyncpipe.session`)."""
