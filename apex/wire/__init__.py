"""The wire format: message types and their codec, the batch schemas, lz4 array frames."""
