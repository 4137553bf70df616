"""What apex asks of the operating system: files opened safely, logs, signals, the allocator."""
