"""pdserve.v1 protocol: .proto files, generated stubs, and the block-hash definition.

This package imports neither torch nor grpc at import time.
"""
