"""Deployment assets generated from code (Kubernetes manifests), checked offline by the tests."""
