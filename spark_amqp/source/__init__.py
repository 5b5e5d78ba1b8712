"""The `amqp` source: queue mode (driver-side consumer, acks at micro-batch commit) and batch reads."""
