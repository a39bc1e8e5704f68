"""Fault tolerance (notebooks 12-13): DCP checkpoints and their staging, resume, failure injection."""
