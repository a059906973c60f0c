"""The engine in the order data flows: plan/ (decide), run/ (write the shards), output/ (commit, audit, verify)."""
