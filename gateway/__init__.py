"""The HTTP ingest gateway: devices POST perturbed records, the gateway checks them cheaply and
packs each request into one Kafka message (a version-2 container), answering 202 only once Kafka
acknowledged it with acks=all."""
