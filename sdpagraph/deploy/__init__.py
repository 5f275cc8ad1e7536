"""Deployment: record the specs a program traces, keep them in spec files, precompile every graph
they need into a cache directory, and verify that a directory covers them."""
from sdpagraph.deploy.precompile import precompile
from sdpagraph.deploy.recording import record
from sdpagraph.deploy.verify import verify

__all__ = ["precompile", "record", "verify"]
