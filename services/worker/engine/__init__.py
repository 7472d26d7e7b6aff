"""The engine: what one step of continuous batching does (schedule -> execute -> postprocess) and the
state it keeps between steps. The rest of services/worker/ is the mesh side: the NATS service, the queue worker,
the engine process and the messages between them."""
