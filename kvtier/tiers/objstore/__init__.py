"""The object tier: verified chunks in S3, GCS or a shared filesystem, reached through workload
identity. `backend` defines what a store must do; `s3`, `gcs` and `localfs` do it."""
