"""Model sources: fetch hf:// and s3:// models into the cache, resolve every URI to a directory."""
