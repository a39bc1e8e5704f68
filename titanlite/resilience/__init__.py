"""Fault tolerance (notebook 13): failure injection now; checkpoint/resume and goodput follow."""
