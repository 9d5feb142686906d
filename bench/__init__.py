"""sightline's benchmarks, one module each: `python -m bench.<name>` (`make bench` runs the set)."""
