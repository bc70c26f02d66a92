"""Secondary tiers: the plugin interface and the built-in tiers."""
