"""The run dir as a locked, checked record (`rundir`) and rank 0's account of the steps (`progress`: `Book`,
`Progress`), used by the run's trainer (`asyncpipe.trainer`); nothing here imports an engine."""
