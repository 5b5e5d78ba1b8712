"""The `amqp` source: queue mode (`queue_mode`: a driver-side consumer, acks at micro-batch commit), stream
mode (`stream_mode`: offset ranges of stream queues read on executors) and batch reads of both."""
