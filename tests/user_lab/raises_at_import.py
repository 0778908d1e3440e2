"""A module whose import fails with an error of its own (not an ImportError)."""

raise RuntimeError("the lab's cluster is not reachable")
