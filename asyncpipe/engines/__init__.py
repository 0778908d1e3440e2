"""The simulator engine (`engine=simulate`): `simulator.SimulatorEngine`, driven by the run's trainer. (The pipeline
engine lives in `asyncpipe.pipe`, beside the DeepSpeed schedule it runs.)"""
