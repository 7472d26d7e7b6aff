"""Code shared by the specmesh services: frame codec, schemas, config, NATS helpers."""
