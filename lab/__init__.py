"""Test rigs that tests and benchmarks both use: the network lab's hosts (network
namespaces on a bridge: `hosts`, `namespaces`), the services it starts on them (`services`)
and their reaper (`reaper`), and the child-process helper (`child`). Measurement and reports
stay in `bench`; nothing here imports `pdserve.deploy` (services start through the CLI)."""
