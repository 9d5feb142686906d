"""Kubernetes manifests generated from code (`python -m deploy.kubernetes.generate`, `make manifests`): the server,
its Service, probes, autoscaling and monitoring objects."""
