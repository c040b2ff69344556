"""The control plane: NATS messages, transports, membership and the worker base every tier service uses."""
