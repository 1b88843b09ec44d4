"""hyspec: exact speculative decoding for hybrid and attention models, served over gRPC."""

__version__ = "0.1.0"
