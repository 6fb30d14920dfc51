"""Test rigs that tests and benchmarks both use: the network lab's hosts (network
namespaces on a bridge), the services it starts on them and their reaper, and the
child-process helper. Measurement and reports stay in `bench`."""
