"""The gRPC service in front of the engine (jaxpage.v1.Generation)."""
