"""Comparing two checkpoints: what differs (``checkpoint``), the structural rules that would
reproduce it (``structure``) and the check that they do (``check``)."""
