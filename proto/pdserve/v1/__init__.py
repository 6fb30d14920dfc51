"""pdserve.v1: the .proto files and their generated stubs (`python -m pdserve.proto.build`).

Import the modules you need, e.g. `from pdserve.proto.pdserve.v1 import decode_pb2, decode_pb2_grpc`.
"""
