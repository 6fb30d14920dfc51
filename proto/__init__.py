"""pdserve.v1 protocol: the .proto files, their generated stubs (`pdserve/v1/*_pb2*.py`) and
the script that generates them (`build.py`). Nothing hand-written besides."""
