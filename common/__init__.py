"""What every pdserve component shares: typed errors and their wire table, the one reader of
environment variables, block hashing, the sampling table, small helpers. Imports neither torch nor grpc."""
