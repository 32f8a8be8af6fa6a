"""The content-addressed KV store: host RAM and disk tiers, layout-neutral entries."""
