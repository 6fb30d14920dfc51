"""Generated pdserve.v1 protocol stubs live in `v1/` (see `pdserve.proto.build`)."""
