"""Modules a user might name by import path (`pipeline.schedule=user_lab.x`, `optimizer._target_=user_lab.x`) that
go wrong when imported: the bad-input table's cases (tests/test_bad_input_table.py)."""
