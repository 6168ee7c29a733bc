"""`pdserve simulate`: trace replay through the real cache manager and routing policies."""
