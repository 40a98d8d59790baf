"""Redis for every floor above: the one client factory, Redis Cluster, sharded pub/sub, and the
keyed waiters every store and status notification waits with."""
