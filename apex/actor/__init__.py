"""The actor process: a handshake, then an algorithm's actor core in a loop."""
