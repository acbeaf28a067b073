"""Collective operations of a Communicator (issue 3). Filled in by the collectives work."""
from __future__ import annotations


class CollectivesMixin:
    """Mixed into Communicator; uses self._native, self.rank, self.size, self.timeout."""
