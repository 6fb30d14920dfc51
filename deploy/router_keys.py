"""`pdserve router-keys`: the router's key ring, derived from the cluster secret.

A router needs the call and block-hash keys only (`security.secret.ROUTER_USES`), never the
secret they come from (which would let it derive every other key). `pdserve up` writes the
ring itself; in the chart an init container runs this, with the secret mounted in it alone,
into a memory volume that the router's container reads as its `--cluster-secret-file`."""
from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("router-keys", help="write the router's key ring (not the secret) from the cluster secret",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster-secret-file", required=True, help="the cluster secret (a private file)")
    p.add_argument("--out", required=True, help="the key ring file to write (0600, replaced whole)")


def main(args: argparse.Namespace) -> int:
    from pdserve.security.secret import ROUTER_USES, ClusterSecret, ClusterSecretError, write_key_ring

    try:
        write_key_ring(ClusterSecret.load(args.cluster_secret_file), ROUTER_USES, args.out)
    except (ClusterSecretError, OSError) as exc:
        print(f"pdserve router-keys: {exc}", file=sys.stderr)
        return 2
    return 0
