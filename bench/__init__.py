"""bench: the `burst bench` measurements (attention.py: `burst bench attention`)."""
