"""The control channel between the scheduler process and the engines (ZeroMQ + msgpack)."""
