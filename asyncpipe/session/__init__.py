"""The run lifecycle shared by both engines (`lifecycle`), the run dir as a locked, checked record (`rundir`) and
progress output (`progress`). Engines plug in through `lifecycle.Engine`; nothing here imports an engine."""
