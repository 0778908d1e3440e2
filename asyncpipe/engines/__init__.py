"""The runtimes that execute a schedule, each an engine of the run's trainer (`runtime.protocol.Engine`): the delay
simulator (`engine=simulate`: `simulator.SimulatorEngine`, its per-stage staleness in `staged`) and the pipeline
runtime (`engine=pipeline`: `pipeline`, DeepSpeed's engine subclass and PyTorch's schedules). The two never import
each other; importing this package imports neither."""
